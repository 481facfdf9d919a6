"""M2PO in verl 0.9.1's actor update, one selection per optimizer mini-batch.

verl 0.9.1 updates the actor in ``TrainingWorker.train_mini_batch``: each mini-batch (one
optimizer step) goes to ``train_batch`` -> ``engine.train_batch`` -> ``forward_backward_batch``,
which splits it into micro-batches and hands each to ``ppo_loss``, which calls the policy loss
registered under ``policy_loss.loss_mode`` with that micro-batch's tensors only. A loss that
selected its mask there would select per micro-batch. So the selection happens one level up:

* :class:`M2POTrainingWorker` (a ``TrainingWorker``) runs, before a mini-batch's micro-batches,
  a no-grad prepass of the current policy over the whole mini-batch (verl's own
  ``engine.infer_batch``), selects once with ``core.select_micro_batches`` across the
  data-parallel group, and writes the mask into the mini-batch as a tensor field
  (:data:`KEEP_KEY`), so that verl's own micro-batching (fixed or dynamic) carries each row's
  mask with it;
* its loss function wraps verl's ``ppo_loss`` and hands the micro-batch's part of the mask to
  the policy loss registered as ``m2po`` (:func:`compute_policy_loss_m2po`), which builds
  ``-A * exp(logp - behaviour_logp)`` on the kept tokens and aggregates it with verl's own
  ``agg_loss`` token-mean: verl divides every micro-batch by the mini-batch's all-reduced token
  count times the data-parallel size, which is Algorithm 1's N.

The registered loss refuses to run without that selection (fail closed): registering
``m2po`` without the worker would otherwise silently select nothing.

Configuration, in verl's own config system (``PolicyLossConfig`` refuses unknown keys, so the
user installs the subclass :class:`M2POPolicyLossConfig` by its ``_target_``)::

    actor_rollout_ref.actor.policy_loss._target_=m2po_oracle.integrations.verl.M2POPolicyLossConfig
    actor_rollout_ref.actor.policy_loss.loss_mode=m2po
    +actor_rollout_ref.actor.policy_loss.tau=0.04

Behaviour log-probs are the rollout engine's (``rollout_log_probs``, which verl's rollout
returns with ``rollout.calculate_log_probs=True``), never verl's recomputed ``old_log_probs``
(the current policy before the update, a proximal policy); without them the update fails
closed. Settings under which the update would not compute Algorithm 1 are refused with a
``ValueError`` naming the verl option (:data:`VERL_REFUSALS`).
"""

from __future__ import annotations

import contextvars
import math
import warnings
from dataclasses import dataclass, field, fields, replace
from functools import partial
from typing import Any

import torch
from verl.trainer.ppo.core_algos import agg_loss, register_policy_loss
from verl.workers.config.actor import PolicyLossConfig
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

from m2po_oracle.capture.recorder import Recorder
from m2po_oracle.core.loss import select_micro_batches
from m2po_oracle.integrations.hf_window import LOGGED_METRICS, METRIC_PREFIX, summed_over_ranks
from m2po_oracle.trainer.grpo import M2POKLWarning, micro_batch_metrics, selection_metrics, stochastic_layers
from m2po_oracle.trainer.guard import Refusal, option, refuse

#: The name the loss is registered under in verl's policy-loss registry (``policy_loss.loss_mode``).
LOSS_MODE = "m2po"
#: The mini-batch's tensor field that carries the selection's mask through verl's micro-batching.
KEEP_KEY = "m2po_keep"
#: The KL estimators the project judges a KL term by (k3; verl calls it low_var_kl).
K3_NAMES = ("low_var_kl", "k3")


@dataclass
class M2POPolicyLossConfig(PolicyLossConfig):
    """verl's ``PolicyLossConfig`` with M2PO's budget: installed by ``policy_loss._target_``.

    ``tau``: the second-moment budget (finite, >= 0). ``capture``: a directory; every
    micro-batch is recorded with :class:`m2po_oracle.capture.Recorder` for ``m2po-oracle
    audit`` (``capture_every``: record every k-th optimizer step)."""

    loss_mode: str = LOSS_MODE
    tau: float = 0.04
    capture: str | None = None
    capture_every: int = 1

    def __post_init__(self) -> None:
        tau = self.tau
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) or tau < 0:
            raise ValueError(f"policy_loss.tau: expected a finite number >= 0, got {tau!r}")
        every = self.capture_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"policy_loss.capture_every: expected an integer >= 1, got {every!r}")


