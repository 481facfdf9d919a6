"""verl 0.9.1's real actor update behind the trainer contract: ``compare --impl trainer:verl``.

:class:`VerlStep` satisfies ``step(rollout, split) -> StepRecord`` by running one optimizer
mini-batch of :class:`~m2po_oracle.integrations.verl.M2POTrainingWorker` through verl's own
update path: ``TrainingWorker.train_mini_batch`` (its mini-batch iterator and metrics) ->
the worker's prepass and selection -> ``FSDPEngineWithLMHead.train_batch`` ->
``forward_backward_batch`` (verl's micro-batching, its all-reduced token count) -> ``ppo_loss``
(its KL-in-loss term) -> the registry's ``m2po`` loss -> ``agg_loss`` -> ``optimizer_step``
(verl's gradient clipping, here at an infinite norm, then the optimizer). The advantages are
verl's GRPO estimator's (``compute_grpo_outcome_advantage``) on the case's rewards.

What the harness decides instead of verl, and why:

* the platform: verl 0.9.1 ships no CPU platform; :func:`use_cpu_platform` registers one with
  verl's platform plugin registry (``PlatformRegistry``, ``set_platform``) and a gloo world of
  one process. Pinned to verl 0.9.1's ``PlatformBase``;
* the engine: ``FSDPEngineWithLMHead.__init__`` runs as verl's, but instead of
  ``initialize()`` (which loads an HF folder and wraps it in FSDP) the case's policy, an AdamW
  optimizer with the HF Trainer's defaults and a constant schedule are set on it: the update
  runs on the policy itself, in place, in float32 without autocast;
* the worker: ``TrainingWorker`` is built without ray (``__new__``, then the attributes its
  ``train_mini_batch`` reads), the mini-batch is the whole rollout (one optimizer step) and
  its iterator does not shuffle, so that micro-batch ``i`` holds rows ``i*b .. (i+1)*b``;
* the rollout: the case's completions enter as verl's batch (``left_right_2_no_padding``) with
  the sampler's log-probs as ``rollout_log_probs`` and the current policy's as
  ``old_log_probs`` (what verl's recompute gives); an uneven case split runs as equal
  micro-batches (``hf_step.equal_split``), and the record says what ran;
* the KL reference's log-probs (``ref_log_prob``) are the reference model's, computed by the
  harness (verl's reference worker runs the same forward).

The controls ``trainer:verl:NAME`` plant :class:`~m2po_oracle.integrations.verl.VerlFaults`.
This module imports verl only when a step runs, so that the registry of controls reads without it.
"""

from __future__ import annotations

import os
import tempfile
import types
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from m2po_oracle.capture import load_capture
from m2po_oracle.integrations.hf_step import adamw, equal_split, step_record
from m2po_oracle.trainer.controls import TrainerControl, integrated_controls
from m2po_oracle.trainer.grpo import behaviour_logp_of, token_logp

#: Where verl's words differ from the other integrations' (its old_log_probs, its own optimizer step).
_IN_VERLS_WORDS = {
    "current_policy_as_behavior": "verl's recomputed old_log_probs (the current policy) are used as behaviour log-probs, "
    "not the rollout's rollout_log_probs",
    "optimizer_step_per_micro_batch": "the optimizer steps between micro-batches of a mini-batch, before verl's own step at its end",
}
#: The planted bugs ``trainer:verl:NAME`` runs, with what must catch them and name them.
VERL_CONTROLS: dict[str, TrainerControl] = {
    c.name: replace(c, description=_IN_VERLS_WORDS.get(c.name, c.description))
    for c in (
        *integrated_controls("verl", "ppo_loss"),
        # A port that reads agg_loss's token-mean as "mean over the tokens that count" hands it the kept tokens.
        TrainerControl(
            "kept_count_denominator",
            "agg_loss's batch_num_tokens is the mini-batch's kept count instead of verl's valid-token count N",
            {"kept_count_denominator": True},
            ("loss", "gradient"),
        ),
        # A port's natural metrics: each micro-batch returns its own (on the right mask), which
        # verl averages with equal weight per micro-batch. The selection, loss and gradient are
        # right: the logged numbers are not Algorithm 1's, a finding named for the averaging.
        TrainerControl(
            "micro_batch_metrics",
            "each micro-batch's policy loss returns its own micro-batch's M2PO metrics on the mini-batch's mask, which verl "
            "averages with equal weight per micro-batch",
            {"micro_batch_metrics": True},
            ("metrics.masked_fraction",),
            diagnosed_as="unweighted_micro_batch_metric_mean",
        ),
    )
}
#: The verl release the CPU glue below is written against.
VERL_VERSION = "0.9.1"
VERL_COMPUTE_DTYPE = "float32"
VERL_COMPUTE_DTYPE_WHY = "verl's FSDP engine computes the log-probs from float32 logits, and the step runs the case's policy in float32"
#: verl's clip bound for the step: the clip factor min(1, bound / norm) is exactly 1.
_INFINITE_NORM = float("inf")


