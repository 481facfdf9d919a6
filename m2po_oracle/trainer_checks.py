"""The battery on a whole GRPO training step (``compare --impl trainer``).

The explored input is a :class:`TrainerCase` (seed, rollout shape, staleness, tau and the
micro-batch split), not a batch: the trainer samples its own rollout and computes its own
log-probs. The oracle then judges the batch the trainer produced:

* every single-process value check (selection, loss, per-token gradient, metrics) on the
  trainer's own log-probs, behaviour log-probs, advantages and mask;
* ``trainer.behavior_logp`` / ``trainer.policy_logp``: the log-probs are those of the
  right model, recomputed here deterministically from snapshots taken before the step;
* ``trainer.parameter_gradient``: the analytic per-token gradient pulled back through the
  model (a vector-Jacobian product) equals each parameter's gradient;
* ``trainer.accumulation``: with k > 1 micro-batches, the same step run as one
  micro-batch gives the same mask, loss and gradient;
* ``trainer.optimizer_step``: the update is one optimizer step with the reported gradient.

A failing step is matched against :data:`TRAINER_VARIANTS`, each reproduced from the
step's own data, so the report names the trainer-level deviation.
"""

from __future__ import annotations

import copy
import functools
import json
import shlex
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

from m2po_oracle import oracle
from m2po_oracle.batch import Batch
from m2po_oracle.battery import CHECKS, BatteryOutcome
from m2po_oracle.contract import Finding, Measurement
from m2po_oracle.equivalence import Mismatch, compare_to_oracle, compare_values, same_up_to_ties, tolerance, valid_m2
from m2po_oracle.record import COUNT_FIELDS, METRIC_FIELDS, M2POResult
from m2po_oracle.trainer_checks_names import TRAINER_CHECKS

#: The trainer's model dtypes (``--dtype``).
TRAINER_DTYPES = {"float64": torch.float64, "float32": torch.float32}
#: Learning rate of the step under test (the staleness lr is part of the case).
STEP_LR = 1e-2
#: Checks a trainer step runs: the battery's value checks on its batch, then its own (the
#: loss-function behaviour checks, padding probes, determinism and mutation, do not apply).
CHECK_NAMES = tuple(n for n in CHECKS if n in ("call", "loss", "gradient") or n.startswith(("selection.", "metrics."))) + tuple(TRAINER_CHECKS)


@dataclass(frozen=True)
class TrainerCase:
    """One training step to run: everything that determines it."""

    seed: int
    prompts: int
    group_size: int
    prompt_len: int
    max_new_tokens: int
    lags: tuple[int, ...]  # per prompt: optimizer steps its rollout worker is behind the current policy
    staleness_lr: float
    tau: float
    split: tuple[int, ...]  # rows per micro-batch; sums to prompts * group_size

    def __post_init__(self) -> None:
        for name in ("seed", "prompts", "group_size", "prompt_len", "max_new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "seed" else 1):
                raise ValueError(f"{name}: expected a {'non-negative' if name == 'seed' else 'positive'} integer, got {value!r}")
        if len(self.lags) != self.prompts or any(isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 8 for n in self.lags):
            raise ValueError(f"lags: expected one integer in 0..8 per prompt ({self.prompts}), got {list(self.lags)}")
        if isinstance(self.staleness_lr, bool) or not isinstance(self.staleness_lr, (int, float)) or not 0 < self.staleness_lr <= 1:
            raise ValueError(f"staleness_lr: expected a number in (0, 1], got {self.staleness_lr!r}")
        if isinstance(self.tau, bool) or not isinstance(self.tau, (int, float)) or not 0 <= self.tau < float("inf"):
            raise ValueError(f"tau: expected a finite number >= 0, got {self.tau!r}")
        if self.prompt_len + self.max_new_tokens > 64:
            raise ValueError(f"prompt_len + max_new_tokens: expected at most 64 (the model's positions), got {self.prompt_len + self.max_new_tokens}")
        rows = self.prompts * self.group_size
        if not self.split or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in self.split) or sum(self.split) != rows:
            raise ValueError(f"split: expected non-negative row counts summing to prompts * group_size = {rows}, got {list(self.split)}")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "trainer_case", **asdict(self), "lags": list(self.lags), "split": list(self.split)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainerCase":
        if not isinstance(data, dict) or data.get("kind") != "trainer_case":
            raise ValueError(f"trainer case: expected a JSON object with \"kind\": \"trainer_case\", got {str(data)[:80]!r}")
        fields_ = {k: v for k, v in data.items() if k != "kind"}
        try:
            return cls(**{**fields_, "lags": tuple(fields_.get("lags", ())), "split": tuple(fields_.get("split", ()))})
        except TypeError as error:
            raise ValueError(f"trainer case: {error}") from None


