"""TRL's real GRPOTrainer behind the trainer contract: ``compare --impl trainer:trl``.

:class:`TRLStep` satisfies ``step(rollout, split) -> StepRecord`` by running one optimizer
step of :class:`~m2po_oracle.integrations.trl.M2POGRPOTrainer` with ``trainer.train()``:
TRL's ``_generate_and_score_completions`` (padding, masks, the reward function, GRPO
advantages, ``num_items_in_batch``), ``_prepare_inputs``'s buffering and splitting into
micro-batches, the integration's prepass and ``_compute_loss`` through TRL's own
log-prob forward, the HF Trainer's gradient accumulation and its AdamW step.

What the harness decides instead of TRL, and why:

* the rollout: the case's completions, sampled by stale workers, enter through TRL's
  ``rollout_func`` (its interface for an external engine, which returns the engine's
  log-probs), so the behaviour log-probs are the engine's, as with vLLM;
* the row order: TRL shuffles the generation batch before splitting it
  (``shuffle_sequence_dict``); the step replaces that shuffle with the identity (and the
  dataset's with ``shuffle_dataset=False``) so that micro-batch ``i`` holds the case's
  rows ``i*b .. (i+1)*b``, which the checks and the diagnosis need;
* the split: TRL splits a generation batch into equal micro-batches of
  ``per_device_train_batch_size`` rows. An uneven case split runs as ``k`` equal
  micro-batches, ``k`` the largest divisor of the row count not above the case's count
  of micro-batches; the record's ``split`` says what ran;
* gradient clipping is off (``max_grad_norm=0``) so that the reported parameter gradient
  is the loss's, and the learning rate is constant.

The controls ``trainer:trl:NAME`` plant :class:`~m2po_oracle.integrations.trl.TRLFaults`.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any

import torch

from m2po_oracle.capture import load_capture
from m2po_oracle.integrations.hf_step import (
    KeepGradients,
    adamw,
    case_tokenizer,
    equal_split,
    quiet,
    share_of_multiples_of_three,
    step_record,
)
from m2po_oracle.integrations.hf_window import METRIC_PREFIX
from m2po_oracle.integrations.trl import M2POGRPOTrainer, TRLFaults
from m2po_oracle.trainer.controls import TrainerControl, integrated_controls

#: The planted bugs ``trainer:trl:NAME`` runs, with what must catch them and name them.
TRL_CONTROLS: dict[str, TrainerControl] = {c.name: c for c in integrated_controls("TRL", "_compute_loss")}


def _reward(completions: list[Any], completion_ids: list[list[int]], **_: Any) -> list[float]:
    """The case's reward in TRL's reward-function signature."""
    return share_of_multiples_of_three(completion_ids)


@contextlib.contextmanager
def _rows_in_order() -> Any:
    import trl.trainer.grpo_trainer as grpo_trainer

    shuffle = grpo_trainer.shuffle_sequence_dict
    grpo_trainer.shuffle_sequence_dict = lambda seq_dict: seq_dict
    try:
        yield
    finally:
        grpo_trainer.shuffle_sequence_dict = shuffle


class TRLStep:
    """One optimizer step of TRL's GRPOTrainer with M2PO per :meth:`step` (the trainer contract)."""

    def __init__(self, policy: Any, config: Any, *, behaviour: Any = None, reference: Any = None, faults: TRLFaults | None = None) -> None:
        self.policy, self.config, self.behaviour, self.reference = policy, config, behaviour, reference
        self.faults = faults or TRLFaults()

    def make_optimizer(self, parameters: Any) -> torch.optim.Optimizer:
        # The HF Trainer's "adamw_torch" with its defaults (betas 0.9/0.999, eps 1e-8, no weight decay).
        return adamw(parameters, self.config.lr)

    def _options(self, rollout: Any, k: int, output_dir: str) -> dict[str, Any]:
        config = self.config
        rows = rollout.rows
        options: dict[str, Any] = dict(
            output_dir=output_dir,
            use_cpu=True,
            bf16=False,
            fp16=False,
            report_to="none",
            disable_dropout=True,
            gradient_checkpointing=False,
            per_device_train_batch_size=rows // k,
            gradient_accumulation_steps=k,
            steps_per_generation=k,
            num_iterations=1,
            num_generations=rollout.group_size,
            max_completion_length=int(rollout.completion_ids.shape[1]),
            learning_rate=config.lr,
            max_steps=1,
            logging_steps=1,
            save_strategy="no",
            max_grad_norm=0.0,
            lr_scheduler_type="constant",
            warmup_steps=0,
            optim="adamw_torch",
            weight_decay=0.0,
            adam_beta1=0.9,
            adam_beta2=0.999,
            adam_epsilon=1e-8,
            shuffle_dataset=False,
            scale_rewards="group",
            beta=config.beta,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            dataloader_num_workers=0,
            seed=0,
            log_completions=False,
        )
        # The seed's fail-closed settings, in TRL's words.
        if config.importance_sampling_level != "token":
            options["importance_sampling_level"] = config.importance_sampling_level
        if config.rollout_importance_sampling_mode is not None:  # TRL's rollout-IS correction lives in its vLLM path
            options.update(
                use_vllm=True,
                vllm_importance_sampling_correction=True,
                vllm_importance_sampling_mode=config.rollout_importance_sampling_mode.replace("tis", "truncate"),
            )
        return options

    def _rollout_func(self, rollout: Any) -> Any:
        valid = rollout.valid.cpu()
        lengths = valid.sum(dim=1).tolist()
        behaviour = rollout.behavior_logp

        def rollout_func(prompts: list[Any], trainer: Any) -> dict[str, Any]:
            rows = [int(p.split()[0][1:]) for p in prompts]  # each prompt names its row ("r5 ...")
            out: dict[str, Any] = {
                "prompt_ids": [rollout.prompt_ids[r].tolist() for r in rows],
                "completion_ids": [rollout.completion_ids[r, : lengths[r]].tolist() for r in rows],
                "logprobs": None if behaviour is None else [behaviour[r, : lengths[r]].double().tolist() for r in rows],
            }
            return out

        return rollout_func

    def step(self, rollout: Any, split: Any = None) -> Any:
        from datasets import Dataset

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        if self.config.rollout_backend == "deployment" and self.config.behavior_logp_source != "rollout":
            # TRL has no setting that recomputes an external engine's log-probs for the loss: the
            # integration always takes the engine's. The seed's setting has no TRL counterpart.
            raise ValueError(
                "behavior_logp_source: TRL's rollout_func path always uses the engine's log-probs; recomputing them with the "
                "trainer's weights is not a TRL option (this adapter refuses it rather than ignore it)"
            )
        rows = rollout.rows
        parts = tuple(split) if split is not None else (rows,)
        k = equal_split(rows, len(parts))
        b = rows // k
        policy = self.policy
        params_before = {n: p.detach().cpu().clone() for n, p in policy.named_parameters()}
        with tempfile.TemporaryDirectory(prefix="m2po-trl-step-") as scratch:
            if self.config.beta != 0:
                # TRL builds its KL reference from the policy's path: the reference model, saved.
                self.reference.save_pretrained(os.path.join(scratch, "reference"))
                policy.config._name_or_path = os.path.join(scratch, "reference")
            # One prompt per row ("r<row>"), each repeated group_size times by TRL's sampler.
            dataset = Dataset.from_dict({"prompt": [f"r{g * rollout.group_size} g" for g in range(rows // rollout.group_size)]})
            capture = os.path.join(scratch, "capture")
            rollout_func = self._rollout_func(rollout)

            def rows_of_group(prompts: list[Any], trainer: Any) -> dict[str, Any]:
                counts: dict[str, int] = {}
                named = []
                for p in prompts:  # the i-th repeat of group g is row g*group_size + i
                    i = counts.get(p, 0)
                    counts[p] = i + 1
                    named.append(f"r{int(p.split()[0][1:]) + i}")
                return rollout_func(named, trainer)

            from trl import GRPOConfig

            trainer = M2POGRPOTrainer(
                model=policy,
                reward_funcs=_reward,
                args=GRPOConfig(**self._options(rollout, k, scratch)),
                train_dataset=dataset,
                processing_class=case_tokenizer(policy.config.vocab_size),
                rollout_func=rows_of_group,
                m2po_tau=self.config.tau,
                capture=capture,
                faults=self.faults,
            )
            grads: dict[str, torch.Tensor] = {}
            trainer.add_callback(KeepGradients(trainer, grads))
            quiet(trainer)
            with _rows_in_order(), torch.random.fork_rng(devices=[]):
                trainer.train()
            records = [record for _, record in load_capture(capture).records(step=0)]
        logged = next((entry for entry in trainer.state.log_history if f"{METRIC_PREFIX}masked_fraction" in entry), {})
        return step_record(
            records, rollout, logged=logged, grads=grads, policy=policy, params_before=params_before, split=(b,) * k, tau=self.config.tau
        )


#: The dtype TRL's step computes its log-probs in, and why: what ``--dtype`` must be (and what
#: a run without ``--dtype`` takes).
TRL_COMPUTE_DTYPE = "float32"
TRL_COMPUTE_DTYPE_WHY = "its log-probs come from a chunked LM-head kernel that accumulates in float32 whatever the model's dtype"


def trl_trainer(control: str | None = None) -> Any:
    """The factory ``compare --impl trainer:trl[:CONTROL]`` runs: ``(policy, config, *, behaviour, reference) -> TRLStep``.

    It declares the one dtype the step computes in (``computes_in``, ``computes_in_why``),
    which the trainer runner takes when ``--dtype`` is not given, and the KL coefficient the
    control's steps run with (``kl_coefficient``)."""
    if control is not None and control not in TRL_CONTROLS:
        raise ValueError(f"control: unknown TRL control {control!r}; known: {', '.join(TRL_CONTROLS)}")
    faults = TRLFaults(**{name: bool(on) for name, on in TRL_CONTROLS[control].faults.items()}) if control else TRLFaults()

    def make(policy: Any, config: Any, **options: Any) -> TRLStep:
        return TRLStep(policy, config, faults=faults, **options)

    make.computes_in, make.computes_in_why = TRL_COMPUTE_DTYPE, TRL_COMPUTE_DTYPE_WHY  # type: ignore[attr-defined]  # mypy: a function takes no new attributes (read back by getattr)
    make.kl_coefficient = TRL_CONTROLS[control].beta if control else 0.0  # type: ignore[attr-defined]  # as above
    return make