# --- the CPU platform (verl 0.9.1 ships none) -----------------------------------------------------


def _cpu_device_module() -> Any:
    """``torch.cpu`` with the memory counters verl's worker reads (a CPU has none: 0)."""
    module = types.SimpleNamespace(**{k: getattr(torch.cpu, k) for k in dir(torch.cpu) if not k.startswith("__")})
    for name in ("max_memory_allocated", "max_memory_reserved", "memory_allocated", "memory_reserved"):
        setattr(module, name, lambda *args, **kwargs: 0)
    module.empty_cache = lambda *args, **kwargs: None
    module.is_available = lambda: True
    return module


def use_cpu_platform() -> None:
    """Register verl's platform ``cpu`` and make it the current one; start a gloo world of one
    process unless one is running. Idempotent."""
    from importlib.metadata import version

    found = version("verl")
    if found != VERL_VERSION:
        raise RuntimeError(f"verl: the CPU glue of trainer:verl is written against verl {VERL_VERSION}; found {found}")
    from verl.plugin.platform import platform_manager
    from verl.plugin.platform.platform_base import PlatformBase

    if getattr(platform_manager, "_current_platform", None) is not None and platform_manager._current_platform.device_name == "cpu":
        _start_world()
        return
    device_module = _cpu_device_module()

    class CPUPlatform(PlatformBase):
        """verl on the CPU: device "cpu" (a string: verl moves tensors with ``.to(current_device())``), gloo."""

        device_name = property(lambda self: "cpu")
        vendor_name = property(lambda self: "cpu")
        device_module = property(lambda self: device_module)

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            return True

        def current_device(self) -> Any:
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            pass

        def synchronize(self, device_index: int | None = None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        def ray_resource_name(self) -> str:
            return "CPU"

    # Members 0.9.1 declares abstract that a CPU run never reaches (profilers, IPC, cudart).
    for name in list(getattr(CPUPlatform, "__abstractmethods__", ())):
        setattr(CPUPlatform, name, lambda self, *args, **kwargs: None)
    CPUPlatform.__abstractmethods__ = frozenset()
    platform_manager.PlatformRegistry.register("cpu")(CPUPlatform)
    platform_manager.set_platform(CPUPlatform())
    _start_world()


def _start_world() -> None:
    """A gloo world: torchrun's (its environment names a world size) or one of this process alone."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")  # torchrun's rendezvous (env://)
        return
    store = Path(tempfile.mkdtemp(prefix="m2po-verl-world-")) / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)


def _one_process() -> None:
    import torch.distributed as dist

    if dist.get_world_size() != 1:
        raise RuntimeError(f"trainer:verl runs one process; this one is in a world of {dist.get_world_size()}")


def _average_gradients_after_backward(engine: Any) -> None:
    """What FSDP's reduce-scatter does to the plain module the harness sets: once a mini-batch's
    micro-batches have run backward, each parameter's gradient averaged over the data-parallel
    group (verl's token-mean scales every rank's share by the group's size, so the average is the
    whole mini-batch's gradient), before anything reads it for the step."""
    import torch.distributed as dist

    forward_backward = engine.forward_backward_batch
    group = engine.get_data_parallel_group()

    def forward_backward_batch(data: Any, loss_function: Any, forward_only: bool = False) -> Any:
        output = forward_backward(data, loss_function, forward_only=forward_only)
        if not forward_only:
            for p in engine.module.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=group)
        return output

    engine.forward_backward_batch = forward_backward_batch


# --- the step -------------------------------------------------------------------------------------


def build_engine(policy: Any, lr: float, micro_batch_size: int) -> Any:
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    engine_config = FSDPEngineConfig(
        strategy="fsdp",
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=micro_batch_size,
        max_token_len_per_gpu=1 << 16,
        use_remove_padding=True,
        use_torch_compile=False,
    )
    # verl clips by the global norm before its step; an infinite bound makes the clip factor exactly 1.
    optimizer_config = FSDPOptimizerConfig(lr=lr, clip_grad=_INFINITE_NORM)
    model_config = types.SimpleNamespace(use_remove_padding=True, lora_rank=0, get=lambda key, default=None: default)
    engine = FSDPEngineWithLMHead(
        model_config=model_config, engine_config=engine_config, optimizer_config=optimizer_config, checkpoint_config=CheckpointConfig()
    )
    engine.module = policy
    engine.optimizer = adamw(policy.parameters(), lr)
    engine.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda _: 1.0)
    engine._autocast_dtype = torch.float32  # what mixed_precision float32 sets: no autocast
    return engine, engine_config, model_config


