"""M2PO in ms-swift's GRPO trainer (ms-swift 4.6), one selection per optimizer batch.

ms-swift hands ``_compute_loss_and_metrics`` one micro-batch at a time: the HF Trainer calls
``training_step`` per micro-batch of the accumulation window, and ms-swift's
``_prepare_inputs`` returns ``self._buffered_inputs[self._step % steps_per_generation]``,
each a ``{"model_inputs", "grpo_batch"}`` dict that ``_prepare_batch_inputs`` collated when
the generation batch was sampled (with the sampling weights' ``old_per_token_logps``).
Selecting inside ``_compute_loss_and_metrics`` alone would select per micro-batch. The
whole window is buffered when its first micro-batch arrives, so
:class:`M2POSwiftGRPOTrainer` runs, on that first micro-batch, a no-grad **prepass** over
every micro-batch of the window (ms-swift's own ``_get_per_token_logps_and_entropies``),
selects once with ``core.select_micro_batches`` (across the data-parallel group when there is
one: every rank's window, one N), and then builds each micro-batch's loss from its part of
that selection with the window's N. ms-swift's generation, scoring,
buffering, splitting, the HF Trainer's accumulation and optimizer step run unchanged.

Loaded with ``swift rlhf --rlhf_type grpo --external_plugins PLUGIN`` where PLUGIN is
:data:`PLUGIN_FILE` (``python -m m2po_oracle.integrations.swift`` prints it). ms-swift has
no command-line channel for a plugin's own options, so they are environment variables:

* ``M2PO_TAU`` (default 0.04): the second-moment budget;
* ``M2PO_CAPTURE``: a directory; every micro-batch is recorded with
  :class:`m2po_oracle.capture.Recorder` for ``m2po-oracle audit``;
* ``M2PO_CAPTURE_EVERY`` (default 1);
* ``M2PO_SWIFT_FAULT``: a planted bug (:class:`SwiftFaults`), a negative control only.

With ms-swift's own engine at temperature 1 the trainer asks it for the sampled tokens'
log-probs too (ms-swift asks only vLLM for them), so a capture holds the sampler's log-probs
next to the behaviour log-probs and the audit compares them. (The engine reports raw-logit
log-probs; at another temperature they are not the sampler's, and none are recorded.)

Behaviour log-probs: with ms-swift's own (transformers) engine they are
``grpo_batch.old_per_token_logps``, which ``_prepare_batch_inputs`` computes with the weights
that sampled the generation batch; with vLLM, or another engine outside the trainer (a
subclass that says so with ``rollouts_from_outside``), they must be the engine's
(``rollout_per_token_logps``). Settings under which the step would not compute Algorithm 1
are refused with a ``ValueError`` naming the ms-swift option (:func:`check_m2po_args`).
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from swift.rlhf_trainers.grpo_trainer import GRPOTrainer

from m2po_oracle.capture.recorder import Recorder
from m2po_oracle.integrations.hf_window import (
    NoteParameterGradients,
    Window,
    buffered_window,
    check_window_fits_the_generation_batch,
    dp_group,
    micro_batch_share,
    open_window,
    record_micro_batch,
    summed_over_ranks,
    token_advantages,
)
from m2po_oracle.trainer.grpo import M2POKLWarning
from m2po_oracle.trainer.guard import (
    NO_ENTROPY_MASK,
    TOKEN_LEVEL_RATIOS,
    Refusal,
    dapo_normaliser,
    full_distribution,
    no_liger,
    option,
    refuse,
)

#: The metrics M2POSwiftGRPOTrainer adds to ms-swift's logs, once per optimizer batch (as the TRL integration's).
#: The file ``--external_plugins`` takes. It sits in a folder of its own because ms-swift puts a
#: plugin's folder first on ``sys.path``: this folder holds ``trl.py`` and ``swift.py``, which
#: would shadow the real packages.
PLUGIN_FILE = Path(__file__).with_name("swift_plugin") / "m2po_swift_plugin.py"
TRAINER_PATH = "m2po_oracle.integrations.swift.M2POSwiftGRPOTrainer"


@dataclass(frozen=True)
class SwiftFaults:
    """Planted bugs in this integration (negative controls); all off is the correct one."""

    per_micro_batch_mask: bool = False  # select within each micro-batch ms-swift hands the loss (the naive hook)
    per_micro_batch_denominator: bool = False  # each micro-batch divides by its own N, then by the accumulation steps
    current_policy_as_behavior: bool = False  # the prepass (current policy) used as behaviour log-probs
    optimizer_step_per_micro_batch: bool = False  # optimizer.step() after every micro-batch
    kl_k1_estimator: bool = False  # the KL term uses k1, logp - ref_logp, instead of ms-swift's k3
    per_rank_selection: bool = False  # each data-parallel rank selects over its own window alone (the global N kept)


def faults_from_environment(environ: Any = None) -> SwiftFaults:
    """``M2PO_SWIFT_FAULT=NAME`` plants one fault; an unknown name is an error, never ignored."""
    name = (environ if environ is not None else os.environ).get("M2PO_SWIFT_FAULT", "").strip()
    if not name:
        return SwiftFaults()
    known = [f.name for f in fields(SwiftFaults)]
    if name not in known:
        raise ValueError(f"M2PO_SWIFT_FAULT: unknown fault {name!r}; known: {', '.join(known)}")
    return SwiftFaults(**{name: True})


def tau_from_environment(environ: Any = None) -> float:
    raw = (environ if environ is not None else os.environ).get("M2PO_TAU", "0.04")
    try:
        tau = float(raw)
    except ValueError:
        raise ValueError(f"M2PO_TAU: expected a finite number >= 0, got {raw!r}") from None
    if not math.isfinite(tau) or tau < 0:
        raise ValueError(f"M2PO_TAU: expected a finite number >= 0, got {raw!r}")
    return tau


#: The ms-swift settings under which the step would not compute Algorithm 1's objective, in the order they are checked.
SWIFT_REFUSALS: tuple[Refusal, ...] = (
    dapo_normaliser("ms-swift's window-normalised 'dapo'", "pass --loss_type dapo"),
    TOKEN_LEVEL_RATIOS,
    Refusal(
        "rollout_importance_sampling_mode",
        lambda a: option(a, "rollout_importance_sampling_mode", None) is not None,
        lambda a: (
            f"rollout_importance_sampling_mode: an extra rollout importance-sampling correction "
            f"({option(a, 'rollout_importance_sampling_mode')!r}) on top of M2PO corrects the same ratio twice; "
            "M2PO's ratio is already taken against the behaviour log-probs (leave it unset)"
        ),
    ),
    NO_ENTROPY_MASK,
    Refusal(
        "off_policy_sequence_mask_delta",
        lambda a: option(a, "off_policy_sequence_mask_delta", None) is not None,
        lambda a: (
            f"off_policy_sequence_mask_delta: an off-policy sequence mask (got "
            f"{option(a, 'off_policy_sequence_mask_delta')}) drops sequences Algorithm 1 keeps; M2PO's mask is its only "
            "mask (leave it unset)"
        ),
    ),
    Refusal(
        "overlong_filter",
        lambda a: bool(option(a, "overlong_filter", False)),
        lambda a: (
            "overlong_filter: dropping truncated completions from the loss is a mask Algorithm 1 does not have, and it "
            "would change N (set it to False)"
        ),
    ),
    no_liger("ms-swift"),
    Refusal(
        "async_generate",
        lambda a: bool(option(a, "async_generate", False)),
        lambda a: (
            "async_generate: completions sampled asynchronously come from weights older than those ms-swift computes "
            "old_per_token_logps with, so the behaviour log-probs would not be the sampler's (set it to False)"
        ),
    ),
    Refusal(
        "sdar_loss_coef",
        lambda a: (option(a, "sdar_loss_coef", 0.0) or 0.0) > 0,
        lambda a: (
            f"sdar_loss_coef: a distillation term (got {option(a, 'sdar_loss_coef')}) is added to the loss; Algorithm 1 "
            "has none (set it to 0)"
        ),
    ),
    full_distribution("top_p", 1.0, "ms-swift"),
    full_distribution("repetition_penalty", 1.0, "ms-swift"),
    full_distribution("top_k", -1, "ms-swift", also_neutral=(0,), fix=" (set it to -1)"),
)


def check_m2po_args(args: Any, *, world_size: int = 1, sequence_parallel_size: int = 1, collective: bool = False) -> None:
    """Refuse, naming the ms-swift option, every setting under which the step would not compute
    Algorithm 1's objective; warn for ``beta != 0``. ``collective``: the trainer selects once
    across the data-parallel group (:class:`M2POSwiftGRPOTrainer` does), without which more
    than one process is refused."""
    check_window_fits_the_generation_batch(args)
    refuse(args, SWIFT_REFUSALS)
    if world_size > 1 and not collective:
        raise ValueError(
            f"nproc_per_node: without a selection across the data-parallel group, each of the {world_size} processes would "
            "select over its own window only (run one process, or select with core.select_micro_batches(..., group=))"
        )
    if sequence_parallel_size > 1:
        raise ValueError(
            f"sequence_parallel_size: the window's micro-batches are sequence shards here (got {sequence_parallel_size}); "
            "this integration selects over whole sequences of one process (set it to 1)"
        )
    beta = float(option(args, "beta", 0.0) or 0.0)
    if beta != 0:
        warnings.warn(
            f"beta={beta}: a non-zero KL coefficient adds beta * KL to the M2PO objective (the reference experiments use beta=0; "
            "pass --beta 0)",
            M2POKLWarning,
            stacklevel=3,
        )


class M2POSwiftGRPOTrainer(GRPOTrainer):
    """ms-swift's ``GRPOTrainer`` with the M2PO loss (Algorithm 1), selected once per optimizer batch.

    Options come from the environment (module docstring), so that ``swift rlhf`` can load it
    through ``--external_plugins`` alone.
    """

    #: Whether the completions come from an engine outside the trainer (whose weights need not
    #: be the trainer's) besides vLLM: then, as with vLLM, only the engine's own log-probs
    #: (``rollout_per_token_logps``) are the behaviour policy's. A subclass whose engine is
    #: such an engine says so here.
    rollouts_from_outside: bool = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.m2po_tau = tau_from_environment()
        self.m2po_faults = faults_from_environment()
        training_args = kwargs.get("args")
        if training_args is None:
            raise ValueError("args: M2POSwiftGRPOTrainer needs ms-swift's GRPOConfig (its options decide whether M2PO can run)")
        # One selection across the data-parallel group (_start_window): more than one process is allowed.
        check_m2po_args(
            training_args,
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
            sequence_parallel_size=int(option(training_args, "sequence_parallel_size", 1) or 1),
            collective=True,
        )
        if kwargs.get("chord_sft_dataset") is not None:
            raise ValueError("chord_sft_dataset: CHORD adds a supervised term to the loss; Algorithm 1 has none (leave it unset)")
        self._capture_directory = os.environ.get("M2PO_CAPTURE") or None
        self._capture_every = int(os.environ.get("M2PO_CAPTURE_EVERY", "1"))
        self._recorder: Any = None
        self._window: Window | None = None
        self._windows_started = 0
        super().__init__(*args, **kwargs)
        if self._has_teacher_explicit():
            raise ValueError(
                "teacher_model: OPD-RL adds the teacher's KL to the advantages; Algorithm 1's advantages are the rewards' (leave it unset)"
            )
        if not self.args.use_vllm and float(self.args.temperature) == 1.0:
            # ms-swift asks its own engine for no log-probs (it asks vLLM only); asking for them
            # puts the sampler's log-probs in rollout_per_token_logps, which the capture records
            # next to the behaviour log-probs for the audit to compare. Nothing else reads them here.
            # Only at temperature 1: the engine reports log-softmax of the raw logits
            # (generate's output_logits) while it samples from logits / temperature, so at
            # another temperature its numbers are not the sampler's (observed at 0.9: off by up
            # to 0.135 from old_per_token_logps, which do divide by the temperature).
            self.request_config.logprobs = True
        self.add_callback(NoteParameterGradients(self))

    # --- the loss --------------------------------------------------------------------------

    def _recording(self) -> Any:
        if self._capture_directory is None:
            return None
        if self._recorder is None:
            world = self.accelerator.num_processes
            self._recorder = Recorder(
                self._capture_directory,
                rank=self.accelerator.process_index,
                world_size=world,
                topology=f"dp={world},cp=1,tp=1",
                every=self._capture_every,
            )
        return self._recorder

    def _logps(self, model: Any, micro: dict[str, Any]) -> torch.Tensor:
        logps, _ = self._get_per_token_logps_and_entropies(model, micro["model_inputs"], micro["grpo_batch"], compute_entropy=False)
        return logps

    def _behaviour(self, grpo_batch: Any, prepass: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.m2po_faults.current_policy_as_behavior:
            return prepass
        if self.args.use_vllm or self.rollouts_from_outside:
            # An engine outside the trainer sampled: only its own log-probs are the behaviour policy's.
            sampled = grpo_batch.rollout_per_token_logps
            if sampled is None or bool(torch.isnan(sampled[mask]).any()):
                engine = "vLLM engine" if self.args.use_vllm else "rollout engine outside the trainer"
                raise ValueError(
                    f"behavior_logp: the {engine} returned no log-probs (or NaN) for some sampled tokens; M2PO fails closed "
                    "rather than fall back to log-probs recomputed by the trainer"
                )
            return sampled
        old = grpo_batch.old_per_token_logps
        if old is None:
            raise ValueError(
                "behavior_logp: ms-swift computed no old_per_token_logps for this generation batch; M2PO fails closed rather "
                "than take the current policy as the behaviour policy"
            )
        return old

    def _start_window(self, model: Any, position: int) -> Window:
        size, buffered = buffered_window(self, model, position, "use a model whose config has no dropout (LoRA: --lora_dropout 0)")
        prepass, behavior, advantages, masks, sampler = [], [], [], [], []
        with torch.no_grad():
            for micro in buffered:
                grpo_batch = micro["grpo_batch"]
                if grpo_batch.teacher_per_token_logps is not None:
                    raise ValueError(
                        "teacher_prompt: the batch carries an on-policy self-distillation teacher (OPD-RL), whose KL "
                        "ms-swift adds to the advantages; Algorithm 1's advantages are the rewards' (drop teacher_prompt)"
                    )
                logps = self._logps(model, micro).detach()
                mask = grpo_batch.completion_mask.bool()
                prepass.append(logps)
                behavior.append(self._behaviour(grpo_batch, logps, mask).detach())
                advantages.append(token_advantages(grpo_batch.advantages, logps))
                masks.append(mask)
                sampler.append(grpo_batch.rollout_per_token_logps)
        return open_window(
            self,
            size,
            prepass,
            behavior,
            advantages,
            masks,
            sampler,
            group=dp_group(self.accelerator),
            per_rank=self.m2po_faults.per_rank_selection,
        )

    def _compute_loss_and_metrics(self, model: Any, model_inputs: dict[str, Any], grpo_batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        if not self.model.training:
            raise ValueError(
                "eval_strategy: M2POSwiftGRPOTrainer does not evaluate (M2PO's selection is defined on a training optimizer "
                "batch); pass --eval_strategy no"
            )
        position = self._step % self.args.steps_per_generation
        buffered = self._buffered_inputs
        if buffered is None or buffered[position]["grpo_batch"] is not grpo_batch:
            raise RuntimeError(
                "M2POSwiftGRPOTrainer: the micro-batch is not the buffered one ms-swift's _prepare_inputs hands over; this "
                "ms-swift version buffers differently from 4.6"
            )
        micro = position % self.current_gradient_accumulation_steps
        if micro == 0 or self._window is None:
            self._window = self._start_window(model, position)
        window = self._window
        logps, _ = self._get_per_token_logps_and_entropies(model, model_inputs, grpo_batch, compute_entropy=False)
        # DDP averages the ranks' gradients; each rank's share is over the global N, so the sum is wanted.
        logp = summed_over_ranks(logps, self.accelerator.num_processes)
        selection, mask = window.selections[micro], window.masks[micro]
        share = micro_batch_share(logp, window, micro, own_denominator=self.m2po_faults.per_micro_batch_denominator)
        if self.beta != 0.0:
            # ms-swift's own k3 estimator, over the valid tokens, divided by the window's N.
            safe = torch.clamp(grpo_batch.ref_per_token_logps - logp, min=-20, max=20)
            per_token_kl = -safe if self.m2po_faults.kl_k1_estimator else torch.clamp(torch.exp(safe) - safe - 1, min=-10, max=10)
            share = share + self.beta * torch.where(mask, per_token_kl, torch.zeros_like(per_token_kl)).sum() / selection.valid_count.clamp(
                min=1
            )
        recorder = self._recording()
        if recorder is not None:
            sampler = window.sampler[micro]
            record_micro_batch(
                recorder,
                window,
                micro,
                logp,
                share,
                self.m2po_tau,
                None if sampler is None else torch.where(mask, sampler.to(logp.dtype), torch.nan),
            )
        # The HF Trainer divides every micro-batch's loss by the accumulation steps before backward;
        # the share is already the window's (N is the window's), so that division is undone here.
        loss = share.to(logp.dtype) * self.current_gradient_accumulation_steps
        metrics_data = {"mode": "train", "entropy": {}, "completion_mask": mask, "completion_token_count": mask.sum().clamp(min=1)}
        return loss, metrics_data

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        output = super().training_step(model, inputs, num_items_in_batch)
        if self.m2po_faults.optimizer_step_per_micro_batch and self._step % self.current_gradient_accumulation_steps:
            # The planted bug: a step inside the window (the Trainer still steps at its end). The
            # accelerate wrapper skips steps while it accumulates, so the bug reaches past it.
            assert self.optimizer is not None  # created before the first training step
            inner: Any = getattr(self.optimizer, "optimizer", self.optimizer)  # the optimizer accelerate wraps
            inner.step()
        return output

    def _compute_loss_chunked(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(
            "dynamic_num_samples: ms-swift computes this batch in chunks of a varying number of samples (multi-turn "
            "rollouts); M2PO's window is fixed micro-batches here (use single-turn rollouts)"
        )

    def compute_liger_loss(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError("use_liger_kernel: Liger's fused GRPO loss would bypass the M2PO loss (set it to False)")


def install() -> None:
    """Make ``swift rlhf --rlhf_type grpo`` build :class:`M2POSwiftGRPOTrainer` (what the plugin file calls)."""
    from swift.trainers.trainer_factory import TrainerFactory

    tau_from_environment()  # a bad M2PO_TAU / M2PO_SWIFT_FAULT fails at plugin load, before any model is built
    faults_from_environment()
    TrainerFactory.TRAINER_MAPPING["grpo"] = TRAINER_PATH


if __name__ == "__main__":
    print(PLUGIN_FILE)
