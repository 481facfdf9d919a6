"""A real GRPO training step with the M2PO loss, on a Hugging Face causal LM.

The step the production implementation runs, at toy scale and with random weights:

1. stale behaviour copies of the policy (rollout workers some optimizer steps behind,
   :func:`make_policy_versions`) sample completions for a few prompts
   (:func:`sample_rollout`); the rollout engine records each sampled token's log-prob at
   sampling time, from the raw logits;
2. a deterministic rule scores each completion (:func:`reward`) and rewards are
   normalised within each prompt's group (:func:`group_advantages`, GRPO);
3. :class:`GRPOTrainer` checks that the setup keeps Algorithm 1's objective
   (:func:`check_training_setup`, fail closed), runs a no-grad mask prepass over every
   micro-batch of the optimizer batch, selects once (``core.select_micro_batches``),
   then accumulates the loss of each micro-batch with the optimizer batch's N and takes
   one optimizer step.

:class:`TrainerFaults` plants the trainer-level bugs the negative controls need; with
every knob off the trainer is the correct one.
"""

from __future__ import annotations

import copy
import itertools
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from m2po_oracle.core.loss import loss_from_selection, select_micro_batches
from m2po_oracle.oracle.record import COUNT_FIELDS, METRIC_FIELDS
from m2po_oracle.trainer.guard import TOKEN_LEVEL_RATIOS, refuse

#: Token ids of the toy vocabulary.
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
ROLLOUT_BACKENDS = ("hf", "deployment")
BEHAVIOR_SOURCES = ("rollout", "trainer")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
#: Config attributes that make a forward pass stochastic when non-zero (Llama, GPT-2,
#: Mixtral-style routers, stochastic depth).
STOCHASTIC_CONFIG_FIELDS = (
    "attention_dropout",
    "hidden_dropout",
    "dropout",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "router_jitter_noise",
    "drop_path_rate",
    "layerdrop",
)


class M2POKLWarning(UserWarning):
    """A non-zero KL coefficient adds a term Algorithm 1 does not have."""


@dataclass(frozen=True)
class TrainerConfig:
    """What the trainer is asked to do; :func:`check_training_setup` rejects what would
    silently change the M2PO objective."""

    tau: float = 0.04
    lr: float = 1e-2
    beta: float = 0.0  # KL coefficient; the reference experiments use 0
    rollout_backend: str = "hf"  # "hf": synchronous native generation; "deployment": a vLLM/SGLang-style server
    behavior_logp_source: str = "rollout"  # "rollout": recorded at sampling; "trainer": recomputed by the trainer
    importance_sampling_level: str = "token"
    rollout_importance_sampling_mode: str | None = None  # an extra rollout-IS correction (TIS); unsupported

    def __post_init__(self) -> None:
        # Malformed numbers are refused here; valid settings M2PO does not support are
        # refused by check_training_setup, so that they can be probed.
        for name in ("tau", "beta", "lr"):
            value = getattr(self, name)
            positive = name == "lr"
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value < 0
                or (positive and value == 0)
            ):
                raise ValueError(f"{name}: expected a finite number {'> 0' if positive else '>= 0'}, got {value!r}")


@dataclass(frozen=True)
class TrainerFaults:
    """Planted trainer bugs (negative controls); all off is the correct trainer."""

    per_micro_batch_mask: bool = False  # select within each micro-batch instead of the optimizer batch
    core_per_micro_batch: bool = (
        False  # the core called per micro-batch (its own selection and metrics, its own N logged), the window's N in the loss
    )
    current_policy_as_behavior: bool = False  # "behaviour" log-probs taken from the current policy
    per_micro_batch_denominator: bool = False  # each micro-batch divides by its own N, then 1/k
    skip_determinism_check: bool = False  # trains with whatever stochastic layers the model has
    optimizer_step_per_micro_batch: bool = False  # optimizer.step() after every micro-batch
    drop_gradient_of: str | None = None  # a parameter whose gradient is zeroed before the step (a mis-wired freeze)
    kl_k1_estimator: bool = False  # the KL term uses k1, logp - ref_logp, instead of TRL's k3


@dataclass(frozen=True)
class Rollout:
    """Sampled completions of ``prompts`` rows (``group_size`` consecutive rows per prompt)."""

    prompt_ids: torch.Tensor  # [B, P]
    completion_ids: torch.Tensor  # [B, T]
    valid: torch.Tensor  # [B, T] bool: tokens up to and including the first EOS
    behavior_logp: torch.Tensor | None  # [B, T], recorded at sampling; None if the engine returned none
    rewards: torch.Tensor  # [B]
    group_size: int
    backend: str = "hf"

    @property
    def rows(self) -> int:
        return int(self.completion_ids.shape[0])