def build_worker(engine: Any, engine_config: Any, model_config: Any, actor_config: Any, fault: str | None) -> Any:
    from verl.utils.profiler import DistProfiler
    from verl.workers.utils.losses import ppo_loss

    from m2po_oracle.integrations.verl import M2POTrainingWorker, faults_named

    worker = M2POTrainingWorker.__new__(M2POTrainingWorker)  # TrainingWorker.__init__ starts ray's Worker
    worker.engine, worker.engine_config, worker.model_config = engine, engine_config, model_config
    worker.flops_counter, worker.device_name = None, "cpu"
    worker.profiler = DistProfiler(rank=0)  # disabled, as __init__ builds it without a profiler config
    worker.m2po_faults = faults_named(fault)
    worker.set_loss_fn(partial(ppo_loss, config=actor_config))
    return worker


def _batch(rollout: Any, behaviour: torch.Tensor | None, current: torch.Tensor, reference: torch.Tensor | None, tis: bool) -> Any:
    """The rollout as verl's actor-update batch (a no-padding TensorDict) with verl's GRPO advantages."""
    from tensordict import TensorDict
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
    from verl.workers.utils.padding import left_right_2_no_padding

    prompts, responses = rollout.prompt_ids.cpu(), rollout.completion_ids.cpu()
    rows, width = responses.shape
    response_mask = rollout.valid.cpu().long()
    attention_mask = torch.cat([torch.ones_like(prompts), response_mask], dim=1)
    input_ids = torch.cat([prompts, responses], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    # verl's reward manager puts a sequence's score on its last valid token.
    last = (response_mask.sum(-1) - 1).clamp(min=0)
    scores = torch.zeros(rows, width, dtype=torch.float32)
    scores[torch.arange(rows), last] = rollout.rewards.cpu().float()
    groups = torch.arange(rows) // rollout.group_size
    advantages, _ = compute_grpo_outcome_advantage(scores, response_mask.float(), index=groups.numpy())
    zero = lambda t: torch.where(rollout.valid.cpu(), t.cpu().float(), 0.0)  # noqa: E731  # verl pads with 0
    fields = dict(
        prompts=prompts,
        responses=responses,
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        response_mask=response_mask,
        old_log_probs=zero(current),
        advantages=advantages.float(),
    )
    if behaviour is not None:
        fields["rollout_log_probs"] = zero(behaviour)
        if tis:  # truncated token-level IS weights, as verl's rollout correction hands the loss
            fields["rollout_is_weights"] = torch.exp(zero(current) - zero(behaviour)).clamp(max=2.0)
    if reference is not None:
        fields["ref_log_prob"] = zero(reference)
    return left_right_2_no_padding(TensorDict(fields, batch_size=[rows]))


class VerlStep:
    """One optimizer mini-batch of verl's actor update with M2PO per :meth:`step` (the trainer contract)."""

    def __init__(self, policy: Any, config: Any, *, behaviour: Any = None, reference: Any = None, fault: str | None = None) -> None:
        self.policy, self.config, self.behaviour, self.reference = policy, config, behaviour, reference
        self.fault = fault

    def make_optimizer(self, parameters: Any) -> torch.optim.Optimizer:

        return adamw(parameters, self.config.lr)

    def _refuse_unmapped(self) -> None:
        """The seed's settings verl has no M2PO counterpart for (refused here rather than ignored)."""
        config = self.config
        if config.rollout_backend == "deployment" and config.behavior_logp_source != "rollout":
            raise ValueError(
                "behavior_logp_source: with an engine outside the trainer the integration always uses the engine's log-probs "
                "(rollout_log_probs); recomputing them with the trainer's weights is verl's old_log_probs, which M2PO refuses "
                "as behaviour log-probs"
            )
        if config.importance_sampling_level != "token":
            raise ValueError(
                f"importance_sampling_level: M2PO is defined on token-level ratios; got {config.importance_sampling_level!r} "
                "(in verl sequence-level ratios are another loss, policy_loss.loss_mode=gspo)"
            )

    def step(self, rollout: Any, split: Any = None) -> Any:

        self._refuse_unmapped()
        use_cpu_platform()
        _one_process()
        rows = rollout.rows
        k = equal_split(rows, len(tuple(split)) if split is not None else 1)
        policy, config = self.policy, self.config
        with torch.no_grad():
            reference = behaviour_logp_of(self.reference, rollout) if config.beta else None
        params_before = {n: p.detach().cpu().clone() for n, p in policy.named_parameters()}
        grads: dict[str, torch.Tensor] = {}
        with tempfile.TemporaryDirectory(prefix="m2po-verl-step-") as tmp:
            capture = Path(tmp) / "capture"
            logged = run_update(
                policy,
                rollout,
                tau=config.tau,
                lr=config.lr,
                micro_batch_size=rows // k,
                beta=config.beta,
                reference_logp=reference,
                fault=self.fault,
                capture=capture,
                grads=grads,
                rollout_is=config.rollout_importance_sampling_mode is not None,
            )
            records = [record for _, record in load_capture(capture).records(step=0)]
        return step_record(
            records, rollout, logged=logged, grads=grads, policy=policy, params_before=params_before, split=(rows // k,) * k, tau=config.tau
        )


def run_update(
    policy: Any,
    rollout: Any,
    *,
    tau: float,
    lr: float,
    micro_batch_size: int,
    mini_batch_size: int | None = None,
    epochs: int = 1,
    beta: float = 0.0,
    reference_logp: torch.Tensor | None = None,
    fault: str | None = None,
    capture: Any = None,
    grads: dict[str, torch.Tensor] | None = None,
    rollout_is: bool = False,
) -> dict[str, float]:
    """verl's actor update of ``policy`` (in place) on ``rollout`` (this rank's rows, under
    torchrun) with M2PO: ``train_mini_batch`` over mini-batches of ``mini_batch_size`` rows of
    the whole data-parallel group (default: all, one optimizer step) for
    ``epochs``, in micro-batches of ``micro_batch_size`` rows. ``capture``: a directory every
    micro-batch is recorded in; ``grads``: filled with the parameters' gradients right before
    the (last) optimizer step. Returns the logged M2PO metrics (averaged over the update's
    mini-batches, as verl logs them)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import ActorConfig

    from m2po_oracle.integrations.verl import M2POPolicyLossConfig, TrainingWorker

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    use_cpu_platform()
    rows = rollout.rows
    mini_batch_size = mini_batch_size or rows * torch.distributed.get_world_size()
    if next(policy.parameters()).dtype != torch.float32:
        raise ValueError(f"dtype: trainer:verl runs its policy in float32; got {next(policy.parameters()).dtype}")
    with torch.no_grad():  # verl's old_log_probs: the actor's recompute before the update
        current = token_logp(policy.eval(), rollout.prompt_ids, rollout.completion_ids)
    actor_config = ActorConfig(
        strategy="fsdp",
        rollout_n=rollout.group_size,
        ppo_mini_batch_size=max(mini_batch_size // rollout.group_size, 1),
        ppo_micro_batch_size_per_gpu=micro_batch_size,
        ppo_epochs=epochs,
        use_dynamic_bsz=False,
        loss_agg_mode="token-mean",
        policy_loss=M2POPolicyLossConfig(tau=float(tau), capture=None if capture is None else str(capture)),
        use_torch_compile=False,
        use_kl_loss=bool(beta),
        kl_loss_coef=float(beta),
        kl_loss_type="k1" if fault == "kl_k1_estimator" else "low_var_kl",
        entropy_coeff=0.0,
    )
    engine, engine_config, model_config = build_engine(policy, lr, micro_batch_size)
    if engine.get_data_parallel_size() > 1:
        _average_gradients_after_backward(engine)
    if grads is not None:
        optimizer_step = engine.optimizer_step

        def keep_gradients() -> Any:  # what the optimizer steps with, after every earlier hook
            for name, p in policy.named_parameters():
                if p.grad is not None:
                    grads[name] = p.grad.detach().cpu().clone()
            return optimizer_step()

        engine.optimizer_step = keep_gradients
    worker = build_worker(engine, engine_config, model_config, actor_config, fault)
    data = _batch(rollout, rollout.behavior_logp, current, reference_logp, rollout_is)
    tu.assign_non_tensor(
        data,
        temperature=1.0,
        calculate_entropy=False,
        global_batch_size=mini_batch_size,
        mini_batch_size=mini_batch_size,
        epochs=epochs,
        seed=0,
        dataloader_kwargs={"shuffle": False},
        compute_loss=True,
    )
    policy.train()
    try:
        train_mini_batch = getattr(TrainingWorker.train_mini_batch, "__wrapped__", TrainingWorker.train_mini_batch)
        output = train_mini_batch(worker, data)
    finally:
        policy.eval()
    return {name: _scalar(value) for name, value in tu.get(output, "metrics").items() if name.startswith("m2po/")}


def _scalar(value: Any) -> float:
    """A logged metric (verl logs a list per mini-batch: one value per micro-batch, averaged)."""
    if isinstance(value, (list, tuple)):
        values = [_scalar(v) for v in value]
        return sum(values) / len(values)
    return float(getattr(value, "value", value))


def verl_trainer(control: str | None = None) -> Any:
    """The factory ``compare --impl trainer:verl[:CONTROL]`` runs: ``(policy, config, *, behaviour, reference) -> VerlStep``,
    declaring the dtype it computes in and its control's KL coefficient (as ``swift_step.swift_trainer``)."""
    if control is not None and control not in VERL_CONTROLS:
        raise ValueError(f"control: unknown verl control {control!r}; known: {', '.join(VERL_CONTROLS)}")

    def make(policy: Any, config: Any, **options: Any) -> VerlStep:
        return VerlStep(policy, config, fault=control, **options)

    make.computes_in, make.computes_in_why = VERL_COMPUTE_DTYPE, VERL_COMPUTE_DTYPE_WHY  # type: ignore[attr-defined]
    make.kl_coefficient = VERL_CONTROLS[control].beta if control else 0.0  # type: ignore[attr-defined]
    return make
