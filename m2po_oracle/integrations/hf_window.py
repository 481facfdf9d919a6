"""What the TRL and ms-swift integrations share: both hook a Hugging Face Trainer subclass
whose generation batch is buffered, so an optimizer batch's micro-batches are all known when
its first one runs (one selection per window). Framework-neutral: imports transformers only."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import TrainerCallback

from m2po_oracle.core.loss import loss_from_selection, select_micro_batches
from m2po_oracle.trainer.grpo import selection_metrics, stochastic_layers
from m2po_oracle.trainer.guard import option


class GradScale(torch.autograd.Function):
    """Identity forward, gradient times ``factor`` backward: DDP averages gradients over the
    data-parallel group, and the global objective wants their sum. The factor sits between
    the model and the recorded log-probs, so a capture holds d loss / d logp without it."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def summed_over_ranks(logp: torch.Tensor, world: int) -> torch.Tensor:
    """``logp`` whose gradient DDP's average over ``world`` ranks turns into the sum."""
    return GradScale.apply(logp, float(world)) if world > 1 else logp


def dp_group(accelerator: Any) -> Any:
    """The data-parallel group one selection spans (None in one process)."""
    if accelerator.num_processes > 1:
        import torch.distributed as dist

        return dist.group.WORLD
    return None


def check_window_fits_the_generation_batch(args: Any) -> None:
    """Refuse a window that would straddle two buffered generation batches (naming the option)."""
    ga = int(option(args, "gradient_accumulation_steps", 1))
    spg = int(option(args, "steps_per_generation", None) or ga)
    if spg % ga:
        raise ValueError(
            f"steps_per_generation: must be a multiple of gradient_accumulation_steps ({ga}) so that every optimizer batch "
            f"lies inside one buffered generation batch (M2PO selects over the whole window before its first micro-batch); "
            f"got {spg}"
        )


@dataclass
class Window:
    """The current optimizer batch: its micro-batches' inputs and one selection over them."""

    index: int  # optimizer steps since training began (the capture's step)
    size: int
    behavior: list[torch.Tensor]
    advantages: list[torch.Tensor]
    masks: list[torch.Tensor]
    prepass: list[torch.Tensor]
    selections: list[Any]
    sampler: list[torch.Tensor | None]


class NoteParameterGradients(TrainerCallback):
    """Notes the parameters' gradient norms right before each optimizer step (after clipping),
    for a trainer with a ``_recorder`` (a capture's, or None) and its current ``_window``."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer
        if trainer._recorder is not None and trainer._window is not None:
            trainer._recorder.record_parameter_gradients(step=trainer._window.index, named_parameters=trainer.model.named_parameters())


#: The selection's metrics each trainer logs, under this prefix (``m2po/m2_before``, ...).
LOGGED_METRICS = ("m2_before", "m2_after", "masked_fraction", "trust_region_fraction")
METRIC_PREFIX = "m2po/"


def select_window(
    inputs: list[tuple[torch.Tensor, ...]], tau: float, *, group: Any = None, per_micro_batch: bool = False, per_rank: bool = False
) -> list[Any]:
    """One selection over the window's micro-batches ``(logp, behavior_logp, advantages, mask)``
    (across ``group``); ``per_micro_batch``/``per_rank`` plant the scope bugs of the negative
    controls: each micro-batch, or each rank, selected alone, the window's N kept (as a natural
    port logs it)."""
    whole = select_micro_batches(inputs, tau=tau, group=group)
    if per_micro_batch:
        return [replace(select_micro_batches([part], tau=tau)[0], valid_count=w.valid_count) for part, w in zip(inputs, whole)]
    if per_rank:
        return [replace(alone, valid_count=w.valid_count) for alone, w in zip(select_micro_batches(inputs, tau=tau), whole)]
    return whole


def buffered_window(trainer: Any, model: Any, position: int, dropout_hint: str) -> tuple[int, list[Any]]:
    """The accumulation steps and the buffered micro-batches of the window holding
    ``position``, once the policy is known deterministic (a stochastic prepass would select
    on another forward than the loss pass's; ``dropout_hint`` says how to turn it off)."""
    stochastic = stochastic_layers(trainer.accelerator.unwrap_model(model))
    if stochastic:
        raise ValueError(
            "disable_dropout: the mask prepass must be deterministic, but the policy has stochastic layers: "
            f"{', '.join(stochastic)}; {dropout_hint}"
        )
    size = trainer.current_gradient_accumulation_steps
    first = position - position % size
    return size, trainer._buffered_inputs[first : first + size]


def token_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Per-sequence advantages (one per row) or per-token ones, as a tensor shaped and typed like ``like``."""
    return (advantages[:, None] if advantages.dim() == 1 else advantages).expand_as(like).to(like.dtype)


def open_window(
    trainer: Any,
    size: int,
    prepass: list[torch.Tensor],
    behavior: list[torch.Tensor],
    advantages: list[torch.Tensor],
    masks: list[torch.Tensor],
    sampler: list[torch.Tensor | None],
    *,
    group: Any = None,
    per_rank: bool = False,
) -> Window:
    """The window's one selection (with the trainer's planted scope fault, if any), its
    record, and its metrics logged; counts the trainer's windows."""
    per_micro_batch = trainer.m2po_faults.per_micro_batch_mask
    selections = select_window(
        list(zip(prepass, behavior, advantages, masks)), trainer.m2po_tau, group=group, per_micro_batch=per_micro_batch, per_rank=per_rank
    )
    window = Window(trainer._windows_started, size, behavior, advantages, masks, prepass, selections, sampler)
    trainer._windows_started += 1
    log_window_metrics(trainer._metrics["train"], selections, per_micro_batch)
    return window


def log_window_metrics(logged: dict[str, list[float]], selections: list[Any], per_micro_batch: bool) -> None:
    """The window's selection metrics into a trainer's metric lists (a per-micro-batch selection has no one set)."""
    if per_micro_batch:
        return
    for name, value in selection_metrics(selections[0]).items():
        if name in LOGGED_METRICS:
            logged[METRIC_PREFIX + name].append(float(value))


def micro_batch_share(logp: torch.Tensor, window: Window, micro: int, *, own_denominator: bool = False) -> torch.Tensor:
    """The micro-batch's share of the window's M2PO loss: its kept terms over the window's N
    (``own_denominator`` plants the bug: its own N, then divided by the accumulation steps)."""
    selection = window.selections[micro]
    behavior, advantages, mask = window.behavior[micro], window.advantages[micro], window.masks[micro]
    if own_denominator:
        return loss_from_selection(logp, behavior, advantages, selection.keep, mask.sum()) / window.size
    return loss_from_selection(logp, behavior, advantages, selection.keep, selection.valid_count)


def record_micro_batch(
    recorder: Any, window: Window, micro: int, logp: torch.Tensor, loss: torch.Tensor, tau: float, rollout_logp: torch.Tensor | None
) -> None:
    """One micro-batch into a capture (``m2po_oracle.capture.Recorder``), its gradient watched."""
    selection = window.selections[micro]
    recorder.record(
        step=window.index,
        micro_batch=micro,
        logp=logp,
        behavior_logp=window.behavior[micro],
        advantages=window.advantages[micro],
        mask=window.masks[micro],
        keep=selection.keep,
        loss=float(loss.detach()),
        tau=tau,
        metrics=selection_metrics(selection),
        selection_logp=window.prepass[micro],
        rollout_logp=rollout_logp,
    )
    recorder.watch_gradient(logp)
