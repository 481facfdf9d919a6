"""Running one case through a trainer, with the snapshots the checks and the diagnosis need."""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from m2po_oracle import oracle
from m2po_oracle.oracle.batch import Batch
from m2po_oracle.oracle.record import COUNT_FIELDS, METRIC_FIELDS, M2POResult
from m2po_oracle.strategies import cut_budget
from m2po_oracle.trainer.cases import TrainerCase
from m2po_oracle.trainer.controls import TrainerControl
from m2po_oracle.trainer.grpo import (
    GRPOTrainer,
    M2POKLWarning,
    TrainerConfig,
    TrainerFaults,
    behaviour_logp_of,
    group_advantages,
    make_policy_versions,
    sample_rollout,
    token_logp,
)

#: The trainer's model dtypes (``--dtype``).
TRAINER_DTYPES = {"float64": torch.float64, "float32": torch.float32}
#: Learning rate of the step under test (the staleness lr is part of the case).
STEP_LR = 1e-2


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
    beta: float = 0.0  # the KL coefficient the step ran with
    reference: Any = None  # a copy of the KL reference model (eval mode; beta != 0 only)
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
    def reference_logp(self) -> np.ndarray:
        """The rollout's tokens under the KL reference model, deterministically."""
        return _recomputed_logp(self.reference, self.rollout)

    @functools.cached_property
    def kl(self) -> tuple[float, np.ndarray]:
        """(KL, d KL / d logp) of the loss pass's log-probs against the reference: the k3
        estimator, over the optimizer batch's valid tokens and N; (0, zeros) when beta == 0."""
        if self.beta == 0:
            return 0.0, np.zeros(self.batch.shape)
        return k3_kl(self.batch.logp, self.reference_logp, self.batch.valid)

    @functools.cached_property
    def expected_on_mask(self) -> M2POResult:
        """What the record must hold on its own mask: Algorithm 1's loss and gradient plus
        ``beta`` times the KL term's (``beta * KL`` is part of the loss the step minimises)."""
        expected = oracle.evaluate_with_mask(self.batch, self.record.keep.numpy())
        if self.beta == 0:
            return expected
        value, grad = self.kl
        assert expected.grad is not None  # the oracle's result always has its gradient
        return replace(expected, loss=expected.loss + self.beta * value, grad=expected.grad + self.beta * grad)

    @functools.cached_property
    def reported(self) -> M2POResult:
        """The record as the value checks judge it against :attr:`expected_on_mask`: with a
        KL term, its whole loss (adding the expected KL to the expectation, rather than
        subtracting it from the record, keeps the record's own rounding out of the check)."""
        result = result_of_step(self.record)
        return result if self.beta == 0 else replace(result, loss=float(self.record.loss))

    @functools.cached_property
    def m2po_result(self) -> M2POResult:
        """The record's M2PO part, for the diagnosis: its loss and d loss / d logp less the
        expected ``beta * KL`` and its gradient."""
        if self.beta == 0:
            return result_of_step(self.record)
        value, grad = self.kl
        result = result_of_step(self.record)
        assert result.grad is not None  # result_of_step sets the record's token gradient
        return replace(result, loss=self.record.loss - self.beta * value, grad=result.grad - self.beta * grad)

    @functools.cached_property
    def pulled_back_gradient(self) -> dict[str, torch.Tensor]:
        """Algorithm 1's per-token gradient on the trainer's mask, plus ``beta`` times the KL
        term's, pulled back through the snapshot."""
        token_grad = self.expected_on_mask.grad
        assert token_grad is not None  # the oracle's, on the record's mask
        return _pullback(copy.deepcopy(self.policy_before), self.rollout, token_grad)

    @functools.cached_property
    def one_optimizer_step(self) -> dict[str, torch.Tensor]:
        """The parameters after one step of the trainer's optimizer with the reported gradient."""
        return optimizer_replay(self)


#: How a trainer under test is built: ``make_trainer(policy, config, *, behaviour, reference)``
#: returns an object with ``step(rollout, split) -> StepRecord`` and ``make_optimizer(params)``
#: (``trainer.GRPOTrainer`` is one; a class with that constructor is another).
TrainerFactory = Callable[..., Any]


def builtin_trainer(faults: dict[str, Any] | None) -> TrainerFactory:
    planted = TrainerFaults(**(faults or {}))
    return lambda policy, config, **options: GRPOTrainer(policy, config, faults=planted, **options)