@st.composite
def trainer_cases(draw: st.DrawFn, tau: float | None = None) -> TrainerCase:
    """Small steps first (Hypothesis shrinks towards one prompt, two rows, one token)."""
    prompts = draw(st.integers(1, 3))
    group_size = draw(st.integers(2, 4))
    rows = prompts * group_size
    k = draw(st.integers(1, 4))
    cuts = sorted(draw(st.lists(st.integers(0, rows), min_size=k - 1, max_size=k - 1)))
    split = tuple(b - a for a, b in zip([0, *cuts], [*cuts, rows]))
    return TrainerCase(
        seed=draw(st.integers(0, 2**16)), prompts=prompts, group_size=group_size, prompt_len=draw(st.integers(1, 4)),
        max_new_tokens=draw(st.integers(1, 8)), lags=tuple(draw(st.lists(st.integers(0, 3), min_size=prompts, max_size=prompts))),
        staleness_lr=draw(st.sampled_from([0.02, 0.01, 0.005])),
        tau=tau if tau is not None else draw(st.sampled_from([0.02, 0.04, 0.01, 0.1, 0.0])), split=split)


# --- controls -------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainerControl:
    """A planted trainer bug and the checks that must catch it."""

    name: str
    description: str
    faults: dict[str, bool]
    caught_by: tuple[str, ...]
    model_dropout: float = 0.0
    diagnosed_as: str = ""  # the trainer variant the diagnosis must name (default: the control's name)
    # Steps the suite gives it: a per-micro-batch mask only shows where two micro-batches
    # select differently (about 5 % of generated steps; first caught at 7-71 over seeds 0-5).
    examples: int = 60

    @property
    def variant(self) -> str:
        return self.diagnosed_as or self.name


TRAINER_CONTROLS: tuple[TrainerControl, ...] = (
    TrainerControl("per_micro_batch_mask", "the mask is selected within each gradient-accumulation micro-batch",
                   {"per_micro_batch_mask": True}, ("trainer.accumulation",), examples=150),
    TrainerControl("current_policy_as_behavior", "the current policy's log-probs are used as the behaviour log-probs",
                   {"current_policy_as_behavior": True}, ("trainer.behavior_logp",)),
    TrainerControl("per_micro_batch_denominator", "each micro-batch divides by its own valid count (then by k), not the optimizer batch's",
                   {"per_micro_batch_denominator": True}, ("trainer.accumulation", "gradient")),
    TrainerControl("dropout_left_on", "attention dropout 0.1 stays on: the mask prepass and the loss pass see different forwards",
                   {"skip_determinism_check": True}, ("trainer.policy_logp",), model_dropout=0.1, diagnosed_as="stochastic_forward"),
    TrainerControl("optimizer_step_per_micro_batch", "optimizer.step() runs after every micro-batch instead of once per optimizer batch",
                   {"optimizer_step_per_micro_batch": True}, ("trainer.optimizer_step",)),
    TrainerControl("embedding_gradient_dropped", "the input embedding's gradient is zeroed before the step (a freeze wired to the wrong parameter)",
                   {"drop_gradient_of": "model.embed_tokens.weight"}, ("trainer.parameter_gradient",), diagnosed_as="parameters_without_gradient"),
)
CONTROLS_BY_NAME = {c.name: c for c in TRAINER_CONTROLS}
#: Built-in names of whole training steps: the trainer and its planted controls.
TRAINER_IMPLEMENTATIONS: tuple[str, ...] = ("trainer",) + tuple(f"trainer:{c.name}" for c in TRAINER_CONTROLS)


# --- running a case -------------------------------------------------------------------------


