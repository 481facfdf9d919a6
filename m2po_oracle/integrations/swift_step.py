"""ms-swift's real GRPO trainer behind the trainer contract: ``compare --impl trainer:swift``.

:class:`SwiftStep` satisfies ``step(rollout, split) -> StepRecord`` by running one optimizer
step of :class:`~m2po_oracle.integrations.swift.M2POSwiftGRPOTrainer` the way ``swift rlhf``
builds it: ms-swift's argument parsing, model and template loading (the case's policy saved
with ``save_pretrained``), its dataset pipeline, its ``TrainerFactory``, and ``trainer.train()``
with its sampler, ``_generate_and_score_completions`` (the reward function, GRPO advantages,
encoding, collation into micro-batches, ``old_per_token_logps``, the reference model's
log-probs), ``_prepare_inputs``'s buffering, the integration's prepass and loss, the HF
Trainer's gradient accumulation and its AdamW step.

What the harness decides instead of ms-swift, and why:

* the rollout: the case's completions, sampled by stale workers, enter at ms-swift's engine
  boundary (``_engine_infer``, which returns an engine's ``RolloutOutput`` with its token ids
  and log-probs), so the behaviour log-probs are the engine's (``rollout_per_token_logps``),
  as with vLLM. ms-swift's ``old_per_token_logps`` are computed by the trainer's weights when
  the generation batch is collated; here those weights are not the ones that sampled, so the
  trainer says its rollouts come from outside (``rollouts_from_outside``) and M2PO takes the
  engine's;
* the row order: the dataset and the dataloader are not shuffled (``--dataset_shuffle
  false``, ``--train_dataloader_shuffle false``), so that micro-batch ``i`` holds the case's
  rows ``i*b .. (i+1)*b``, which the checks and the diagnosis need; every request the engine
  gets is checked to be the row it is answered with;
* the split: ms-swift splits a generation batch into equal micro-batches of
  ``per_device_train_batch_size`` rows. An uneven case split runs as ``k`` equal
  micro-batches, ``k`` the largest divisor of the row count not above the case's count of
  micro-batches; the record's ``split`` says what ran;
* the template: one of the project's own (``m2po_trainer_case``: the prompt's tokens, then
  the completion's, nothing around them), so that the model sees exactly the case's
  sequences;
* gradient clipping is off (``--max_grad_norm 0``) so that the reported parameter gradient
  is the loss's, and the learning rate is constant.

The controls ``trainer:swift:NAME`` plant :class:`~m2po_oracle.integrations.swift.SwiftFaults`.
This module imports ms-swift only when a step runs, so that the registry of controls reads
without it.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import tempfile
from pathlib import Path
from typing import Any

import torch

from m2po_oracle.capture import load_capture
from m2po_oracle.integrations.hf_step import (
    KeepGradients,
    adamw,
    as_text,
    case_tokenizer,
    equal_split,
    quiet,
    share_of_multiples_of_three,
    step_record,
)
from m2po_oracle.trainer.controls import TrainerControl, integrated_controls
from m2po_oracle.trainer.grpo import EOS_ID

#: The planted bugs ``trainer:swift:NAME`` runs, with what must catch them and name them.
SWIFT_CONTROLS: dict[str, TrainerControl] = {c.name: c for c in integrated_controls("ms-swift", "_compute_loss_and_metrics")}

#: The dtype ms-swift's step computes in, and why: what ``--dtype`` must be (and what a run
#: without ``--dtype`` takes).
SWIFT_COMPUTE_DTYPE = "float32"
SWIFT_COMPUTE_DTYPE_WHY = (
    "ms-swift collates the engine's log-probs into float32 (rollout_per_token_logps) whatever the model's "
    "dtype, and the step loads the case's policy with --torch_dtype float32"
)
#: The template the step registers: the prompt's tokens, then the completion's, nothing else.
TEMPLATE = "m2po_trainer_case"
#: The case's reward, registered as an ms-swift ORM under this name.
REWARD = "m2po_trainer_case_reward"
#: The trainer class the step points ms-swift's TrainerFactory at while it runs.
TRAINER_PATH = "m2po_oracle.integrations.swift_step.CaseRolloutTrainer"


def _register() -> None:
    """The step's template and reward, registered with ms-swift (idempotent)."""
    from swift.rewards import ORM, orms
    from swift.template import TemplateMeta, register_template

    register_template(TemplateMeta(TEMPLATE, prefix=[], prompt=["{{QUERY}}"], chat_sep=None, suffix=[]), exist_ok=True)

    class CaseReward(ORM):
        """The case's reward (``trainer.grpo.reward``) on the completion's token ids."""

        def __call__(self, completions: list[Any], response_token_ids: list[Any] | None = None, **kwargs: Any) -> list[float]:
            if response_token_ids is None:
                raise ValueError("reward: ms-swift passed no response_token_ids; the case's reward is defined on token ids")
            return share_of_multiples_of_three(response_token_ids)

    orms[REWARD] = CaseReward