def setup_case(
    case: TrainerCase, *, dtype: str = "float64", dropout: float = 0.0, device: str = "cpu", backend: str = "hf", record_logp: bool = True
) -> tuple[list[Any], list[Any], Any]:
    """(policy versions oldest first, the sampling worker per prompt, the rollout) of ``case``."""
    if dtype not in TRAINER_DTYPES:
        raise ValueError(f"dtype: the trainer runs its model in one of {sorted(TRAINER_DTYPES)}, got {dtype!r}")
    versions = make_policy_versions(
        case.seed, steps=max(case.lags), lr=case.staleness_lr, dtype=TRAINER_DTYPES[dtype], dropout=dropout, device=device
    )
    samplers = [
        versions[-1 - lag] if lag else copy.deepcopy(versions[-1]) for lag in case.lags
    ]  # a lag-0 worker holds a copy of the weights
    rollout = sample_rollout(
        samplers,
        prompts=case.prompts,
        group_size=case.group_size,
        prompt_len=case.prompt_len,
        max_new_tokens=case.max_new_tokens,
        seed=case.seed,
        backend=backend,
        record_logp=record_logp,
    )
    return versions, samplers, rollout


def run_case(
    case: TrainerCase,
    *,
    dtype: str = "float64",
    control: TrainerControl | None = None,
    device: str = "cpu",
    make_trainer: TrainerFactory | None = None,
    recorder: Any = None,
    step_index: int | None = None,
    beta: float = 0.0,
) -> TrainerStep:
    """``case`` through the trainer (ours, with ``control``'s faults, or ``make_trainer``'s),
    with KL coefficient ``beta`` (a control's own, when it has one).

    With ``recorder`` (an ``m2po_oracle.capture.Recorder``; the built-in trainer only) the
    step is recorded as optimizer step ``step_index`` (``GRPOTrainer.step``); the same step
    rerun as one micro-batch, the reference of ``trainer.accumulation``, is not."""
    beta = control.beta if control is not None and control.beta else beta
    make_trainer = make_trainer or builtin_trainer(control.faults if control else None)
    versions, samplers, rollout = setup_case(case, dtype=dtype, dropout=control.model_dropout if control else 0.0, device=device)
    policy = versions[-1]
    policy_before = copy.deepcopy(policy).eval()
    config = TrainerConfig(
        tau=case.tau if case.cut is None else tau_cutting_inside(case.cut, policy_before, rollout), lr=STEP_LR, beta=beta
    )
    single_policy = copy.deepcopy(policy) if len(case.split) > 1 else None
    reference = copy.deepcopy(versions[0]).eval() if beta else None
    trainer = make_trainer(policy, config, behaviour=samplers, reference=versions[0])
    # The run asked for the KL term: trainer.kl_term judges it, the warning would only repeat per step.
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore", M2POKLWarning)
        torch.manual_seed(case.seed)
        recording = {"recorder": recorder, "step_index": step_index} if recorder is not None else {}
        record = check_record(trainer.step(rollout, case.split, **recording), rollout, policy_before)
        single = None
        if single_policy is not None:
            single = check_record(
                make_trainer(single_policy, config, behaviour=samplers, reference=versions[0]).step(rollout), rollout, policy_before
            )
    return TrainerStep(case, dtype, trainer, rollout, samplers, policy_before, record, single, beta=float(beta), reference=reference)


def k3_kl(logp: np.ndarray, reference_logp: np.ndarray, valid: np.ndarray) -> tuple[float, np.ndarray]:
    """(KL, d KL / d logp) in float64: the k3 estimator TRL's GRPOTrainer uses,
    ``exp(ref - logp) - (ref - logp) - 1`` per valid token, summed and divided by N (the
    valid tokens of the optimizer batch, as M2PO's own term); its gradient is
    ``(1 - exp(ref - logp)) / N`` on valid tokens and 0 on padding."""
    n = max(int(valid.sum()), 1)
    delta = np.where(valid, np.asarray(reference_logp, dtype=np.float64) - np.asarray(logp, dtype=np.float64), 0.0)
    per_token = np.exp(delta) - delta - 1.0
    return float(per_token.sum() / n), np.where(valid, (1.0 - np.exp(delta)) / n, 0.0)


def tau_cutting_inside(cut: int, policy: Any, rollout: Any) -> float:
    """The budget at which Algorithm 1 removes ``cut`` of the step's trust-region tokens
    (at most all but one), computed as the trainer's mask prepass sees the step: the
    policy's deterministic log-probs, the recorded behaviour log-probs, GRPO advantages."""
    logp = _recomputed_logp(policy, rollout)
    valid = rollout.valid.cpu().numpy()
    d = oracle.log_ratio(logp, rollout.behavior_logp.to(torch.float64).cpu().numpy(), valid)
    advantages = (
        group_advantages(rollout.rewards, rollout.group_size)[:, None].expand(rollout.rows, logp.shape[1]).to(torch.float64).cpu().numpy()
    )
    tau = cut_budget(d, advantages, valid, cut)
    return 0.04 if tau is None else tau  # nothing to cut inside: the default budget