@dataclass
class TrainerStep:
    """One case run through the trainer, with the snapshots the checks need."""

    case: TrainerCase
    dtype: str
    trainer: Any
    rollout: Any
    samplers: list[Any]  # the model that sampled each prompt's group
    policy_before: Any  # a copy of the policy at the step's start (eval mode)
    record: Any  # trainer.StepRecord
    single: Any | None  # the same step as one micro-batch (k > 1 only)
    batch: Batch = field(init=False)

    def __post_init__(self) -> None:
        r = self.record
        numpy = lambda t: t.detach().to(torch.float64).numpy().copy()  # noqa: E731
        self.batch = Batch(numpy(r.logp), numpy(r.behavior_logp), numpy(r.advantages), r.valid.numpy().copy(), r.tau)

    # Recomputations from the snapshots, shared by the checks and the diagnosis.

    @functools.cached_property
    def sampler_logp(self) -> np.ndarray:
        """The rollout's tokens under the workers that sampled them."""
        return _recomputed_logp(self.samplers, self.rollout)

    @functools.cached_property
    def current_logp(self) -> np.ndarray:
        """The rollout's tokens under the policy before the step."""
        return _recomputed_logp(self.policy_before, self.rollout)

    @functools.cached_property
    def pulled_back_gradient(self) -> dict[str, torch.Tensor]:
        """Algorithm 1's per-token gradient on the trainer's mask, pulled back through the snapshot."""
        token_grad = oracle.evaluate_with_mask(self.batch, self.record.keep.numpy()).grad
        return _pullback(copy.deepcopy(self.policy_before), self.rollout, token_grad)

    @functools.cached_property
    def one_optimizer_step(self) -> dict[str, torch.Tensor]:
        """The parameters after one step of the trainer's optimizer with the reported gradient."""
        return _optimizer_replay(self)


#: How a trainer under test is built: ``make_trainer(policy, config, *, behaviour, reference)``
#: returns an object with ``step(rollout, split) -> StepRecord`` and ``make_optimizer(params)``
#: (``trainer.GRPOTrainer`` is one; a class with that constructor is another).
TrainerFactory = Callable[..., Any]


def _builtin_trainer(faults: dict[str, Any] | None) -> TrainerFactory:
    from m2po_oracle.trainer import GRPOTrainer, TrainerFaults

    planted = TrainerFaults(**(faults or {}))
    return lambda policy, config, **options: GRPOTrainer(policy, config, faults=planted, **options)


def setup_case(case: TrainerCase, *, dtype: str = "float64", dropout: float = 0.0, device: str = "cpu", backend: str = "hf",
               record_logp: bool = True) -> tuple[list[Any], list[Any], Any]:
    """(policy versions oldest first, the sampling worker per prompt, the rollout) of ``case``."""
    from m2po_oracle.trainer import make_policy_versions, sample_rollout

    if dtype not in TRAINER_DTYPES:
        raise ValueError(f"dtype: the trainer runs its model in one of {sorted(TRAINER_DTYPES)}, got {dtype!r}")
    versions = make_policy_versions(case.seed, steps=max(case.lags), lr=case.staleness_lr, dtype=TRAINER_DTYPES[dtype], dropout=dropout, device=device)
    samplers = [versions[-1 - lag] if lag else copy.deepcopy(versions[-1]) for lag in case.lags]  # a lag-0 worker holds a copy of the weights
    rollout = sample_rollout(samplers, prompts=case.prompts, group_size=case.group_size, prompt_len=case.prompt_len,
                             max_new_tokens=case.max_new_tokens, seed=case.seed, backend=backend, record_logp=record_logp)
    return versions, samplers, rollout


def run_case(case: TrainerCase, *, dtype: str = "float64", control: TrainerControl | None = None, device: str = "cpu",
             make_trainer: TrainerFactory | None = None) -> TrainerStep:
    """``case`` through the trainer (ours, with ``control``'s faults, or ``make_trainer``'s)."""
    from m2po_oracle.trainer import TrainerConfig

    make_trainer = make_trainer or _builtin_trainer(control.faults if control else None)
    versions, samplers, rollout = setup_case(case, dtype=dtype, dropout=control.model_dropout if control else 0.0, device=device)
    policy = versions[-1]
    config = TrainerConfig(tau=case.tau, lr=STEP_LR)
    policy_before = copy.deepcopy(policy).eval()
    single_policy = copy.deepcopy(policy) if len(case.split) > 1 else None
    trainer = make_trainer(policy, config, behaviour=samplers, reference=versions[0])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(case.seed)
        record = check_record(trainer.step(rollout, case.split), rollout, policy_before)
        single = None
        if single_policy is not None:
            single = check_record(make_trainer(single_policy, config, behaviour=samplers, reference=versions[0]).step(rollout), rollout, policy_before)
    return TrainerStep(case, dtype, trainer, rollout, samplers, policy_before, record, single)


#: What a step record must hold, by field: (kind, shape rule).
_RECORD_TENSORS = ("logp", "behavior_logp", "advantages", "valid", "keep", "token_grad")