@dataclass(frozen=True)
class VerlFaults:
    """Planted bugs in this integration (negative controls); all off is the correct one."""

    per_micro_batch_mask: bool = False  # select within each micro-batch verl hands ppo_loss
    per_micro_batch_denominator: bool = False  # each micro-batch divides by its own valid count, then by the micro-batch count
    current_policy_as_behavior: bool = False  # verl's recomputed old_log_probs (the current policy) as behaviour log-probs
    optimizer_step_per_micro_batch: bool = False  # optimizer.step() between micro-batches
    kl_k1_estimator: bool = False  # the KL-in-loss term with kl_loss_type=k1 instead of low_var_kl (k3)
    kept_count_denominator: bool = False  # the mini-batch's kept count in place of verl's batch_num_tokens (N)
    per_rank_selection: bool = False  # each data-parallel rank selects over its own rows, without the group
    micro_batch_metrics: bool = False  # each micro-batch returns its own micro-batch's metrics (the selection right); verl averages them


#: verl's options under which the update would not compute Algorithm 1's objective, in the order they are checked.
VERL_REFUSALS: tuple[Refusal, ...] = (
    Refusal(
        "loss_agg_mode",
        lambda a: option(a, "loss_agg_mode", "token-mean") != "token-mean",
        lambda a: (
            f"actor.loss_agg_mode: M2PO divides the masked sum by N, the optimizer mini-batch's valid tokens before masking "
            f"(verl's 'token-mean'); loss_agg_mode={option(a, 'loss_agg_mode')!r} asks for another normaliser (set it to token-mean)"
        ),
    ),
    Refusal(
        "entropy_coeff",
        lambda a: (option(a, "entropy_coeff", 0) or 0) != 0,
        lambda a: (
            f"actor.entropy_coeff: an entropy bonus (got {option(a, 'entropy_coeff')}) is added to the loss; Algorithm 1 has "
            "none (set it to 0)"
        ),
    ),
    Refusal(
        "kl_loss_type",
        lambda a: bool(option(a, "use_kl_loss", False)) and option(a, "kl_loss_type", "low_var_kl") not in K3_NAMES,
        lambda a: (
            f"actor.kl_loss_type: with use_kl_loss the KL term must be the k3 estimator (low_var_kl), whose gradient the "
            f"checks judge; got {option(a, 'kl_loss_type')!r} (k1's gradient is a constant 1/N per token)"
        ),
    ),
    Refusal(
        "use_prefix_grouper",
        lambda a: bool(option(a, "use_prefix_grouper", False)),
        lambda a: (
            "actor.use_prefix_grouper: shared prefixes change how responses are batched; this integration selects over whole "
            "rows of one mini-batch (set it to False)"
        ),
    ),
)


def check_m2po_config(
    actor: Any, *, ulysses_sequence_parallel_size: int = 1, strategy: str = "fsdp", faults: VerlFaults = VerlFaults()
) -> float:
    """Refuse, naming the verl option, every setting under which the update would not compute
    Algorithm 1's objective; warn for a KL term. Returns tau."""
    policy_loss = option(actor, "policy_loss")
    if option(policy_loss, "loss_mode", None) != LOSS_MODE:
        raise ValueError(f"policy_loss.loss_mode: M2POTrainingWorker runs the '{LOSS_MODE}' loss; got {option(policy_loss, 'loss_mode')!r}")
    if not isinstance(policy_loss, M2POPolicyLossConfig):
        raise ValueError(
            "policy_loss._target_: loss_mode 'm2po' needs its budget tau, which verl's PolicyLossConfig has no key for; set "
            "policy_loss._target_=m2po_oracle.integrations.verl.M2POPolicyLossConfig and +policy_loss.tau "
            f"(got {type(policy_loss).__name__})"
        )
    refusals = VERL_REFUSALS if not faults.kl_k1_estimator else tuple(r for r in VERL_REFUSALS if r.option != "kl_loss_type")
    refuse(actor, refusals)
    if strategy not in ("fsdp", "fsdp2"):
        raise ValueError(f"actor.strategy: this integration hooks verl's FSDP engine (fsdp, fsdp2); got {strategy!r}")
    if ulysses_sequence_parallel_size != 1:
        raise ValueError(
            f"ulysses_sequence_parallel_size: the micro-batches are sequence shards here (got {ulysses_sequence_parallel_size}); "
            "this integration selects over whole rows of each data-parallel rank (set it to 1)"
        )
    if option(actor, "use_kl_loss", False):
        coef = float(option(actor, "kl_loss_coef", 0.0) or 0.0)
        warnings.warn(
            f"kl_loss_coef={coef}: use_kl_loss adds kl_loss_coef * KL to the M2PO objective (the reference experiments have no "
            "KL term; set use_kl_loss=False)",
            M2POKLWarning,
            stacklevel=3,
        )
    return float(policy_loss.tau)


