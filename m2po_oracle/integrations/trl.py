"""M2PO in TRL's ``GRPOTrainer`` (TRL 1.16), one selection per optimizer batch.

TRL hands ``_compute_loss`` one micro-batch at a time: the HF Trainer calls
``training_step`` per micro-batch of the accumulation window, and ``_prepare_inputs``
returns ``self._buffered_inputs[self._step % steps_per_generation]``. Selecting inside
``_compute_loss`` alone would select per micro-batch. But the whole window is already
buffered when its first micro-batch arrives, so :class:`M2POGRPOTrainer` runs, on that
first micro-batch, a no-grad **prepass** over every micro-batch of the window (TRL's own
``_get_per_token_logps_and_entropies``), selects once with
``core.select_micro_batches`` (across the data-parallel group when there is one), and
then builds each micro-batch's loss from its part of that selection with the window's N.
TRL's generation, buffering, splitting, ``old_per_token_logps``, the HF Trainer's
accumulation and optimizer step all run unchanged.

Behaviour log-probs: with HF generation they are TRL's ``old_per_token_logps`` (recomputed
under the weights that sampled, at generation time), or the current policy when TRL
deems the batch on-policy (it then computes none; the policy has not moved). With vLLM or
a ``rollout_func`` they must be the engine's own (``sampling_per_token_logps``). The sampler's log-probs of
HF generation are recorded from ``generate``'s scores and passed down TRL's own
``logprobs`` channel, so a capture can hold them next to the behaviour log-probs.

Settings that would silently change the objective are refused with a ``ValueError``
naming the option (:func:`check_m2po_args`); ``beta != 0`` is allowed with an
``M2POKLWarning``. ``capture=DIR`` records every micro-batch for ``m2po-oracle audit``.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from trl import GRPOTrainer

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

if TYPE_CHECKING:
    from trl import GRPOConfig

#: The metrics M2POGRPOTrainer adds to TRL's logs, once per optimizer batch.


@dataclass(frozen=True)
class TRLFaults:
    """Planted bugs in this integration (negative controls); all off is the correct one."""

    per_micro_batch_mask: bool = False  # select within each micro-batch (the naive _compute_loss)
    per_micro_batch_denominator: bool = False  # each micro-batch divides by its own N, then by the accumulation steps
    current_policy_as_behavior: bool = False  # the prepass (current policy) used as behaviour log-probs
    optimizer_step_per_micro_batch: bool = False  # optimizer.step() after every micro-batch
    per_rank_selection: bool = False  # each data-parallel rank selects over its own window alone (the global N kept)
    kl_k1_estimator: bool = False  # the KL term uses k1, logp - ref_logp, instead of TRL's k3


#: The GRPOConfig settings under which TRL's step would not compute Algorithm 1's objective, in the order they are checked.
TRL_REFUSALS: tuple[Refusal, ...] = (
    dapo_normaliser("TRL's 'dapo' normaliser, its default", "set 'dapo'"),
    TOKEN_LEVEL_RATIOS,
    Refusal(
        "vllm_importance_sampling_correction",
        lambda a: bool(option(a, "use_vllm", False) and option(a, "vllm_importance_sampling_correction", False)),
        lambda a: (
            "vllm_importance_sampling_correction: an extra rollout importance-sampling correction on top of M2PO corrects the "
            "same ratio twice; M2PO's ratio is already taken against the engine's log-probs (set it to False)"
        ),
    ),
    Refusal(
        "use_transformers_continuous_batching",
        lambda a: bool(option(a, "use_transformers_continuous_batching", False)),
        lambda a: (
            "use_transformers_continuous_batching: this generation path returns no log-probs of the sampled tokens and casts the "
            "model it samples with; M2PO fails closed rather than trust log-probs it cannot check (use regular generation)"
        ),
    ),
    NO_ENTROPY_MASK,
    Refusal(
        "off_policy_mask_threshold",
        lambda a: option(a, "off_policy_mask_threshold", None) is not None,
        lambda a: (
            f"off_policy_mask_threshold: an off-policy sequence mask (got {option(a, 'off_policy_mask_threshold')}) drops "
            "sequences Algorithm 1 keeps; M2PO's mask is its only mask (set it to None)"
        ),
    ),
    Refusal(
        "entropy_coef",
        lambda a: bool(option(a, "entropy_coef", 0.0) or option(a, "use_adaptive_entropy", False)),
        lambda a: (
            f"entropy_coef: an entropy bonus (entropy_coef={option(a, 'entropy_coef')}) adds a term Algorithm 1 does not have (set it to 0)"
        ),
    ),
    no_liger("TRL", ("use_liger_kernel", "use_liger_loss")),
    full_distribution("top_p", 1.0, "TRL"),
    full_distribution("top_k", 0, "TRL"),
    full_distribution("repetition_penalty", 1.0, "TRL"),
    full_distribution("min_p", None, "TRL"),
)


def check_m2po_args(args: Any) -> None:
    """Refuse, naming the option, every GRPOConfig setting under which TRL's step would not
    compute Algorithm 1's objective; warn for ``beta != 0``."""
    check_window_fits_the_generation_batch(args)
    refuse(args, TRL_REFUSALS)
    beta = float(option(args, "beta", 0.0) or 0.0)
    if beta != 0:
        warnings.warn(
            f"beta={beta}: a non-zero KL coefficient adds beta * KL to the M2PO objective (the reference experiments use beta=0)",
            M2POKLWarning,
            stacklevel=3,
        )