def check_record(record: Any, rollout: Any, policy: Any) -> Any:
    """``record`` if it is a complete step record for ``rollout``; TypeError/ValueError naming
    the field otherwise (a trainer under test may return anything)."""
    shape = tuple(rollout.completion_ids.shape)
    for name in _RECORD_TENSORS + ("loss", "metrics", "param_grads", "params_after", "split", "tau", "kl_term"):
        if not hasattr(record, name):
            raise TypeError(f"step record: expected a trainer.StepRecord (or an object with its fields); {type(record).__name__} has no {name!r}")
    for name in _RECORD_TENSORS:
        value = getattr(record, name)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape or value.device.type != "cpu":
            got = f"{type(value).__name__} of shape {tuple(value.shape)} on {value.device}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"step record: {name}: expected a CPU tensor of shape {shape} (the rollout's), got {got}")
    for name in ("valid", "keep"):
        if getattr(record, name).dtype != torch.bool:
            raise ValueError(f"step record: {name}: expected dtype torch.bool, got {getattr(record, name).dtype}")
    params = dict(policy.named_parameters())
    for name in ("param_grads", "params_after"):
        value = getattr(record, name)
        if not isinstance(value, dict) or set(value) != set(params):
            raise ValueError(f"step record: {name}: expected a dict with every parameter name of the policy ({len(params)}), got "
                             f"{sorted(value)[:5] if isinstance(value, dict) else type(value).__name__}")
        for key, tensor in value.items():
            if not isinstance(tensor, torch.Tensor) or tensor.shape != params[key].shape:
                raise ValueError(f"step record: {name}[{key!r}]: expected a tensor of shape {tuple(params[key].shape)}")
    for name in ("loss", "tau", "kl_term"):
        if isinstance(getattr(record, name), bool) or not isinstance(getattr(record, name), (int, float)):
            raise TypeError(f"step record: {name}: expected a Python number, got {type(getattr(record, name)).__name__}")
    split = record.split
    if not isinstance(split, (tuple, list)) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in split) or sum(split) != shape[0]:
        raise ValueError(f"step record: split: expected non-negative row counts summing to {shape[0]}, got {split!r}")
    if not isinstance(record.metrics, dict) or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in record.metrics.values()):
        raise TypeError(f"step record: metrics: expected a dict of Python numbers, got {record.metrics!r}"[:300])
    return record


def _result(record: Any) -> M2POResult:
    metrics = {name: record.metrics[name] for name in METRIC_FIELDS + COUNT_FIELDS if name in record.metrics}
    return M2POResult(loss=record.loss - record.kl_term, keep=record.keep.numpy().copy(), grad=record.token_grad.to(torch.float64).numpy().copy(), **metrics)


def _recomputed_logp(models: Any, rollout: Any) -> np.ndarray:
    """Log-probs of the rollout's tokens under ``models`` (one, or one per prompt), deterministically."""
    from m2po_oracle.trainer import behaviour_logp_of

    return behaviour_logp_of(models, rollout).to(torch.float64).cpu().numpy()


#: Rollout engines record log-probs in float32 (``generate`` casts its logits to float32, as
#: vLLM returns float32 log-probs), whatever the model's dtype.
ROLLOUT_LOGP_DTYPE = "float32"


def _logp_check(check: str, what: str, reported: np.ndarray, expected: np.ndarray, valid: np.ndarray, dtype: str) -> Mismatch | None:
    # Log-probs are O(1) quantities: scale 1 keeps near-zero log-probs from demanding relative precision.
    mismatch = compare_values(check, what, np.where(valid, reported, 0.0), np.where(valid, expected, 0.0), tolerance(dtype, "metric"), scale=1.0)
    if mismatch is None:
        return None
    return Mismatch(check, f"{mismatch.summary} (valid tokens; expected recomputed from the model snapshot)", mismatch.field, mismatch.index,
                    mismatch.actual, mismatch.expected, mismatch.details)


def _pullback(model: Any, rollout: Any, token_grad: np.ndarray, rows: slice | None = None) -> dict[str, torch.Tensor]:
    """Parameter gradients of sum(token_grad * logp) through a deterministic forward of ``model``."""
    from m2po_oracle.trainer import token_logp

    rows = rows or slice(0, rollout.rows)
    params = dict(model.named_parameters())
    if rows.stop == rows.start:
        return {n: torch.zeros_like(p, device="cpu") for n, p in params.items()}
    logp = token_logp(model.eval(), rollout.prompt_ids[rows], rollout.completion_ids[rows])
    weights = torch.tensor(token_grad[rows], dtype=logp.dtype, device=logp.device)
    grads = torch.autograd.grad(logp, list(params.values()), grad_outputs=weights, allow_unused=True)
    return {n: (g if g is not None else torch.zeros_like(p)).detach().cpu() for (n, p), g in zip(params.items(), grads)}