def _case_trainer_class() -> Any:
    """:class:`CaseRolloutTrainer`, defined once ms-swift is importable."""
    from swift.infer_engine.protocol import ChatCompletionResponse, ChatCompletionResponseChoice, ChatMessage, RolloutOutput, UsageInfo

    from m2po_oracle.integrations.swift import M2POSwiftGRPOTrainer

    class CaseRolloutTrainer(M2POSwiftGRPOTrainer):
        """The M2PO trainer whose engine answers each request with the case's completion of
        that row and the stale worker's log-probs (an engine outside the trainer)."""

        rollouts_from_outside = True
        m2po_case: Any = None  # (rollout, answered rows) while a step runs

        def _engine_infer(self, infer_requests: list[Any], request_config: Any = None, **kwargs: Any) -> list[Any]:
            rollout, answered = self.m2po_case
            valid = rollout.valid.cpu()
            behaviour = rollout.behavior_logp
            outputs = []
            for request in infer_requests:
                row = len(answered)
                asked = request.messages[-1]["content"]
                if row >= rollout.rows:
                    raise RuntimeError(
                        f"rollout: the engine got request {row} ({asked!r}) of a step with {rollout.rows} rows; ms-swift asked "
                        "for more completions than the case's generation batch holds"
                    )
                prompt = as_text(rollout.prompt_ids[row].tolist())
                if asked != prompt:
                    raise RuntimeError(
                        f"rollout: request {row} asks for {asked!r}, but the case's row {row} has prompt {prompt!r}; ms-swift "
                        "no longer hands the engine the dataset's rows in order (the step pins that order)"
                    )
                length = int(valid[row].sum())
                ids = rollout.completion_ids[row, :length].tolist()
                logprobs = (
                    None
                    if behaviour is None
                    else {
                        "content": [
                            {"token": f"t{t}", "logprob": float(lp)} for t, lp in zip(ids, behaviour[row, :length].double().tolist())
                        ]
                    }
                )
                ended = ids[-1] == EOS_ID  # else the completion ran to max_completion_length
                choice = ChatCompletionResponseChoice(
                    index=0,
                    message=ChatMessage(role="assistant", content=as_text(ids)),
                    finish_reason="stop" if ended else "length",
                    logprobs=logprobs,
                    token_ids=ids,
                )
                usage = UsageInfo(
                    prompt_tokens=len(rollout.prompt_ids[row]), completion_tokens=length, total_tokens=len(rollout.prompt_ids[row]) + length
                )
                outputs.append(RolloutOutput(response=ChatCompletionResponse(model="m2po-trainer-case", choices=[choice], usage=usage)))
                answered.append(row)
            return outputs

    return CaseRolloutTrainer


def __getattr__(name: str) -> Any:
    # ms-swift's TrainerFactory imports the trainer by its path: built on first access.
    if name == "CaseRolloutTrainer":
        cls = _case_trainer_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@contextlib.contextmanager
def _environment(values: dict[str, str | None]) -> Any:
    """The plugin's options (environment variables), set for the step and restored after it."""
    before = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _trainer_factory_builds(path: str) -> Any:
    from swift.trainers.trainer_factory import TrainerFactory

    mapping = TrainerFactory.TRAINER_MAPPING
    before = mapping["grpo"]
    mapping["grpo"] = path
    try:
        yield
    finally:
        mapping["grpo"] = before


@contextlib.contextmanager
def _random_state_kept() -> Any:
    """ms-swift seeds Python's, NumPy's and torch's generators; the caller's are restored."""
    import numpy as np

    python, numpy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy)


