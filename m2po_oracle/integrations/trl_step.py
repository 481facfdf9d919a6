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

from m2po_oracle.integrations.hf_window import LOGGED_METRICS, METRIC_PREFIX
from m2po_oracle.integrations.trl import M2POGRPOTrainer, TRLFaults

#: The planted bugs ``trainer:trl:NAME`` runs, with what must catch them and name them.
TRL_CONTROLS: dict[str, dict[str, Any]] = {
    "per_micro_batch_mask": {"description": "the mask is selected within each micro-batch TRL hands _compute_loss",
                             "caught_by": ("trainer.accumulation",), "diagnosed_as": "per_micro_batch_mask"},
    "per_micro_batch_denominator": {"description": "each micro-batch divides by its own valid count, then by the accumulation steps",
                                    "caught_by": ("trainer.accumulation", "gradient"), "diagnosed_as": "per_micro_batch_denominator"},
    "current_policy_as_behavior": {"description": "the prepass's log-probs (the current policy) are used as behaviour log-probs",
                                   "caught_by": ("trainer.behavior_logp",), "diagnosed_as": "current_policy_as_behavior"},
    "optimizer_step_per_micro_batch": {"description": "the wrapped optimizer steps after every micro-batch, past accelerate's accumulation guard",
                                       "caught_by": ("trainer.optimizer_step",), "diagnosed_as": "optimizer_step_per_micro_batch"},
    # Its steps run with a KL term (beta), without which the bug cannot show.
    "kl_k1_estimator": {"description": "the KL term uses the k1 estimator logp - ref_logp instead of TRL's k3", "caught_by": ("trainer.kl_term",),
                        "diagnosed_as": "kl_k1_estimator", "beta": 0.1},
}

_PAD, _BOS, _EOS = 0, 1, 2


def _tokenizer(vocab_size: int) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": _PAD, "<bos>": _BOS, "<eos>": _EOS, **{f"t{i}": i for i in range(3, vocab_size)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


def _equal_split(rows: int, wanted: int) -> int:
    return max(k for k in range(1, max(wanted, 1) + 1) if rows % k == 0)