def _compare_params(check: str, actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], dtype: str, what: str) -> Mismatch | None:
    tol = tolerance(dtype, "gradient")
    # Entries far below the largest are judged against the largest (as for per-token gradients).
    scale = max((float(t.abs().max()) for t in expected.values() if t.numel()), default=0.0)
    for name, want in expected.items():
        got = actual.get(name)
        if got is None:
            return Mismatch(check, f"{what}: parameter {name!r} is missing", field=name)
        mismatch = compare_values(check, name, got.to(torch.float64).cpu().numpy(), want.to(torch.float64).cpu().numpy(), tol, scale=scale)
        if mismatch is not None:
            return Mismatch(check, f"{what}: parameter {name!r}: {mismatch.summary}", name, mismatch.index, mismatch.actual, mismatch.expected, mismatch.details)
    return None


def _optimizer_replay(step: TrainerStep, micro_batches: list[slice] | None = None) -> dict[str, torch.Tensor]:
    """Parameters after the step, replayed from the snapshot with the trainer's optimizer.

    Without ``micro_batches``: one step with the reported gradient. With them: a step
    after every micro-batch, each micro-batch's reported per-token gradient pulled back
    through the model as it then is, accumulated as ``backward`` accumulates."""
    model = copy.deepcopy(step.policy_before)
    optimizer = step.trainer.make_optimizer(model.parameters())
    if micro_batches is None:
        for name, p in model.named_parameters():
            p.grad = step.record.param_grads[name].to(p.device).clone()
        optimizer.step()
    else:
        token_grad = step.record.token_grad.to(torch.float64).numpy()
        running = {n: torch.zeros_like(p, device="cpu") for n, p in model.named_parameters()}
        for rows in micro_batches:
            if rows.stop > rows.start:  # before any backward, .grad is None and the optimizer skips the parameter
                grads = _pullback(model, step.rollout, token_grad, rows)
                for name, p in model.named_parameters():
                    running[name] = running[name] + grads[name]
                    p.grad = running[name].to(p.device).clone()
            optimizer.step()
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def check_trainer_step(step: TrainerStep) -> list[Mismatch]:
    """Every mismatch of one training step (see the module docstring)."""
    record, batch, dtype = step.record, step.batch, step.dtype
    valid = batch.valid
    found = compare_to_oracle(batch, _result(record), dtype)
    mismatch = _logp_check("trainer.behavior_logp", "behavior_logp", batch.behavior_logp, step.sampler_logp, valid, ROLLOUT_LOGP_DTYPE)
    found += [mismatch] if mismatch else []
    mismatch = _logp_check("trainer.policy_logp", "logp", batch.logp, step.current_logp, valid, dtype)
    found += [mismatch] if mismatch else []
    mismatch = _compare_params("trainer.parameter_gradient", record.param_grads, step.pulled_back_gradient, dtype,
                               "the analytic gradient pulled back through the model")
    found += [mismatch] if mismatch else []
    if step.single is not None:
        found += _accumulation(step)
    mismatch = _compare_params("trainer.optimizer_step", record.params_after, step.one_optimizer_step, dtype, "one optimizer step with the reported gradient")
    found += [mismatch] if mismatch else []
    return found


def _accumulation(step: TrainerStep) -> list[Mismatch]:
    record, single, dtype = step.record, step.single, step.dtype
    label = f"split {list(record.split)} vs one micro-batch"
    found = []
    keep, one = record.keep.numpy(), single.keep.numpy()
    if not same_up_to_ties(one, keep, valid_m2(step.batch)):
        diff = np.argwhere(keep != one)
        index = tuple(int(i) for i in diff[0])
        found.append(Mismatch("trainer.accumulation", f"{label}: keep differs at {len(diff)} token(s), first at index {index}: the mask was not selected "
                              "once over the optimizer batch", "keep", index, bool(keep[index]), bool(one[index])))
    scale = float(np.abs(single.token_grad.to(torch.float64).numpy()).sum())
    mismatch = compare_values("trainer.accumulation", "loss", record.loss, single.loss, tolerance(dtype, "loss"), scale=scale)
    if mismatch:
        found.append(Mismatch(mismatch.check, f"{label}: {mismatch.summary}", "loss", None, record.loss, single.loss, mismatch.details))
    mismatch = _compare_params("trainer.accumulation", record.param_grads, single.param_grads, dtype, f"{label}: accumulated gradient")
    found += [mismatch] if mismatch else []
    return found


# --- diagnosis -----------------------------------------------------------------------------


