"""Trainer-level deviations, each reproduced from a failing step's own data."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from m2po_oracle import oracle
from m2po_oracle.explain.step_deviations import described
from m2po_oracle.judge.equivalence import check_selection, compare_values, m2_rounding, same_up_to_ties, tolerance, valid_m2
from m2po_oracle.judge.metric_averaging import METRIC_WEIGHTS, UnweightedMean, unweighted_mean_reproduces
from m2po_oracle.oracle.batch import Batch
from m2po_oracle.trainer.checks import ROLLOUT_LOGP_DTYPE, compare_params, logp_check
from m2po_oracle.trainer.grpo import stochastic_layers
from m2po_oracle.trainer.run import TrainerStep, optimizer_replay


def _micro_rows(split: tuple[int, ...]) -> list[slice]:
    bounds = np.cumsum((0, *split))
    return [slice(int(a), int(b)) for a, b in itertools.pairwise(bounds)]


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
            predicted[r] = cast(np.ndarray, oracle.evaluate_with_mask(_sub(batch, r), keep[r]).grad) / k  # the oracle's grad is set
    correct = oracle.evaluate_with_mask(batch, keep).grad
    tol = tolerance(step.dtype, "gradient")
    close = lambda a, b: compare_values("diagnosis", "grad", a, b, tol, scale=float(np.abs(b).max(initial=0)) * tol.rtol) is None  # noqa: E731
    return close(step.m2po_result.grad, predicted), not close(correct, predicted)


def _test_kept_count_denominator(step: TrainerStep) -> tuple[bool, bool]:
    """The step's loss and gradient are Algorithm 1's on its own mask times N / kept: the
    masked sum divided by the kept valid tokens instead of all N (distinct once a token is masked)."""
    keep, batch = step.record.keep.numpy(), step.batch
    n, kept = int(batch.valid.sum()), int((keep & batch.valid).sum())
    if kept == 0:
        return False, False
    on_mask = oracle.evaluate_with_mask(batch, keep)
    assert on_mask.grad is not None  # the oracle's result always has its gradient
    predicted = on_mask.grad * (n / kept)
    tol = tolerance(step.dtype, "gradient")
    close = lambda a, b: compare_values("diagnosis", "grad", a, b, tol, scale=float(np.abs(b).max(initial=0)) * tol.rtol) is None  # noqa: E731
    return close(step.m2po_result.grad, predicted), not close(on_mask.grad, predicted)


def _test_kl_k1_estimator(step: TrainerStep) -> tuple[bool, bool]:
    """The step's loss and gradient are Algorithm 1's plus beta times k1, mean(logp - ref)
    over N, whose gradient is 1 / N on every valid token."""
    if step.beta == 0:
        return False, False
    batch, beta, n = step.batch, step.beta, max(int(step.batch.valid.sum()), 1)
    m2po = oracle.evaluate_with_mask(batch, step.record.keep.numpy())
    assert m2po.grad is not None  # the oracle's result always has its gradient
    k1 = float(np.where(batch.valid, batch.logp - step.reference_logp, 0.0).sum()) / n
    k1_grad = np.where(batch.valid, 1.0 / n, 0.0)
    tol = tolerance(step.dtype, "gradient")
    close = lambda a, b: compare_values("diagnosis", "grad", a, b, tol, scale=float(np.abs(b).max(initial=0)) * tol.rtol) is None  # noqa: E731
    token_grad = step.record.token_grad.to(torch.float64).numpy()
    loss_tol = tolerance(step.dtype, "loss")
    scale = float(np.abs(m2po.grad).sum()) + beta * float(np.abs(np.where(batch.valid, batch.logp - step.reference_logp, 0.0)).sum()) / n
    same_loss = compare_values("diagnosis", "loss", step.record.loss, m2po.loss + beta * k1, loss_tol, scale=scale) is None
    reproduces = same_loss and close(token_grad, m2po.grad + beta * k1_grad)
    return reproduces, not close(m2po.grad + beta * step.kl[1], m2po.grad + beta * k1_grad)


def _test_current_policy_as_behavior(step: TrainerStep) -> tuple[bool, bool]:
    same = lambda a, b: logp_check("diagnosis", "behavior_logp", a, b, step.batch.valid, ROLLOUT_LOGP_DTYPE) is None  # noqa: E731
    return same(step.batch.behavior_logp, step.current_logp), not same(step.sampler_logp, step.current_logp)


def _test_stochastic_forward(step: TrainerStep) -> tuple[bool, bool]:
    differs = logp_check("diagnosis", "logp", step.batch.logp, step.current_logp, step.batch.valid, step.dtype) is not None
    reproduces = differs and bool(stochastic_layers(step.policy_before))
    return reproduces, reproduces


#: How much looser than the gradient's tolerance an optimizer replay is judged.
REPLAY_SLACK = 10.0


def _test_optimizer_step_per_micro_batch(step: TrainerStep) -> tuple[bool, bool]:
    micro = _micro_rows(step.record.split)  # an empty micro-batch still reaches optimizer.step()
    replayed = optimizer_replay(step, micro)
    # The replay sums and steps in another order than the trainer, and Adam divides each entry
    # by its own magnitude: a rounding-level difference of a near-zero gradient becomes an update
    # difference just past the gradient's tolerance (seen in float32 on ms-swift's trainer). A step
    # per micro-batch differs from one step by orders of magnitude more than this slack.
    same = lambda a, b: compare_params("diagnosis", a, b, step.dtype, "", slack=REPLAY_SLACK) is None  # noqa: E731
    return same(step.record.params_after, replayed), not same(step.one_optimizer_step, replayed)


def _test_parameters_without_gradient(step: TrainerStep) -> tuple[bool, bool]:
    """Some parameters report an all-zero gradient where the pulled-back gradient is not
    zero, and every other parameter's gradient is right."""
    expected, reported = step.pulled_back_gradient, step.record.param_grads
    silent = {n for n, g in reported.items() if not bool(g.any()) and bool(expected[n].any())}
    rest_right = (
        compare_params(
            "diagnosis",
            {n: g for n, g in reported.items() if n not in silent},
            {n: g for n, g in expected.items() if n not in silent},
            step.dtype,
            "",
        )
        is None
    )
    return bool(silent) and rest_right, bool(silent)