@contextlib.contextmanager
def _quiet() -> Any:
    """ms-swift's and transformers' log lines below errors (its arguments, the model, the
    dataset, a trust_remote_code warning per load) and their progress bars off while a step
    runs: one step runs per example, and a step that goes wrong raises."""
    import logging

    from datasets.utils import logging as datasets_logging
    from transformers.utils import logging as transformers_logging

    swift_logger = logging.getLogger("swift")
    level, verbosity = swift_logger.level, transformers_logging.get_verbosity()
    bars = datasets_logging.is_progress_bar_enabled(), transformers_logging.is_progress_bar_enabled()
    swift_logger.setLevel(logging.ERROR)
    transformers_logging.set_verbosity_error()
    datasets_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        swift_logger.setLevel(level)
        transformers_logging.set_verbosity(verbosity)
        if bars[0]:
            datasets_logging.enable_progress_bar()
        if bars[1]:
            transformers_logging.enable_progress_bar()


class SwiftStep:
    """One optimizer step of ms-swift's GRPO trainer with M2PO per :meth:`step` (the trainer contract)."""

    def __init__(self, policy: Any, config: Any, *, behaviour: Any = None, reference: Any = None, fault: str | None = None) -> None:
        self.policy, self.config, self.behaviour, self.reference = policy, config, behaviour, reference
        self.fault = fault

    def make_optimizer(self, parameters: Any) -> torch.optim.Optimizer:
        # The HF Trainer's "adamw_torch" with its defaults (betas 0.9/0.999, eps 1e-8, no weight decay).
        return adamw(parameters, self.config.lr)

    def _arguments(self, rollout: Any, k: int, model: Path, dataset: Path, output_dir: Path, reference: Path | None) -> list[str]:
        config = self.config
        rows = rollout.rows
        options: dict[str, Any] = dict(
            rlhf_type="grpo",
            model=model,
            model_type="llama",
            template=TEMPLATE,
            check_model="false",
            use_vllm="false",
            dataset=dataset,
            reward_funcs=REWARD,
            output_dir=output_dir,
            loss_type="dapo",
            beta=config.beta,
            num_generations=rollout.group_size,
            per_device_train_batch_size=rows // k,
            gradient_accumulation_steps=k,
            steps_per_generation=k,
            num_iterations=1,
            max_completion_length=int(rollout.completion_ids.shape[1]),
            learning_rate=config.lr,
            max_steps=1,
            max_grad_norm=0,
            temperature=1.0,
            top_k=-1,
            top_p=1.0,
            repetition_penalty=1.0,
            seed=0,
            data_seed=0,
            torch_dtype="float32",
            tuner_type="full",
            logging_steps=1,
            save_strategy="no",
            eval_strategy="no",
            split_dataset_ratio=0,
            dataloader_num_workers=0,
            dataset_num_proc=1,
            lr_scheduler_type="constant",
            warmup_ratio=0,
            optim="adamw_torch",
            weight_decay=0,
            adam_beta1=0.9,
            adam_beta2=0.999,
            adam_epsilon=1e-8,
            dataset_shuffle="false",
            train_dataloader_shuffle="false",
            report_to="none",
            use_cpu="true",
            gradient_checkpointing="false",
            log_completions="false",
            attn_impl="eager",
        )
        if reference is not None:
            options["ref_model"] = reference
        # The seed's fail-closed settings, in ms-swift's words (the integration refuses them).
        if config.importance_sampling_level != "token":
            options["importance_sampling_level"] = config.importance_sampling_level
        if config.rollout_importance_sampling_mode is not None:
            options["rollout_importance_sampling_mode"] = config.rollout_importance_sampling_mode.replace("tis", "truncate")
        argv: list[str] = []
        for name, value in options.items():
            argv += [f"--{name}", str(value)]
        return argv

    def step(self, rollout: Any, split: Any = None) -> Any:
        from swift.pipelines.train.rlhf import SwiftRLHF

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("MODELSCOPE_OFFLINE", "1")
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        if self.config.rollout_backend == "deployment" and self.config.behavior_logp_source != "rollout":
            # An engine outside the trainer: the integration always takes its log-probs (the
            # trainer's weights are not the sampler's). The seed's setting has no ms-swift counterpart.
            raise ValueError(
                "behavior_logp_source: with an engine outside the trainer the integration always uses the engine's log-probs; "
                "recomputing them with the trainer's weights is not an ms-swift option (this adapter refuses it rather than "
                "ignore it)"
            )
        _register()
        rows = rollout.rows
        parts = tuple(split) if split is not None else (rows,)
        k = equal_split(rows, len(parts))
        policy = self.policy
        params_before = {n: p.detach().cpu().clone() for n, p in policy.named_parameters()}
        grads: dict[str, torch.Tensor] = {}
        seen: dict[str, Any] = {}

        class Run(SwiftRLHF):
            def train(self, trainer: Any) -> Any:  # ms-swift's pipeline hands over the trainer it built
                seen["trainer"] = trainer
                trainer.m2po_case = (rollout, [])
                trainer.add_callback(KeepGradients(trainer, grads))
                quiet(trainer)
                trainer.train()

        with tempfile.TemporaryDirectory(prefix="m2po-swift-step-") as tmp, _quiet():
            scratch = Path(tmp)
            tokenizer = case_tokenizer(policy.config.vocab_size)
            policy.save_pretrained(scratch / "model")
            tokenizer.save_pretrained(scratch / "model")
            reference = None
            if self.config.beta != 0:
                reference = scratch / "reference"
                self.reference.save_pretrained(reference)
                tokenizer.save_pretrained(reference)
            dataset = scratch / "prompts.jsonl"
            # One row per prompt group; ms-swift's sampler repeats each group_size times.
            with dataset.open("w") as out:
                for g in range(rows // rollout.group_size):
                    prompt = as_text(rollout.prompt_ids[g * rollout.group_size].tolist())
                    out.write(json.dumps({"messages": [{"role": "user", "content": prompt}]}) + "\n")
            capture = scratch / "capture"
            argv = self._arguments(rollout, k, scratch / "model", dataset, scratch / "output", reference)
            plugin = {
                "M2PO_TAU": repr(float(self.config.tau)),
                "M2PO_CAPTURE": str(capture),
                "M2PO_CAPTURE_EVERY": "1",
                "M2PO_SWIFT_FAULT": self.fault,
            }
            with _environment(plugin), _trainer_factory_builds(TRAINER_PATH), _random_state_kept():
                Run(argv).main()
            trainer = seen["trainer"]
            records = [record for _, record in load_capture(capture).records(step=0)]
        trained = dict(trainer.model.named_parameters())
        if set(trained) != set(params_before):
            raise RuntimeError(f"ms-swift's model has other parameters than the policy: {sorted(set(trained) ^ set(params_before))[:5]}")
        with torch.no_grad():
            for name, p in policy.named_parameters():
                p.copy_(trained[name].detach().to(p.device, p.dtype))
        logged: dict[str, Any] = next((entry for entry in trainer.state.log_history if "m2po/masked_fraction" in entry), {})
        return step_record(
            records,
            rollout,
            logged=logged,
            grads=grads,
            policy=policy,
            params_before=params_before,
            split=(rows // k,) * k,
            tau=self.config.tau,
        )


def swift_trainer(control: str | None = None) -> Any:
    """The factory ``compare --impl trainer:swift[:CONTROL]`` runs: ``(policy, config, *, behaviour, reference) -> SwiftStep``.

    It declares the one dtype the step computes in (``computes_in``, ``computes_in_why``),
    which the trainer runner takes when ``--dtype`` is not given, and the KL coefficient the
    control's steps run with (``kl_coefficient``)."""
    if control is not None and control not in SWIFT_CONTROLS:
        raise ValueError(f"control: unknown ms-swift control {control!r}; known: {', '.join(SWIFT_CONTROLS)}")

    def make(policy: Any, config: Any, **options: Any) -> SwiftStep:
        return SwiftStep(policy, config, fault=control, **options)

    make.computes_in, make.computes_in_why = SWIFT_COMPUTE_DTYPE, SWIFT_COMPUTE_DTYPE_WHY  # type: ignore[attr-defined]
    make.kl_coefficient = SWIFT_CONTROLS[control].beta if control else 0.0  # type: ignore[attr-defined]
    return make