def _share_of_multiples_of_three(completions: list[Any], completion_ids: list[list[int]], **_: Any) -> list[float]:
    """The seed trainer's reward: the share of a completion's tokens whose id is a multiple of 3."""
    return [sum(1 for t in ids if t % 3 == 0) / max(len(ids), 1) for ids in completion_ids]


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
        return torch.optim.AdamW(parameters, lr=self.config.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)

    def _options(self, rollout: Any, k: int, output_dir: str) -> dict[str, Any]:
        config = self.config
        rows = rollout.rows
        options: dict[str, Any] = dict(
            output_dir=output_dir, use_cpu=True, bf16=False, fp16=False, report_to="none", disable_dropout=True, gradient_checkpointing=False,
            per_device_train_batch_size=rows // k, gradient_accumulation_steps=k, steps_per_generation=k, num_iterations=1,
            num_generations=rollout.group_size, max_completion_length=int(rollout.completion_ids.shape[1]), learning_rate=config.lr,
            max_steps=1, logging_steps=1, save_strategy="no", max_grad_norm=0.0, lr_scheduler_type="constant", warmup_steps=0,
            optim="adamw_torch", weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, shuffle_dataset=False,
            scale_rewards="group", beta=config.beta, temperature=1.0, top_k=0, top_p=1.0, dataloader_num_workers=0, seed=0,
            log_completions=False)
        # The seed's fail-closed settings, in TRL's words.
        if config.importance_sampling_level != "token":
            options["importance_sampling_level"] = config.importance_sampling_level
        if config.rollout_importance_sampling_mode is not None:  # TRL's rollout-IS correction lives in its vLLM path
            options.update(use_vllm=True, vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=config.rollout_importance_sampling_mode.replace("tis", "truncate"))
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
                "logprobs": None if behaviour is None else [behaviour[r, : lengths[r]].double().tolist() for r in rows]}
            return out

        return rollout_func

    def step(self, rollout: Any, split: Any = None) -> Any:
        from datasets import Dataset

        from m2po_oracle.capture import load_capture
        from m2po_oracle.trainer.grpo import StepRecord

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        if self.config.rollout_backend == "deployment" and self.config.behavior_logp_source != "rollout":
            # TRL has no setting that recomputes an external engine's log-probs for the loss: the
            # integration always takes the engine's. The seed's setting has no TRL counterpart.
            raise ValueError("behavior_logp_source: TRL's rollout_func path always uses the engine's log-probs; recomputing them with the "
                             "trainer's weights is not a TRL option (this adapter refuses it rather than ignore it)")
        rows = rollout.rows
        parts = tuple(split) if split is not None else (rows,)
        k = _equal_split(rows, len(parts))
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

            trainer = M2POGRPOTrainer(model=policy, reward_funcs=_share_of_multiples_of_three, args=GRPOConfig(**self._options(rollout, k, scratch)),
                                      train_dataset=dataset, processing_class=_tokenizer(policy.config.vocab_size), rollout_func=rows_of_group,
                                      m2po_tau=self.config.tau, capture=capture, faults=self.faults)
            grads: dict[str, torch.Tensor] = {}
            trainer.add_callback(_KeepGradients(trainer, grads))
            for printer in (ProgressCallback, PrinterCallback):  # one step per example: no progress bar or log line each
                trainer.remove_callback(printer)
            with _rows_in_order(), torch.random.fork_rng(devices=[]):
                trainer.train()
            records = [record for _, record in load_capture(capture).records(step=0)]
        logged = next((entry for entry in trainer.state.log_history if f"{METRIC_PREFIX}masked_fraction" in entry), {})
        width = int(rollout.completion_ids.shape[1])
        pad = lambda t, fill: torch.nn.functional.pad(t, (0, width - t.shape[1]), value=fill)  # noqa: E731  # TRL pads to the longest row
        cat = lambda name, fill: torch.cat([pad(r[name], fill) for r in records])  # noqa: E731
        params = dict(policy.named_parameters())
        return StepRecord(
            logp=cat("logp", 0.0), behavior_logp=cat("behavior_logp", float("nan")), advantages=cat("advantages", 0.0), valid=cat("mask", False),
            keep=cat("keep", False), loss=float(sum(r["loss"] for r in records)),
            metrics={name: float(logged[METRIC_PREFIX + name]) for name in LOGGED_METRICS if METRIC_PREFIX + name in logged},
            token_grad=cat("grad", 0.0), param_grads={n: grads.get(n, torch.zeros_like(p)).detach().cpu() for n, p in params.items()},
            params_before=params_before, params_after={n: p.detach().cpu().clone() for n, p in params.items()}, split=(b,) * k,
            tau=float(self.config.tau), kl_term=0.0)


from transformers import PrinterCallback, ProgressCallback, TrainerCallback  # noqa: E402


class _KeepGradients(TrainerCallback):
    """Copies every parameter's gradient right before the optimizer step."""

    def __init__(self, trainer: Any, into: dict[str, torch.Tensor]) -> None:
        self.trainer, self.into = trainer, into

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        for name, p in self.trainer.model.named_parameters():
            if p.grad is not None:
                self.into[name] = p.grad.detach().cpu().clone()


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
    faults = TRLFaults(**{control: True}) if control else TRLFaults()

    def make(policy: Any, config: Any, **options: Any) -> TRLStep:
        return TRLStep(policy, config, faults=faults, **options)

    make.computes_in, make.computes_in_why = TRL_COMPUTE_DTYPE, TRL_COMPUTE_DTYPE_WHY  # type: ignore[attr-defined]  # mypy: a function takes no new attributes (read back by getattr)
    make.kl_coefficient = TRL_CONTROLS[control].get("beta", 0.0) if control else 0.0  # type: ignore[attr-defined]  # as above
    return make