# --- the mini-batch's selection, handed to each micro-batch's loss --------------------------------


@dataclass
class MiniBatch:
    """The current optimizer mini-batch: its selection and what the loss of each micro-batch records."""

    index: int  # optimizer steps of this worker so far (the capture's step)
    tau: float
    selection: Any  # the whole mini-batch's Selection (counts and metrics are global)
    micro_batches: int  # how many micro-batches verl splits it into
    faults: VerlFaults
    recorder: Any = None
    calls: int = 0  # micro-batches whose loss ran so far
    pending: dict[str, Any] = field(default_factory=dict)  # the policy loss's inputs, for the record
    pending_metrics: dict[str, Any] | None = None  # what the policy loss returned, where it is not the selection's


_MINI_BATCH: contextvars.ContextVar[MiniBatch | None] = contextvars.ContextVar("m2po_verl_mini_batch", default=None)
_KEEP: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("m2po_verl_keep", default=None)


@register_policy_loss(LOSS_MODE)
def compute_policy_loss_m2po(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's policy loss ``m2po``: Algorithm 1's loss of one micro-batch on the mask the
    worker selected over the whole mini-batch, aggregated by verl's token-mean (its N)."""
    mini_batch, keep = _MINI_BATCH.get(), _KEEP.get()
    if mini_batch is None or keep is None:
        raise ValueError(
            "policy_loss.loss_mode: the 'm2po' loss selects its mask once per optimizer mini-batch, before the micro-batches run, "
            "and was called without that selection; the actor's training worker must be "
            "m2po_oracle.integrations.verl.M2POTrainingWorker (M2POActorRolloutRefWorker builds it)"
        )
    if loss_agg_mode != "token-mean":
        raise ValueError(f"actor.loss_agg_mode: M2PO needs verl's token-mean (Algorithm 1's N); got {loss_agg_mode!r}")
    if rollout_is_weights is not None:
        raise ValueError(
            "algorithm.rollout_correction.rollout_is: rollout importance-sampling weights on top of M2PO correct the same ratio "
            "twice; M2PO's ratio is already taken against the rollout's log-probs (set rollout_is to null)"
        )
    if tuple(keep.shape) != tuple(log_prob.shape):
        raise RuntimeError(
            f"m2po: the micro-batch's mask has shape {tuple(keep.shape)}, its log-probs {tuple(log_prob.shape)}; verl 0.9.1's "
            "micro-batching no longer carries the mini-batch's fields row by row"
        )
    keep = keep.to(log_prob.device)
    mask = response_mask.bool()
    info = dict(config.global_batch_info)
    n = int(mini_batch.selection.valid_count)
    # A rank selecting alone counts its own rows (the fault keeps verl's global N in the loss).
    alone = mini_batch.faults.per_rank_selection
    if info.get("batch_num_tokens") is not None and int(info["batch_num_tokens"]) != n and not alone:
        raise RuntimeError(
            f"m2po: verl's batch_num_tokens ({info['batch_num_tokens']}) is not the selection's valid-token count ({n}); the "
            "loss mask verl counts is not the response mask M2PO selected over"
        )
    if mini_batch.faults.per_micro_batch_denominator:
        info["batch_num_tokens"] = int(mask.sum()) * mini_batch.micro_batches
    if mini_batch.faults.kept_count_denominator:  # every valid token but the masked trust-region ones
        selection = mini_batch.selection
        info["batch_num_tokens"] = n - int(selection.trust_region_count - selection.kept_trust_region_count)
    # verl scales each rank's token-mean by dp_size because FSDP averages the ranks' gradients; the
    # factor goes between the model and the recorded log-probs instead (identity forward, times
    # dp_size backward), so that a capture holds d loss / d logp of the whole objective.
    dp_size = int(info.get("dp_size") or 1)
    logp = summed_over_ranks(log_prob, dp_size)
    info["dp_size"] = 1
    # Padding-safe: off the mask the log-ratio is 0 and A is 0 before exp and the product.
    log_ratio = torch.where(keep, logp - old_log_prob.detach(), torch.zeros_like(logp))
    terms = torch.where(keep, -advantages.detach().to(logp.dtype) * torch.exp(log_ratio), torch.zeros_like(logp))
    share = agg_loss(loss_mat=terms, loss_mask=mask, loss_agg_mode=loss_agg_mode, **info)
    loss = share + (dp_size - 1) * share.detach()  # verl's value (dp_size x the share); the gradient went through logp
    mini_batch.pending = dict(logp=logp, behavior_logp=old_log_prob.detach(), advantages=advantages.detach(), mask=mask, keep=keep)
    metrics: dict[str, Any] = {}
    if mini_batch.faults.micro_batch_metrics:
        # A port's natural metrics: its own micro-batch's, on the right mask. verl averages what
        # each micro-batch returns with equal weight (ppo_loss: Metric(aggregation=MEAN)).
        own = micro_batch_metrics(log_prob.detach(), old_log_prob.detach(), advantages.detach(), mask, keep)
        metrics = {METRIC_PREFIX + name: value for name, value in own.items()}
        mini_batch.pending_metrics = metrics
    elif not mini_batch.faults.per_micro_batch_mask:  # a per-micro-batch selection has no one set of metrics
        # Every micro-batch reports the mini-batch's own numbers: verl's mean over micro-batches is exact.
        for name, value in selection_metrics(mini_batch.selection).items():
            if name in LOGGED_METRICS:
                metrics[METRIC_PREFIX + name] = float(value)
    return loss, metrics


def m2po_ppo_loss(inner: Any, config: Any, model_output: Any, data: Any, dp_group: Any = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's ``ppo_loss`` (``inner``) for one micro-batch, with that micro-batch's part of the
    mini-batch's mask handed to the registered ``m2po`` loss; records it when capturing."""
    mini_batch = _MINI_BATCH.get()
    if mini_batch is None or KEEP_KEY not in data:
        raise ValueError(
            "policy_loss.loss_mode: the 'm2po' loss ran on a micro-batch without the mini-batch's selection; the actor's training "
            "worker must be m2po_oracle.integrations.verl.M2POTrainingWorker"
        )
    token = _KEEP.set(data[KEEP_KEY].bool())
    try:
        loss, metrics = inner(config=config, model_output=model_output, data=data, dp_group=dp_group)
    finally:
        _KEEP.reset(token)
    micro = mini_batch.calls
    mini_batch.calls += 1
    recorder = mini_batch.recorder
    if recorder is not None and mini_batch.pending:
        pending = mini_batch.pending
        selection_view = replace(mini_batch.selection, keep=pending["keep"])
        recorder.record(
            step=mini_batch.index,
            micro_batch=micro,
            logp=pending["logp"],
            behavior_logp=pending["behavior_logp"],
            advantages=pending["advantages"],
            mask=pending["mask"],
            keep=pending["keep"],
            # The rank's share of the objective (verl's loss carries the dp_size factor FSDP's average undoes).
            loss=float(loss.detach()) / int(config.global_batch_info.get("dp_size") or 1),
            tau=mini_batch.tau,
            # What the micro-batch's loss returned where it is its own (the planted port's), else the selection's.
            metrics=selection_metrics(selection_view) if mini_batch.pending_metrics is None else mini_batch.pending_metrics,
            selection_logp=data.get("m2po_prepass", None),
            # The sampler's own log-probs beside the behaviour log-probs the loss used: the audit compares them.
            rollout_logp=torch.where(pending["mask"], data["rollout_log_probs"].to(pending["logp"].dtype), torch.nan),
        )
        recorder.watch_gradient(pending["logp"])
    mini_batch.pending, mini_batch.pending_metrics = {}, None
    return loss, metrics


# --- the worker -----------------------------------------------------------------------------------


def _padded(values: Any, data: Any) -> torch.Tensor:
    """A model output (nested, no padding) as the response's [rows, width] tensor."""
    from verl.workers.utils.padding import no_padding_2_padding

    return no_padding_2_padding(values, data)


def _row_chunks(rows: int, micro_batch_size: int) -> list[slice]:
    return [slice(start, min(start + micro_batch_size, rows)) for start in range(0, rows, micro_batch_size)]


class M2POTrainingWorker(TrainingWorker):
    """verl's ``TrainingWorker`` whose mini-batches select M2PO's mask once, before their micro-batches."""

    m2po_faults: VerlFaults = VerlFaults()

    def set_loss_fn(self, loss_fn: Any) -> None:
        config = getattr(loss_fn, "keywords", {}).get("config") if isinstance(loss_fn, partial) else None
        if config is None:
            raise ValueError("loss_fn: M2POTrainingWorker expects verl's partial(ppo_loss, config=ActorConfig)")
        self.m2po_actor_config = config
        self.m2po_tau = check_m2po_config(
            config,
            ulysses_sequence_parallel_size=int(option(self.engine_config, "ulysses_sequence_parallel_size", 1) or 1),
            strategy=str(option(self.engine_config, "strategy", "fsdp")),
            faults=self.m2po_faults,
        )
        self.m2po_steps = 0
        self.m2po_recorder: Any = None
        inner = partial(loss_fn.func, *loss_fn.args)  # ppo_loss, without its config keyword (passed per call)
        super().set_loss_fn(partial(m2po_ppo_loss, inner, config))

    def _m2po_recording(self) -> Any:
        policy_loss = self.m2po_actor_config.policy_loss
        if policy_loss.capture is None:
            return None
        if self.m2po_recorder is None:
            rank, world = self.engine.get_data_parallel_rank(), self.engine.get_data_parallel_size()
            self.m2po_recorder = Recorder(
                policy_loss.capture, rank=rank, world_size=world, topology=f"dp={world},cp=1,tp=1", every=policy_loss.capture_every
            )
        return self.m2po_recorder

    def _m2po_group(self) -> Any:
        return self.engine.get_data_parallel_group() if self.engine.get_data_parallel_size() > 1 else None

    def _m2po_select(self, data: Any) -> MiniBatch:
        """The prepass over the whole mini-batch and its one selection, written into ``data``."""
        from verl.utils import tensordict_utils as tu

        stochastic = stochastic_layers(self.engine.module)
        if stochastic:
            raise ValueError(
                "model: the mask prepass must be deterministic, but the policy has stochastic layers: "
                f"{', '.join(stochastic)}; set actor_rollout_ref.model.override_config's dropout to 0"
            )
        faults = self.m2po_faults
        if "rollout_log_probs" not in data:
            raise ValueError(
                "rollout_log_probs: the mini-batch carries no log-probs from the rollout engine; M2PO's behaviour log-probs are "
                "the sampler's, not verl's recomputed old_log_probs (set actor_rollout_ref.rollout.calculate_log_probs=True)"
            )
        with torch.no_grad():
            # verl's own forward over the whole mini-batch, in its own micro-batches; no loss.
            prepass_input = data.clone()
            tu.assign_non_tensor(prepass_input, calculate_entropy=False, compute_loss=False)
            prepass = _padded(self.engine.infer_batch(prepass_input)["model_output"]["log_probs"], data).detach()
        mask = data["response_mask"].bool()
        sampled = data["rollout_log_probs"]
        if bool(torch.isnan(torch.where(mask, sampled, 0.0)).any()):
            raise ValueError(
                "rollout_log_probs: the rollout engine returned NaN log-probs for some sampled tokens; M2PO fails closed rather "
                "than fall back to log-probs recomputed by the trainer"
            )
        behaviour = data["old_log_probs"] if faults.current_policy_as_behavior else sampled
        behaviour = torch.where(mask, behaviour, torch.zeros_like(behaviour)).to(prepass.dtype)
        advantages = data["advantages"].to(prepass.dtype)
        tau = self.m2po_tau
        group = None if faults.per_rank_selection else self._m2po_group()
        whole = select_micro_batches([(prepass, behaviour, advantages, mask)], tau=tau, group=group)[0]
        rows = int(mask.shape[0])
        size = int(tu.get_non_tensor_data(data=data, key="micro_batch_size_per_gpu", default=rows) or rows)
        chunks = _row_chunks(rows, size)
        keep = whole.keep
        if faults.per_micro_batch_mask:
            if tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=False):
                raise ValueError("use_dynamic_bsz: the per-micro-batch control plants its bug on fixed-size micro-batches")
            keep = torch.cat([select_micro_batches([(prepass[r], behaviour[r], advantages[r], mask[r])], tau=tau)[0].keep for r in chunks])
        # The loss pass's behaviour log-probs: ppo_loss reads old_log_probs.
        data["old_log_probs"] = behaviour
        data[KEEP_KEY] = keep
        data["m2po_prepass"] = prepass
        return MiniBatch(self.m2po_steps, tau, replace(whole, keep=keep), len(chunks), faults, recorder=self._m2po_recording())

    def train_batch(self, data: Any) -> Any:
        from verl.utils import tensordict_utils as tu

        # What TrainingWorker.train_batch injects, here already: the prepass runs verl's micro-batching too.
        defaults = dict(
            use_remove_padding=self.model_config.get("use_remove_padding", False),
            use_dynamic_bsz=self.engine_config.use_dynamic_bsz,
            max_token_len_per_gpu=self.engine_config.max_token_len_per_gpu,
            micro_batch_size_per_gpu=self.engine_config.micro_batch_size_per_gpu,
            use_fused_kernels=self.engine_config.use_fused_kernels,
        )
        for key, value in defaults.items():
            if key not in data:
                tu.assign_non_tensor(data, **{key: value})
        mini_batch = self._m2po_select(data)
        token = _MINI_BATCH.set(mini_batch)
        engine = self.engine
        saved = {name: engine.__dict__.get(name) for name in ("optimizer_step", "forward_step")}
        try:
            if mini_batch.recorder is not None:
                _note_gradients_before(engine, mini_batch)
            if mini_batch.faults.optimizer_step_per_micro_batch:
                _step_between_micro_batches(engine)
            return super().train_batch(data)
        finally:
            for name, before in saved.items():  # the engine's own methods again (or the caller's overrides)
                if before is None:
                    engine.__dict__.pop(name, None)
                else:
                    engine.__dict__[name] = before
            _MINI_BATCH.reset(token)
            self.m2po_steps += 1


def _note_gradients_before(engine: Any, mini_batch: MiniBatch) -> None:
    """The engine's optimizer step, which first notes the parameters' gradient norms in the capture."""
    step = engine.optimizer_step

    def optimizer_step() -> Any:
        mini_batch.recorder.record_parameter_gradients(step=mini_batch.index, named_parameters=engine.module.named_parameters())
        return step()

    engine.optimizer_step = optimizer_step


def _step_between_micro_batches(engine: Any) -> None:
    """The planted bug: an optimizer step before every micro-batch's forward but the first (verl still steps at the end)."""
    forward = engine.forward_step
    seen = [0]

    def forward_step(micro_batch: Any, loss_function: Any, forward_only: Any) -> Any:
        if not forward_only and seen[0]:
            engine.optimizer.step()
        seen[0] += not forward_only
        return forward(micro_batch, loss_function=loss_function, forward_only=forward_only)

    engine.forward_step = forward_step


class M2POActorRolloutRefWorker(ActorRolloutRefWorker):
    """verl's ``ActorRolloutRefWorker`` whose actor trains with :class:`M2POTrainingWorker`."""

    actor_worker_cls = M2POTrainingWorker


def faults_named(name: str | None) -> VerlFaults:
    """One planted fault by its name (a negative control); an unknown name is an error, never ignored."""
    if not name:
        return VerlFaults()
    known = [f.name for f in fields(VerlFaults)]
    if name not in known:
        raise ValueError(f"fault: unknown verl fault {name!r}; known: {', '.join(known)}")
    return VerlFaults(**{name: True})