def metric_averaging(step: TrainerStep) -> UnweightedMean | None:
    """The step's logged metrics as the unweighted mean over its micro-batches of each one's
    own metrics on the step's mask, where that, and not Algorithm 1's token-weighted value,
    is what was logged and the mask is Algorithm 1's on the optimizer batch; else None."""
    record, batch = step.record, step.batch
    keep = record.keep.numpy()
    if not record.metrics or check_selection(batch, keep, step.dtype):
        return None  # nothing logged, or the mask itself is not Algorithm 1's: no averaging explains it
    rows = _micro_rows(record.split)
    parts = [oracle.evaluate_with_mask(_sub(batch, r), keep[r]) for r in rows]
    tol = tolerance(step.dtype, "metric")
    allowance = m2_rounding(batch, keep & batch.valid, step.dtype)

    def close(name: str, actual: float, expected: float) -> bool:
        return compare_values("diagnosis", name, actual, expected, tol, allowance=allowance.get(name, 0.0)) is None

    # An empty micro-batch logs 0 where the trainer runs it (verl never makes one): the mean over
    # every micro-batch, else over those with rows.
    found = None
    for chosen in (parts, [p for p, r in zip(parts, rows) if r.stop > r.start]):
        counts = [{c: int(getattr(p, c)) for c in set(METRIC_WEIGHTS.values())} for p in chosen]
        values = [{name: float(getattr(p, name)) for name in METRIC_WEIGHTS} for p in chosen]
        found = unweighted_mean_reproduces(record.metrics, values, counts, close) if chosen else None
        if found is not None:
            break
    return found


def _test_unweighted_micro_batch_metric_mean(step: TrainerStep) -> tuple[bool, bool]:
    """The logged metrics are the unweighted mean of the micro-batches' own values on a right
    mask, and not Algorithm 1's (distinct: some logged value differs from the weighted one)."""
    found = metric_averaging(step) is not None
    return found, found


@dataclass(frozen=True)
class TrainerVariant:
    name: str
    description: str
    test: Callable[[TrainerStep], tuple[bool, bool]]


_TESTS: dict[str, Callable[[TrainerStep], tuple[bool, bool]]] = {
    "kept_count_denominator": _test_kept_count_denominator,
    "per_micro_batch_mask": _test_per_micro_batch_mask,
    "per_micro_batch_denominator": _test_per_micro_batch_denominator,
    "current_policy_as_behavior": _test_current_policy_as_behavior,
    "stochastic_forward": _test_stochastic_forward,
    "optimizer_step_per_micro_batch": _test_optimizer_step_per_micro_batch,
    "parameters_without_gradient": _test_parameters_without_gradient,
    "kl_k1_estimator": _test_kl_k1_estimator,
    "unweighted_micro_batch_metric_mean": _test_unweighted_micro_batch_metric_mean,
}
#: The trainer's names, in the registry's order (:mod:`m2po_oracle.explain.step_deviations`), each with its test.
TRAINER_VARIANTS: tuple[TrainerVariant, ...] = tuple(
    TrainerVariant(name, description, _TESTS[name]) for name, description in described("trainer").items()
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