def _micro_rows(split: tuple[int, ...]) -> list[slice]:
    bounds = np.cumsum((0, *split))
    return [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def _sub(batch: Batch, rows: slice) -> Batch:
    return Batch(batch.logp[rows], batch.behavior_logp[rows], batch.advantages[rows], batch.valid[rows], batch.tau)


# Each test returns (reproduces, distinct): whether the variant reproduces the step, and
# whether on this step the variant differs from the correct trainer at all (a variant that
# coincides with Algorithm 1 here is consistent with the step but no evidence for it).


def _test_per_micro_batch_mask(step: TrainerStep) -> tuple[bool, bool]:
    keep, batch, m2 = step.record.keep.numpy(), step.batch, valid_m2(step.batch)
    predicted = np.zeros(batch.shape, dtype=bool)
    for r in _micro_rows(step.record.split):
        if r.stop > r.start:
            predicted[r] = oracle.m2po(_sub(batch, r)).keep
    return same_up_to_ties(predicted, keep, m2), not same_up_to_ties(predicted, oracle.m2po(batch).keep, m2)


def _test_per_micro_batch_denominator(step: TrainerStep) -> tuple[bool, bool]:
    keep, batch, k = step.record.keep.numpy(), step.batch, len(step.record.split)
    predicted = np.zeros(batch.shape)
    for r in _micro_rows(step.record.split):
        if r.stop > r.start:
            predicted[r] = oracle.evaluate_with_mask(_sub(batch, r), keep[r]).grad / k
    correct = oracle.evaluate_with_mask(batch, keep).grad
    tol = tolerance(step.dtype, "gradient")
    close = lambda a, b: compare_values("diagnosis", "grad", a, b, tol, scale=float(np.abs(b).max(initial=0)) * tol.rtol) is None  # noqa: E731
    return close(step.record.token_grad.to(torch.float64).numpy(), predicted), not close(correct, predicted)


def _test_current_policy_as_behavior(step: TrainerStep) -> tuple[bool, bool]:
    same = lambda a, b: _logp_check("diagnosis", "behavior_logp", a, b, step.batch.valid, ROLLOUT_LOGP_DTYPE) is None  # noqa: E731
    return same(step.batch.behavior_logp, step.current_logp), not same(step.sampler_logp, step.current_logp)


def _test_stochastic_forward(step: TrainerStep) -> tuple[bool, bool]:
    from m2po_oracle.trainer import stochastic_layers

    differs = _logp_check("diagnosis", "logp", step.batch.logp, step.current_logp, step.batch.valid, step.dtype) is not None
    reproduces = differs and bool(stochastic_layers(step.policy_before))
    return reproduces, reproduces


def _test_optimizer_step_per_micro_batch(step: TrainerStep) -> tuple[bool, bool]:
    micro = _micro_rows(step.record.split)  # an empty micro-batch still reaches optimizer.step()
    replayed = _optimizer_replay(step, micro)
    same = lambda a, b: _compare_params("diagnosis", a, b, step.dtype, "") is None  # noqa: E731
    return same(step.record.params_after, replayed), not same(step.one_optimizer_step, replayed)


def _test_parameters_without_gradient(step: TrainerStep) -> tuple[bool, bool]:
    """Some parameters report an all-zero gradient where the pulled-back gradient is not
    zero, and every other parameter's gradient is right."""
    expected, reported = step.pulled_back_gradient, step.record.param_grads
    silent = {n for n, g in reported.items() if not bool(g.any()) and bool(expected[n].any())}
    rest_right = _compare_params("diagnosis", {n: g for n, g in reported.items() if n not in silent},
                                 {n: g for n, g in expected.items() if n not in silent}, step.dtype, "") is None
    return bool(silent) and rest_right, bool(silent)


@dataclass(frozen=True)
class TrainerVariant:
    name: str
    description: str
    test: Callable[[TrainerStep], tuple[bool, bool]]


TRAINER_VARIANTS: tuple[TrainerVariant, ...] = (
    TrainerVariant("per_micro_batch_mask", CONTROLS_BY_NAME["per_micro_batch_mask"].description, _test_per_micro_batch_mask),
    TrainerVariant("per_micro_batch_denominator", CONTROLS_BY_NAME["per_micro_batch_denominator"].description, _test_per_micro_batch_denominator),
    TrainerVariant("current_policy_as_behavior", CONTROLS_BY_NAME["current_policy_as_behavior"].description, _test_current_policy_as_behavior),
    TrainerVariant("stochastic_forward", "the policy's forward is stochastic (dropout or similar): the log-probs differ from a deterministic "
                   "recomputation and the model has stochastic layers", _test_stochastic_forward),
    TrainerVariant("optimizer_step_per_micro_batch", CONTROLS_BY_NAME["optimizer_step_per_micro_batch"].description,
                   _test_optimizer_step_per_micro_batch),
    TrainerVariant("parameters_without_gradient", "some parameters get no gradient (frozen or detached by mistake) while the loss depends on them",
                   _test_parameters_without_gradient),
)
VARIANT_DESCRIPTIONS = {v.name: v.description for v in TRAINER_VARIANTS}


def explain(step: TrainerStep) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(consistent, evidenced): the trainer variants that reproduce a failing step, and
    those among them that differ from the correct trainer on it. Never raises."""
    consistent, evidenced = [], []
    for variant in TRAINER_VARIANTS:
        try:
            reproduces, distinct = variant.test(step)
        except Exception:  # a variant that cannot be evaluated on this step does not explain it
            continue
        if reproduces:
            consistent.append(variant.name)
            if distinct:
                evidenced.append(variant.name)
    return tuple(consistent), tuple(evidenced)


# --- fail-closed probes ----------------------------------------------------------------------


@dataclass(frozen=True)
class TrainerProbe:
    """A setup the trainer must refuse (or, for ``expected="warned"``, allow with a warning)."""

    name: str
    description: str
    argument: str  # the setting the error (or warning) must name
    config: dict[str, Any] = field(default_factory=dict)  # TrainerConfig fields
    backend: str = "hf"  # the rollout's engine
    record_logp: bool = True  # whether the engine returned behaviour log-probs
    model_dropout: float = 0.0
    expected: str = "rejected"


TRAINER_PROBES: tuple[TrainerProbe, ...] = (
    TrainerProbe("deployment_behavior_logp_missing", "deployment-backed rollout returned no behaviour log-probs", "behavior_logp",
                 {"rollout_backend": "deployment"}, backend="deployment", record_logp=False),
    TrainerProbe("deployment_behavior_logp_from_trainer", "deployment-backed rollout, behaviour log-probs recomputed by the trainer", "behavior_logp_source",
                 {"rollout_backend": "deployment", "behavior_logp_source": "trainer"}, backend="deployment"),
    TrainerProbe("stochastic_mask_prepass", "policy with attention dropout 0.1 (mask prepass and loss pass would differ)", "model",
                 model_dropout=0.1),
    TrainerProbe("sequence_level_is", "importance_sampling_level='sequence'", "importance_sampling_level", {"importance_sampling_level": "sequence"}),
    TrainerProbe("rollout_is_correction", "an extra rollout-IS correction (rollout_importance_sampling_mode='token_tis')",
                 "rollout_importance_sampling_mode", {"rollout_importance_sampling_mode": "token_tis"}),
    TrainerProbe("kl_coefficient", "beta=0.01: a KL term on top of M2PO", "beta", {"beta": 0.01}, expected="warned"),
)
PROBE_CASE = TrainerCase(seed=7, prompts=2, group_size=2, prompt_len=2, max_new_tokens=4, lags=(1, 2), staleness_lr=0.02, tau=0.04, split=(4,))


def run_trainer_probe(probe: TrainerProbe, *, dtype: str = "float64", faults: dict[str, bool] | None = None, device: str = "cpu",
                      make_trainer: TrainerFactory | None = None) -> Any:
    """One step of the trainer under ``probe``'s setup; never raises because of the trainer."""
    import warnings

    from m2po_oracle.trainer import M2POKLWarning, TrainerConfig
    from m2po_oracle.validation import ProbeResult

    versions, samplers, rollout = setup_case(PROBE_CASE, dtype=dtype, dropout=probe.model_dropout, device=device, backend=probe.backend,
                                             record_logp=probe.record_logp)
    config = TrainerConfig(**{"tau": PROBE_CASE.tau, "lr": STEP_LR, **probe.config})
    make_trainer = make_trainer or _builtin_trainer(faults)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            make_trainer(versions[-1], config, behaviour=samplers, reference=versions[0]).step(rollout)
        except (Exception, SystemExit) as error:
            return ProbeResult(probe.name, probe.description, "rejected", f"{type(error).__name__}: {error}", probe.expected)
    warned = [w for w in caught if issubclass(w.category, M2POKLWarning)]
    if warned:
        return ProbeResult(probe.name, probe.description, "warned", f"{warned[0].category.__name__}: {warned[0].message}", probe.expected)
    return ProbeResult(probe.name, probe.description, "accepted", "the step ran without an error or a warning", probe.expected)


# --- the runner ---------------------------------------------------------------------------


class TrainerRunner:
    """``compare --impl trainer`` (or ``trainer:CONTROL``): runs cases through the trainer."""

    checks = CHECK_NAMES
    dtypes = tuple(TRAINER_DTYPES)
    example_unit = "steps"
    variant_descriptions = VARIANT_DESCRIPTIONS
    variant_source = "trainer-level deviation (the production PR's support boundary, or a plausible port bug)"

    def __init__(self, control: str | None = None, *, trainer: TrainerFactory | None = None, spec: str | None = None) -> None:
        """Our trainer, one of its controls, or ``trainer``: a factory (e.g. a class) building
        the trainer under test as ``trainer(policy, config, *, behaviour, reference)``."""
        import importlib.util

        if importlib.util.find_spec("transformers") is None:
            raise ValueError("impl: the trainer needs the transformers package: pip install -c constraints.txt -e '.[trainer]'")
        if control is not None and control not in CONTROLS_BY_NAME:
            raise ValueError(f"impl: unknown trainer control {control!r}; known: {', '.join(CONTROLS_BY_NAME)}")
        if control is not None and trainer is not None:
            raise ValueError("impl: a trainer control plants its bug in the built-in trainer; give a control or a trainer, not both")
        if trainer is not None and not callable(trainer):
            raise ValueError(f"impl: the trainer must be a callable (a class or factory), got {type(trainer).__name__}")
        self.control = CONTROLS_BY_NAME[control] if control else None
        self.make_trainer = trainer
        self.spec = spec or (f"trainer:{control}" if control else "trainer")
        self.timeouts = 0

    def strategy(self, tau: float | None) -> st.SearchStrategy[TrainerCase]:
        return trainer_cases(tau)

    def step_battery(self, case: TrainerCase, *, dtype: str = "float64", compute_dtype: str | None = None, device: str = "cpu") -> Any:
        if dtype not in TRAINER_DTYPES:
            raise ValueError(f"dtype: the trainer runs its model in one of {sorted(TRAINER_DTYPES)}, got {dtype!r}")
        try:
            step = run_case(case, dtype=dtype, control=self.control, device=device, make_trainer=self.make_trainer)
        except Exception as error:
            text = "".join(traceback.format_exception(type(error), error, error.__traceback__, limit=-4)).rstrip()
            empty = Batch(np.zeros((1, 1)), np.zeros((1, 1)), np.zeros((1, 1)), np.zeros((1, 1), dtype=bool), case.tau)
            return BatteryOutcome(empty, Measurement(empty, dtype, None, Finding("raised", text)),
                                  (Mismatch("call", f"raised: {text.splitlines()[-1]}", details=(text,)),), case=case.to_dict())
        try:
            mismatches = tuple(check_trainer_step(step))
        except Exception as error:  # a record that passed check_record but still cannot be judged
            text = "".join(traceback.format_exception(type(error), error, error.__traceback__, limit=-4)).rstrip()
            return BatteryOutcome(step.batch, Measurement(step.batch, dtype, None, Finding("wrong_result", text)),
                                  (Mismatch("call", f"the step record could not be checked: {text.splitlines()[-1]}", details=(text,)),),
                                  case=case.to_dict())
        consistent, evidenced = explain(step) if mismatches else (None, None)
        return BatteryOutcome(step.batch, Measurement(step.batch, dtype, _result(step.record)), mismatches, explained_by=consistent,
                              evidenced=evidenced, case={**case.to_dict(), "trainer": _step_summary(step)})

    def replay_command(self, case: TrainerCase, *, dtype: str = "float64", compute_dtype: str | None = None) -> str:
        return shlex.join(["m2po-oracle", "replay", "--impl", self.spec, "--dtype", dtype, "--batch", json.dumps(case.to_dict())])

    def validation_probes(self, *, dtype: str = "float64", device: str = "cpu") -> list[Any]:
        return [run_trainer_probe(p, dtype=dtype, faults=self.control.faults if self.control else None, device=device, make_trainer=self.make_trainer)
                for p in TRAINER_PROBES]

    def parse_input(self, data: dict[str, Any]) -> TrainerCase:
        return TrainerCase.from_dict({k: v for k, v in data.items() if k != "trainer"})


def _step_summary(step: TrainerStep) -> dict[str, Any]:
    r = step.record
    return {"split": list(r.split), "loss": r.loss, "rows": step.rollout.rows, "tokens": int(r.valid.sum()),
            "rewards": [float(x) for x in step.rollout.rewards], "parameters": sum(p.numel() for p in r.params_before.values())}