@dataclass
class StepRecord:
    """Everything one optimizer step did, for the checks (all tensors detached, on CPU)."""

    logp: torch.Tensor  # the loss pass's per-token log-probs [B, T]
    behavior_logp: torch.Tensor
    advantages: torch.Tensor
    valid: torch.Tensor
    keep: torch.Tensor
    loss: float
    metrics: dict[str, float | int]
    token_grad: torch.Tensor  # d loss / d logp
    param_grads: dict[str, torch.Tensor]
    params_before: dict[str, torch.Tensor]
    params_after: dict[str, torch.Tensor]
    split: tuple[int, ...]
    tau: float
    kl_term: float = 0.0
    notes: list[str] = field(default_factory=list)


# --- the model -----------------------------------------------------------------------------


def tiny_llama(
    seed: int, *, dtype: torch.dtype = torch.float32, dropout: float = 0.0, vocab_size: int = 32, device: str | torch.device = "cpu"
) -> Any:
    """A random-weight two-layer Llama (nothing downloaded), deterministic in ``seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_dropout=dropout,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "eager"  # one kernel path in every dtype, dropout included
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(device=device, dtype=dtype).eval()  # type: ignore[call-arg]  # transformers' to() is a functools.wraps wrapper mypy does not bind; built on the CPU, so the weights do not depend on the device's RNG


def make_policy_versions(
    seed: int, *, steps: int, lr: float, dtype: torch.dtype = torch.float32, dropout: float = 0.0, device: str | torch.device = "cpu"
) -> list[Any]:
    """``steps + 1`` versions of one policy, oldest first: each is the previous moved by one
    AdamW step (on the likelihood of random sequences). The last is the current policy;
    ``versions[-1 - lag]`` is a rollout worker ``lag`` optimizer steps behind it."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps: expected an integer >= 0, got {steps!r}")
    model = tiny_llama(seed, dtype=dtype, dropout=dropout, device=device)
    versions = [copy.deepcopy(model)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed + 1)
    vocab = model.config.vocab_size
    for _ in range(steps):
        ids = torch.randint(3, vocab, (4, 8), generator=generator).to(device)
        with torch.random.fork_rng(devices=[]):
            model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        versions.append(copy.deepcopy(model))
    return [v.eval() for v in versions]


# --- the rollout -----------------------------------------------------------------------------


