"""What the TRL and ms-swift steps behind the trainer contract share (``compare --impl
trainer:trl``, ``trainer:swift``): the case's tokenizer and reward in a framework's terms, the
equal split a framework can run, the parameter gradients noted before the optimizer step,
and the :class:`~m2po_oracle.trainer.grpo.StepRecord` built from the step's capture.
Framework-neutral: imports transformers only."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from transformers import TrainerCallback

from m2po_oracle.integrations.hf_window import LOGGED_METRICS, METRIC_PREFIX
from m2po_oracle.trainer.grpo import BOS_ID, EOS_ID, PAD_ID, StepRecord

#: The learning-rate schedule and optimizer settings both steps pin (the HF Trainer's
#: ``adamw_torch`` with its defaults, no weight decay, a constant rate, no clipping): what
#: :func:`adamw` replays.
ADAMW = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


def case_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer over the case's toy vocabulary: ``t<id>`` is token ``id``
    (``<pad>``, ``<bos>``, ``<eos>`` the special ones), split on whitespace, nothing added."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD_ID, "<bos>": BOS_ID, "<eos>": EOS_ID, **{f"t{i}": i for i in range(3, vocab_size)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


def as_text(ids: Iterable[int]) -> str:
    """Token ids as :func:`case_tokenizer` reads them back."""
    return " ".join(f"t{int(i)}" for i in ids)


def equal_split(rows: int, wanted: int) -> int:
    """The count of equal micro-batches a framework runs for a case that asks for ``wanted``:
    the largest divisor of ``rows`` not above it."""
    return max(k for k in range(1, max(wanted, 1) + 1) if rows % k == 0)


def share_of_multiples_of_three(completion_ids: Iterable[Iterable[int]]) -> list[float]:
    """The case's reward (``trainer.grpo.reward``) of each completion, given its valid tokens:
    the share of its tokens whose id is a multiple of 3."""
    out = []
    for ids in completion_ids:
        ids = list(ids)
        out.append(sum(1 for t in ids if t % 3 == 0) / max(len(ids), 1))
    return out


def adamw(parameters: Any, lr: float) -> torch.optim.Optimizer:
    """The optimizer both steps run, for the trainer contract's ``make_optimizer``."""
    return torch.optim.AdamW(parameters, lr=lr, **ADAMW)  # type: ignore[arg-type]


class KeepGradients(TrainerCallback):
    """Copies every parameter's gradient right before the optimizer step (into ``into``)."""

    def __init__(self, trainer: Any, into: dict[str, torch.Tensor]) -> None:
        self.trainer, self.into = trainer, into

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        for name, p in self.trainer.model.named_parameters():
            if p.grad is not None:
                self.into[name] = p.grad.detach().cpu().clone()


def quiet(trainer: Any) -> None:
    """No progress bar or log line per step: one step runs per example."""
    from transformers import PrinterCallback, ProgressCallback

    for printer in (ProgressCallback, PrinterCallback):
        trainer.remove_callback(printer)


def step_record(
    records: list[dict[str, Any]],
    rollout: Any,
    *,
    logged: dict[str, Any],
    grads: dict[str, torch.Tensor],
    policy: Any,
    params_before: dict[str, torch.Tensor],
    split: tuple[int, ...],
    tau: float,
) -> Any:
    """The step's :class:`~m2po_oracle.trainer.grpo.StepRecord` from its captured micro-batches
    (in row order), each widened to the rollout's width (a framework pads a micro-batch to its
    longest row); ``logged``: the log entry holding the selection's metrics."""
    if sum(int(r["mask"].shape[0]) for r in records) != rollout.rows:
        raise RuntimeError(
            f"step record: the capture holds {sum(int(r['mask'].shape[0]) for r in records)} rows in "
            f"{len(records)} micro-batch(es); the rollout has {rollout.rows}"
        )
    width = int(rollout.completion_ids.shape[1])
    pad = lambda t, fill: torch.nn.functional.pad(t, (0, width - t.shape[1]), value=fill)  # noqa: E731
    cat = lambda name, fill: torch.cat([pad(r[name], fill) for r in records])  # noqa: E731
    params = dict(policy.named_parameters())
    return StepRecord(
        logp=cat("logp", 0.0),
        behavior_logp=cat("behavior_logp", float("nan")),
        advantages=cat("advantages", 0.0),
        valid=cat("mask", False),
        keep=cat("keep", False),
        loss=float(sum(r["loss"] for r in records)),
        metrics={name: float(logged[METRIC_PREFIX + name]) for name in LOGGED_METRICS if METRIC_PREFIX + name in logged},
        token_grad=cat("grad", 0.0),
        param_grads={n: grads.get(n, torch.zeros_like(p)).detach().cpu() for n, p in params.items()},
        params_before=params_before,
        params_after={n: p.detach().cpu().clone() for n, p in params.items()},
        split=split,
        tau=float(tau),
        kl_term=0.0,
    )