class M2POGRPOTrainer(GRPOTrainer):
    """TRL's ``GRPOTrainer`` with the M2PO loss (Algorithm 1), selected once per optimizer batch.

    ``m2po_tau``: the second-moment budget. ``capture``: a directory; every micro-batch is
    recorded with ``m2po_oracle.capture.Recorder`` (one per rank) for ``m2po-oracle audit``.
    ``faults``: planted bugs for the negative controls (never in production).
    """

    args: GRPOConfig  # TRL's Trainer declares TrainingArguments; a GRPOTrainer's are its GRPOConfig

    def __init__(
        self,
        *args: Any,
        m2po_tau: float = 0.04,
        capture: str | Path | None = None,
        capture_every: int = 1,
        faults: TRLFaults | None = None,
        **kwargs: Any,
    ) -> None:
        if isinstance(m2po_tau, bool) or not isinstance(m2po_tau, (int, float)) or not math.isfinite(m2po_tau) or m2po_tau < 0:
            raise ValueError(f"m2po_tau: expected a finite number >= 0, got {m2po_tau!r}")
        training_args = kwargs.get("args", args[2] if len(args) > 2 else None)
        if training_args is None:
            raise ValueError("args: M2POGRPOTrainer needs an explicit GRPOConfig (its options decide whether M2PO can run)")
        check_m2po_args(training_args)
        self.m2po_tau = float(m2po_tau)
        self.m2po_faults = faults or TRLFaults()
        self._capture_directory = capture
        self._capture_every = capture_every
        self._recorder: Any = None
        self._window: Window | None = None
        self._windows_started = 0
        super().__init__(*args, **kwargs)
        self.add_callback(NoteParameterGradients(self))

    # --- generation: the sampler's log-probs down TRL's own channel -----------------------------

    def _generate_single_turn(
        self, prompt_ids: Any, images: Any, multimodal_fields: Any, num_generations: Any, has_tool_images: bool = False
    ) -> Any:
        if self.use_vllm or self.use_transformers_continuous_batching:
            completion_ids, logprobs = super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
            if self.use_vllm and logprobs is None:
                raise ValueError(
                    "behavior_logp: the vLLM engine returned no log-probs of the sampled tokens; M2PO fails closed rather "
                    "than fall back to log-probs recomputed by the trainer"
                )
            return completion_ids, logprobs
        model = self.accelerator.unwrap_model(self.model_wrapped)
        seen: dict[str, Any] = {}
        original = model.generate

        def generate(*generate_args: Any, **generate_kwargs: Any) -> Any:
            # The same call TRL makes, asking generate for the scores it sampled from.
            out = original(*generate_args, **generate_kwargs, output_scores=True, return_dict_in_generate=True)
            seen["scores"] = out.scores
            return out.sequences

        model.generate = generate
        try:
            completion_ids, _ = super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        finally:
            del model.generate  # the instance attribute goes; the class's generate is back
        scores = seen.get("scores")
        if scores is None:
            return completion_ids, None
        # scores are the logits the sampler drew from (after temperature): [rows, steps, vocab].
        sampled_from = torch.log_softmax(torch.stack(scores, dim=1).double(), dim=-1).cpu()
        sampler = [
            sampled_from[row, : len(ids)].gather(-1, torch.tensor(ids, dtype=torch.long)[:, None])[:, 0].tolist()
            for row, ids in enumerate(completion_ids)
        ]
        return completion_ids, sampler

    # --- the loss --------------------------------------------------------------------------

    def _dp_group(self) -> Any:
        return dp_group(self.accelerator)

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

    def _logps(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        logps, _, _ = self._get_per_token_logps_and_entropies(model, input_ids, attention_mask, completion_ids.size(1))
        return logps

    @staticmethod
    def _loss_mask(inputs: dict[str, Any]) -> torch.Tensor:
        mask = inputs["completion_mask"].bool()
        return mask & inputs["tool_mask"].bool() if "tool_mask" in inputs else mask

    def _behaviour(self, inputs: dict[str, Any], prepass: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.m2po_faults.current_policy_as_behavior:
            return prepass
        if self.use_vllm or self.rollout_func is not None:
            # An engine outside the trainer sampled (vLLM, or a rollout_func): its weights need
            # not be the trainer's, so only its own log-probs are the behaviour policy's.
            sampled = inputs.get("sampling_per_token_logps")
            if sampled is None or bool(torch.isnan(sampled[mask]).any()):
                engine = "vLLM engine" if self.use_vllm else "rollout_func"
                raise ValueError(
                    f"behavior_logp: the {engine} returned no log-probs (or NaN) for some sampled tokens; M2PO fails closed "
                    "rather than fall back to log-probs recomputed by the trainer"
                )
            return sampled
        old = inputs.get("old_per_token_logps")
        # TRL computes none when the window was generated by the current policy (on-policy).
        return prepass if old is None else old

    def _start_window(self, model: Any, position: int) -> Window:
        size, buffered = buffered_window(self, model, position, "set disable_dropout=True (LoRA: lora_dropout=0)")
        prepass, behavior, advantages, masks, sampler = [], [], [], [], []
        with torch.no_grad():
            for micro in buffered:
                logps = self._logps(model, micro)
                mask = self._loss_mask(micro)
                prepass.append(logps.detach())
                behavior.append(self._behaviour(micro, logps.detach(), mask).detach())
                advantages.append(token_advantages(micro["advantages"], logps))
                masks.append(mask)
                sampler.append(micro.get("sampling_per_token_logps"))
        return open_window(
            self, size, prepass, behavior, advantages, masks, sampler, group=self._dp_group(), per_rank=self.m2po_faults.per_rank_selection
        )

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        assert self.model is not None  # a GRPOTrainer is made with its model
        if not self.model.training:
            raise ValueError(
                "eval_strategy: M2POGRPOTrainer does not evaluate (M2PO's selection is defined on a training optimizer batch "
                "and TRL's eval batches are neither buffered nor accumulated); set eval_strategy='no'"
            )
        assert self.args.steps_per_generation is not None  # GRPOConfig.__post_init__ sets it
        position = self._step % self.args.steps_per_generation
        if self._buffered_inputs is None or self._buffered_inputs[position] is not inputs:
            raise RuntimeError(
                "M2POGRPOTrainer: the micro-batch is not the buffered one TRL's _prepare_inputs hands over; this TRL version "
                "buffers differently from 1.16"
            )
        micro = position % self.current_gradient_accumulation_steps
        if micro == 0 or self._window is None:
            self._window = self._start_window(model, position)
        window = self._window
        logps = self._logps(model, inputs)
        world = self.accelerator.num_processes
        logp = summed_over_ranks(logps, world)
        selection, mask = window.selections[micro], window.masks[micro]
        loss = micro_batch_share(logp, window, micro, own_denominator=self.m2po_faults.per_micro_batch_denominator)
        if self.beta != 0.0:
            reference = inputs["ref_per_token_logps"]
            per_token_kl = logp - reference if self.m2po_faults.kl_k1_estimator else torch.exp(reference - logp) - (reference - logp) - 1
            loss = loss + self.beta * torch.where(mask, per_token_kl, torch.zeros_like(per_token_kl)).sum() / selection.valid_count.clamp(
                min=1
            )
        recorder = self._recording()
        if recorder is not None:
            sampler = window.sampler[micro]
            record_micro_batch(
                recorder, window, micro, logp, loss, self.m2po_tau, None if sampler is None else torch.where(mask, sampler, torch.nan)
            )
        return loss.to(logps.dtype)

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        output = super().training_step(model, inputs, num_items_in_batch)
        if self.m2po_faults.optimizer_step_per_micro_batch and self._step % self.current_gradient_accumulation_steps:
            # The planted bug: a step inside the window (the Trainer still steps at its end). The
            # accelerate wrapper skips steps while it accumulates, so the bug reaches past it.
            assert self.optimizer is not None  # created before the first training step
            getattr(self.optimizer, "optimizer", self.optimizer).step()
        return output