def reward(completion_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The deterministic rule: the fraction of valid completion tokens whose id is a multiple of 3."""
    hits = ((completion_ids % 3 == 0) & valid).sum(dim=1).to(torch.float64)
    return hits / valid.sum(dim=1).clamp(min=1).to(torch.float64)


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """GRPO: (r - group mean) / (group std + 1e-4), std over the group (population)."""
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"group_size: expected a positive divisor of the {rewards.numel()} rollouts, got {group_size}")
    grouped = rewards.reshape(-1, group_size)
    normalised = (grouped - grouped.mean(dim=1, keepdim=True)) / (grouped.std(dim=1, unbiased=False, keepdim=True) + 1e-4)
    return normalised.reshape(-1)


def valid_until_eos(completion_ids: torch.Tensor) -> torch.Tensor:
    """True for every token up to and including the first EOS of its row."""
    is_eos = completion_ids == EOS_ID
    after_eos = (torch.cumsum(is_eos.to(torch.int64), dim=1) - is_eos.to(torch.int64)) > 0
    return ~after_eos


def _per_prompt(samplers: Any, prompts: int) -> list[Any]:
    """One model per prompt from one model or a sequence of them."""
    models = list(samplers) if isinstance(samplers, (list, tuple)) else [samplers] * prompts
    if len(models) != prompts:
        raise ValueError(f"samplers: expected one model or one per prompt ({prompts}), got {len(models)}")
    return models


def sample_rollout(
    samplers: Any,
    *,
    prompts: int,
    group_size: int,
    prompt_len: int,
    max_new_tokens: int,
    seed: int,
    backend: str = "hf",
    record_logp: bool = True,
) -> Rollout:
    """Sample ``group_size`` completions per prompt with ``generate`` (full distribution: no
    top-k/top-p). ``samplers`` is one model, or one per prompt (rollout workers at different
    policy versions, as in asynchronous RL). Each sampled token's log-prob is recorded from
    the raw logits at sampling time (``output_logits``; ``output_scores`` would be
    post-processed)."""
    if backend not in ROLLOUT_BACKENDS:
        raise ValueError(f"backend: expected one of {ROLLOUT_BACKENDS}, got {backend!r}")
    models = _per_prompt(samplers, prompts)
    generator = torch.Generator().manual_seed(seed)
    vocab = models[0].config.vocab_size
    device = next(models[0].parameters()).device
    prompt_ids = torch.randint(3, vocab, (prompts, prompt_len), generator=generator).repeat_interleave(group_size, dim=0).to(device)
    completions, logps = [], []
    for g, model in enumerate(models):
        rows = prompt_ids[g * group_size : (g + 1) * group_size]
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed * 1009 + g)
            out = model.generate(
                rows,
                attention_mask=torch.ones_like(rows),
                do_sample=True,
                max_new_tokens=max_new_tokens,
                top_k=0,
                top_p=1.0,
                temperature=1.0,
                pad_token_id=PAD_ID,
                eos_token_id=EOS_ID,
                output_logits=True,
                return_dict_in_generate=True,
            )
        completion = out.sequences[:, prompt_len:]
        logits = torch.stack(out.logits[: completion.shape[1]], dim=1)
        logp = torch.log_softmax(logits.to(torch.float64), dim=-1).gather(-1, completion[..., None])[..., 0].to(logits.dtype)
        width = max_new_tokens - completion.shape[1]  # generate stops early once every row has ended
        completions.append(torch.nn.functional.pad(completion, (0, width), value=PAD_ID))
        logps.append(torch.nn.functional.pad(logp, (0, width), value=float("nan")))
    completion_ids = torch.cat(completions)
    valid = valid_until_eos(completion_ids)  # generate stops early only once every row has its EOS: padding follows one
    behavior_logp = torch.where(valid, torch.cat(logps), torch.nan) if record_logp else None  # padding is not a sample
    return Rollout(prompt_ids, completion_ids, valid, behavior_logp, reward(completion_ids, valid), group_size, backend)


def token_logp(model: Any, prompt_ids: torch.Tensor, completion_ids: torch.Tensor) -> torch.Tensor:
    """Per-token log-probs of ``completion_ids`` under ``model`` (one forward pass)."""
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    logits = model(ids).logits[:, prompt_ids.shape[1] - 1 : -1]
    return torch.log_softmax(logits, dim=-1).gather(-1, completion_ids[..., None])[..., 0]


def behaviour_logp_of(samplers: Any, rollout: Rollout) -> torch.Tensor:
    """The rollout's tokens' log-probs recomputed under the model(s) that sampled them
    (one model, or one per prompt group), deterministically."""
    models = _per_prompt(samplers, rollout.rows // rollout.group_size)
    rows = lambda g: slice(g * rollout.group_size, (g + 1) * rollout.group_size)  # noqa: E731
    with torch.no_grad():
        return torch.cat([token_logp(m.eval(), rollout.prompt_ids[rows(g)], rollout.completion_ids[rows(g)]) for g, m in enumerate(models)])


# --- fail-closed rules --------------------------------------------------------------------------


def stochastic_layers(model: Any) -> list[str]:
    """Every setting that makes ``model``'s forward pass stochastic (non-zero dropout or
    router jitter in its config, dropout modules with p > 0, batch norm)."""
    found = []
    config = getattr(model, "config", None)
    for name in STOCHASTIC_CONFIG_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            found.append(f"config.{name}={value}")
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            found.append(f"{name or 'model'}: {type(module).__name__}(p={module.p})")
        elif isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            found.append(f"{name or 'model'}: {type(module).__name__}")
    return found


def check_training_setup(config: TrainerConfig, policy: Any, rollout: Rollout, *, require_deterministic: bool = True) -> None:
    """Reject, with an error naming the setting, any setup that would silently change the
    M2PO objective; warn for a non-zero KL coefficient."""
    if config.rollout_backend not in ROLLOUT_BACKENDS:
        raise ValueError(f"rollout_backend: expected one of {ROLLOUT_BACKENDS}, got {config.rollout_backend!r}")
    if config.behavior_logp_source not in BEHAVIOR_SOURCES:
        raise ValueError(f"behavior_logp_source: expected one of {BEHAVIOR_SOURCES}, got {config.behavior_logp_source!r}")
    if config.rollout_backend != rollout.backend:
        raise ValueError(f"rollout_backend: the config says {config.rollout_backend!r} but the rollout came from {rollout.backend!r}")
    if config.rollout_backend == "deployment":
        if config.behavior_logp_source != "rollout":
            raise ValueError(
                "behavior_logp_source: a deployment-backed rollout must use the rollout engine's log-probs; the trainer's "
                "weights are not the weights that sampled, so recomputing them would measure the wrong policy"
            )
        if rollout.behavior_logp is None:
            raise ValueError(
                "behavior_logp: the deployment-backed rollout returned no log-probs of the sampled tokens; M2PO fails closed "
                "rather than fall back to log-probs recomputed by the trainer"
            )
    refuse(config, (TOKEN_LEVEL_RATIOS,))
    if config.rollout_importance_sampling_mode is not None:
        raise ValueError(
            f"rollout_importance_sampling_mode: an extra rollout-IS correction ({config.rollout_importance_sampling_mode!r}) "
            "needs training-engine behaviour log-probs this trainer does not retain; it would correct the same ratio twice"
        )
    stochastic = stochastic_layers(policy) if require_deterministic else []
    if stochastic:
        raise ValueError(
            "model: the mask prepass must be deterministic, but the policy has stochastic layers: "
            f"{', '.join(stochastic)}; set them to 0 (LoRA: lora_dropout 0)"
        )
    if config.beta != 0:
        warnings.warn(
            f"beta={config.beta}: a non-zero KL coefficient adds beta * KL to the M2PO objective (the reference experiments use beta=0)",
            M2POKLWarning,
            stacklevel=3,
        )


# --- the step -------------------------------------------------------------------------------------


def _check_split(split: Sequence[int] | None, rows: int) -> tuple[int, ...]:
    if split is None:
        return (rows,)
    parts = tuple(split)
    if not parts or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in parts) or sum(parts) != rows:
        raise ValueError(f"split: expected non-negative row counts summing to the {rows} rollouts, got {list(parts)}")
    return parts


def _rows_logp(model: Any, rollout: Rollout, rows: slice) -> torch.Tensor:
    """Log-probs of some rows; an empty micro-batch gets an empty tensor without a forward pass."""
    if rows.stop == rows.start:
        dtype = next(model.parameters()).dtype
        return torch.zeros((0, rollout.completion_ids.shape[1]), dtype=dtype, device=rollout.completion_ids.device)
    return token_logp(model, rollout.prompt_ids[rows], rollout.completion_ids[rows])


def selection_metrics(selection: Any) -> dict[str, float | int]:
    """A selection's metrics and counts as Python numbers (what a framework logs)."""
    return {
        **{name: float(getattr(selection, name)) for name in METRIC_FIELDS},
        **{name: int(getattr(selection, name)) for name in COUNT_FIELDS},
    }