#: What a step record must hold, by field: (kind, shape rule).
_RECORD_TENSORS = ("logp", "behavior_logp", "advantages", "valid", "keep", "token_grad")


def check_record(record: Any, rollout: Any, policy: Any) -> Any:
    """``record`` if it is a complete step record for ``rollout``; TypeError/ValueError naming
    the field otherwise (a trainer under test may return anything)."""
    shape = tuple(rollout.completion_ids.shape)
    for name in (*_RECORD_TENSORS, "loss", "metrics", "param_grads", "params_after", "split", "tau", "kl_term"):
        if not hasattr(record, name):
            raise TypeError(
                f"step record: expected a trainer.StepRecord (or an object with its fields); {type(record).__name__} has no {name!r}"
            )
    for name in _RECORD_TENSORS:
        value = getattr(record, name)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape or value.device.type != "cpu":
            got = (
                f"{type(value).__name__} of shape {tuple(value.shape)} on {value.device}"
                if isinstance(value, torch.Tensor)
                else type(value).__name__
            )
            raise ValueError(f"step record: {name}: expected a CPU tensor of shape {shape} (the rollout's), got {got}")
    for name in ("valid", "keep"):
        if getattr(record, name).dtype != torch.bool:
            raise ValueError(f"step record: {name}: expected dtype torch.bool, got {getattr(record, name).dtype}")
    params = dict(policy.named_parameters())
    for name in ("param_grads", "params_after"):
        value = getattr(record, name)
        if not isinstance(value, dict) or set(value) != set(params):
            raise ValueError(
                f"step record: {name}: expected a dict with every parameter name of the policy ({len(params)}), got "
                f"{sorted(value)[:5] if isinstance(value, dict) else type(value).__name__}"
            )
        for key, tensor in value.items():
            if not isinstance(tensor, torch.Tensor) or tensor.shape != params[key].shape:
                raise ValueError(f"step record: {name}[{key!r}]: expected a tensor of shape {tuple(params[key].shape)}")
    for name in ("loss", "tau", "kl_term"):
        if isinstance(getattr(record, name), bool) or not isinstance(getattr(record, name), (int, float)):
            raise TypeError(f"step record: {name}: expected a Python number, got {type(getattr(record, name)).__name__}")
    split = record.split
    if (
        not isinstance(split, (tuple, list))
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in split)
        or sum(split) != shape[0]
    ):
        raise ValueError(f"step record: split: expected non-negative row counts summing to {shape[0]}, got {split!r}")
    if not isinstance(record.metrics, dict) or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in record.metrics.values()):
        raise TypeError(f"step record: metrics: expected a dict of Python numbers, got {record.metrics!r}"[:300])
    return record


def result_of_step(record: Any) -> M2POResult:
    metrics = {name: record.metrics[name] for name in METRIC_FIELDS + COUNT_FIELDS if name in record.metrics}
    return M2POResult(
        loss=record.loss - record.kl_term,
        keep=record.keep.numpy().copy(),
        grad=record.token_grad.to(torch.float64).numpy().copy(),
        **metrics,
    )


def _recomputed_logp(models: Any, rollout: Any) -> np.ndarray:
    """Log-probs of the rollout's tokens under ``models`` (one, or one per prompt), deterministically."""
    return behaviour_logp_of(models, rollout).to(torch.float64).cpu().numpy()


def _pullback(model: Any, rollout: Any, token_grad: np.ndarray, rows: slice | None = None) -> dict[str, torch.Tensor]:
    """Parameter gradients of sum(token_grad * logp) through a deterministic forward of ``model``."""
    rows = rows or slice(0, rollout.rows)
    params = dict(model.named_parameters())
    if rows.stop == rows.start:
        return {n: torch.zeros_like(p, device="cpu") for n, p in params.items()}
    logp = token_logp(model.eval(), rollout.prompt_ids[rows], rollout.completion_ids[rows])
    weights = torch.tensor(token_grad[rows], dtype=logp.dtype, device=logp.device)
    grads = torch.autograd.grad(logp, list(params.values()), grad_outputs=weights, allow_unused=True)
    return {n: (g if g is not None else torch.zeros_like(p)).detach().cpu() for (n, p), g in zip(params.items(), grads)}


def optimizer_replay(step: TrainerStep, micro_batches: list[slice] | None = None) -> dict[str, torch.Tensor]:
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