def micro_batch_metrics(
    logp: torch.Tensor, behavior_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, keep: torch.Tensor
) -> dict[str, float]:
    """M2PO's logged metrics over one micro-batch's tokens only, on the mask it was handed: what a
    loss that sees one micro-batch computes (a port's natural metrics, planted by the controls
    whose trainer averages them over micro-batches; Algorithm 1's are the optimizer batch's)."""
    d = torch.where(mask, logp.double() - behavior_logp.double(), 0.0)
    a = advantages.double()
    trust = mask & (((a > 0) & (d > 0)) | ((a < 0) & (d < 0)))
    kept_trust = trust & keep
    m2 = d * d
    valid, in_trust, kept = int(mask.sum()), int(trust.sum()), int(kept_trust.sum())
    return {
        "m2_before": float(m2[trust].sum()) / in_trust if in_trust else 0.0,
        "m2_after": float(m2[kept_trust].sum()) / kept if kept else 0.0,
        "masked_fraction": int((mask & ~keep).sum()) / valid if valid else 0.0,
        "trust_region_fraction": in_trust / valid if valid else 0.0,
    }


class GRPOTrainer:
    """One GRPO + M2PO optimizer step per :meth:`step`; the policy is updated in place."""

    def __init__(
        self,
        policy: Any,
        config: TrainerConfig = TrainerConfig(),
        *,
        faults: TrainerFaults = TrainerFaults(),
        behaviour: Any = None,
        reference: Any = None,
    ) -> None:
        self.policy, self.config, self.faults = policy, config, faults
        self.behaviour = (
            behaviour  # the sampling model (or one per prompt), for trainer-side recomputation (synchronous HF generation only)
        )
        self.reference = reference  # the KL reference model, needed when beta != 0
        self.optimizer = self.make_optimizer(policy.parameters())

    def make_optimizer(self, parameters: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(parameters, lr=self.config.lr)

    def _behavior_logp(self, rollout: Rollout) -> torch.Tensor:
        if self.faults.current_policy_as_behavior:
            with torch.no_grad():
                return token_logp(self.policy, rollout.prompt_ids, rollout.completion_ids)
        if self.config.behavior_logp_source == "rollout":
            if rollout.behavior_logp is None:
                raise ValueError(
                    "behavior_logp: the rollout carries no behaviour log-probs; set behavior_logp_source='trainer' "
                    "(synchronous HF generation only) or record them at sampling"
                )
            return rollout.behavior_logp
        if self.behaviour is None:
            raise ValueError("behaviour: behavior_logp_source='trainer' needs the model that sampled the rollout")
        return behaviour_logp_of(self.behaviour, rollout)

    def _sampler_logp(self, rollout: Rollout) -> torch.Tensor | None:
        """The log-probs the sampler assigned to the rollout's tokens: the rollout engine's,
        else recomputed under the behaviour model; ``None`` when neither is known. Never the
        current policy's, whatever the faults: a capture that holds them next to the
        behaviour log-probs the loss used is how an audit sees current_policy_as_behavior."""
        if rollout.behavior_logp is not None:
            return rollout.behavior_logp
        if self.behaviour is not None:
            return behaviour_logp_of(self.behaviour, rollout)
        return None

    def step(
        self, rollout: Rollout, split: Sequence[int] | None = None, *, recorder: Any = None, step_index: int | None = None
    ) -> StepRecord:
        """One optimizer step over ``rollout`` split into micro-batches of ``split`` rows.

        With ``recorder`` (an ``m2po_oracle.capture.Recorder``) the step is recorded as
        optimizer step ``step_index``: for micro-batch ``i``, after its backward, the loss
        pass's log-probs, the behaviour log-probs, advantages, valid mask and kept mask it was
        fed, its loss, its own selection's metrics, the mask prepass's log-probs
        (``selection_logp``), the sampler's log-probs (``rollout_logp``, when known) and
        d loss / d logp (``grad``); then the parameter gradients, right before the optimizer
        step. With ``beta != 0`` the recorded loss and grad include ``beta * KL``, which
        Algorithm 1 does not have (compare runs use beta = 0).
        """
        policy, faults = self.policy, self.faults
        if recorder is not None and (isinstance(step_index, bool) or not isinstance(step_index, int) or step_index < 0):
            raise ValueError(f"step_index: a recorded step needs its optimizer step number, an integer >= 0; got {step_index!r}")
        parts = _check_split(split, rollout.rows)
        if self.config.beta != 0 and self.reference is None:
            raise ValueError("reference: beta != 0 needs a reference model for the KL term")
        check_training_setup(self.config, policy, rollout, require_deterministic=not faults.skip_determinism_check)
        behavior_logp = self._behavior_logp(rollout).to(torch.float64)
        token_advantages = group_advantages(rollout.rewards, rollout.group_size)[:, None].expand_as(behavior_logp).clone()
        bounds = [0]
        for count in parts:
            bounds.append(bounds[-1] + count)
        rows = [slice(a, b) for a, b in itertools.pairwise(bounds)]
        params_before = {n: p.detach().clone() for n, p in policy.named_parameters()}
        # Before policy.train(): recomputing under a behaviour model sets it to eval mode.
        sampler_logp = self._sampler_logp(rollout) if recorder is not None else None
        policy.train()
        with torch.no_grad():  # the mask prepass: every micro-batch of the optimizer batch before any backward
            prepass = [_rows_logp(policy, rollout, r) for r in rows]
        inputs = [(prepass[i], behavior_logp[r], token_advantages[r], rollout.valid[r]) for i, r in enumerate(rows)]
        selections = select_micro_batches(inputs, tau=self.config.tau)
        window_n = [s.valid_count for s in selections]  # the optimizer batch's N, whatever a fault selects
        if faults.per_micro_batch_mask:  # each micro-batch selects alone; N stays the optimizer batch's
            selections = [
                replace(select_micro_batches([parts_i], tau=self.config.tau)[0], valid_count=whole.valid_count)
                for parts_i, whole in zip(inputs, selections)
            ]
        if faults.core_per_micro_batch:  # the natural port: the core per micro-batch, its selection and metrics its own
            selections = [select_micro_batches([parts_i], tau=self.config.tau)[0] for parts_i in inputs]
        self.optimizer.zero_grad(set_to_none=True)
        total_loss, kl_total, logps, token_grads = 0.0, 0.0, [], []
        k = len(rows)
        for i, (r, selection) in enumerate(zip(rows, selections)):
            logp = _rows_logp(policy, rollout, r)
            if logp.requires_grad:
                logp.retain_grad()
            n = window_n[i] if faults.core_per_micro_batch else selection.valid_count
            if faults.per_micro_batch_denominator:
                loss = loss_from_selection(logp, behavior_logp[r], token_advantages[r], selection.keep, rollout.valid[r].sum()) / k
            else:
                loss = loss_from_selection(logp, behavior_logp[r], token_advantages[r], selection.keep, n)
            if self.config.beta != 0:
                kl = self._kl(logp, rollout, r, n)
                kl_total += float(kl.detach())
                loss = loss + self.config.beta * kl
            if loss.requires_grad:
                loss.backward()
            token_grad = logp.grad.detach() if logp.grad is not None else torch.zeros_like(logp)
            if recorder is not None:
                recorder.record(
                    step=step_index,
                    micro_batch=i,
                    logp=logp,
                    behavior_logp=behavior_logp[r],
                    advantages=token_advantages[r],
                    mask=rollout.valid[r],
                    keep=selection.keep,
                    loss=float(loss.detach()),
                    tau=self.config.tau,
                    metrics=selection_metrics(selection),
                    selection_logp=prepass[i],
                    rollout_logp=None if sampler_logp is None else sampler_logp[r],
                    grad=token_grad,
                )
            if faults.optimizer_step_per_micro_batch:
                self.optimizer.step()
            total_loss += float(loss.detach())
            logps.append(logp.detach())
            token_grads.append(token_grad)
        if faults.drop_gradient_of is not None:
            dropped = dict(policy.named_parameters())[faults.drop_gradient_of]
            if dropped.grad is not None:
                dropped.grad.zero_()
        param_grads = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for n, p in policy.named_parameters()}
        if recorder is not None:  # where the one optimizer step is (noted once even where the fault stepped per micro-batch)
            recorder.record_parameter_gradients(step=step_index, named_parameters=policy.named_parameters())
        if not faults.optimizer_step_per_micro_batch:
            self.optimizer.step()
        policy.eval()
        metrics = selection_metrics(selections[0])
        if (
            faults.per_micro_batch_mask or faults.core_per_micro_batch
        ):  # metrics exist per micro-batch only (recorded): the step reports none
            metrics = {}
        cpu = lambda t: t.detach().cpu()  # noqa: E731  # the record is for checks, on the host
        return StepRecord(
            logp=cpu(torch.cat(logps)),
            behavior_logp=cpu(behavior_logp),
            advantages=cpu(token_advantages),
            valid=cpu(rollout.valid),
            keep=cpu(torch.cat([s.keep for s in selections])),
            loss=total_loss,
            metrics=metrics,
            token_grad=cpu(torch.cat(token_grads)),
            param_grads={n: cpu(g) for n, g in param_grads.items()},
            params_before={n: cpu(p) for n, p in params_before.items()},
            params_after={n: cpu(p) for n, p in policy.named_parameters()},
            split=parts,
            tau=float(self.config.tau),
            kl_term=kl_total,
        )

    def _kl(self, logp: torch.Tensor, rollout: Rollout, rows: slice, valid_count: torch.Tensor) -> torch.Tensor:
        """k3 estimator of KL(policy || reference) over the valid tokens, with the batch's N."""
        if rows.stop == rows.start:  # an empty micro-batch has no tokens to compare (and a forward over no rows fails)
            return torch.zeros((), dtype=logp.dtype, device=logp.device)
        with torch.no_grad():
            reference = token_logp(self.reference.eval(), rollout.prompt_ids[rows], rollout.completion_ids[rows])
        valid = rollout.valid[rows]
        delta = torch.where(valid, reference - logp, torch.zeros_like(logp))
        per_token = -delta if self.faults.kl_k1_estimator else torch.exp(delta) - delta - 1
        return per_token.sum() / valid_count.clamp(min=1).to(per_token.dtype)
