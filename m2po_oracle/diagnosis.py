"""Diagnosis: which known deviation explains an implementation's behaviour.

Each variant computes its own mask, loss, gradient and metrics from the batch alone; it
is never fitted to the implementation's output. A variant *reproduces* an example when
its mask equals the implementation's up to a choice among equal M2 values, and its
objective on that mask (the tie choice is the only thing taken from the implementation)
matches the loss, gradient and every reported metric within the tolerance table.
Behavioural deviations (input mutation, nondeterminism, padding leaks) are recognised
by the check that shows them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from m2po_oracle import variants
from m2po_oracle.batch import Batch
from m2po_oracle.deviations import VARIANTS, Variant
from m2po_oracle.equivalence import compare_values, same_up_to_ties, tolerance
from m2po_oracle.record import COUNT_FIELDS, METRIC_FIELDS, M2POResult


@dataclass(frozen=True)
class Observation:
    """One call's evidence: the batch as the implementation received it and its result."""

    batch: Batch
    result: M2POResult


def first_difference(v: Variant, observation: Observation, dtype: str) -> str | None:
    """None if ``v`` reproduces the observation, else what differs first."""
    batch, actual = observation.batch, observation.result
    dev = v.deviation
    keep = variants.select(batch, dev)
    d = variants.selection_log_ratio(variants.log_ratio(batch, dev), dev)
    if not same_up_to_ties(keep, actual.keep, np.where(batch.valid, d * d, np.nan)):
        index = tuple(int(i) for i in np.argwhere(keep != actual.keep)[0])
        return f"keep differs at {index}: variant {bool(keep[index])}, implementation {bool(actual.keep[index])}"
    expected = variants.evaluate_with_mask(batch, actual.keep, dev)
    comparisons = [("loss", actual.loss, expected.loss, tolerance(dtype, "loss"), float(np.sum(np.abs(expected.grad))))]
    if actual.grad is not None:
        grad_tol = tolerance(dtype, "gradient")
        comparisons.append(("grad", actual.grad, expected.grad, grad_tol, float(np.max(np.abs(expected.grad), initial=0.0)) * grad_tol.rtol))
    for name in METRIC_FIELDS:
        if getattr(actual, name) is not None:
            comparisons.append((name, getattr(actual, name), getattr(expected, name), tolerance(dtype, "metric"), 0.0))
    for field, got, want, tol, scale in comparisons:
        mismatch = compare_values("diagnosis", field, got, want, tol, scale)
        if mismatch is not None:
            at = f" at {mismatch.index}" if mismatch.index is not None else ""
            return f"{field}{at}: variant {mismatch.expected!r}, implementation {mismatch.actual!r}"
    for name in COUNT_FIELDS:
        if getattr(actual, name) is not None and getattr(actual, name) != getattr(expected, name):
            return f"{name}: variant {getattr(expected, name)}, implementation {getattr(actual, name)}"
    return None


def diagnose(observations: Iterable[Observation], failed_checks: Iterable[str], *, dtype: str, divergent: bool) -> dict[str, Any]:
    """The diagnosis section of the report (schema in ``report``)."""
    observations = list(observations)
    failed = set(failed_checks)
    if not divergent:
        return {"status": "not_needed", "examples_compared": len(observations), "matches": [], "closest": []}
    # Without an observation whose values diverge from Algorithm 1, any output variant that
    # coincides with Algorithm 1 on these batches would "match": only behaviour is diagnosed.
    matches, closest = [], []
    for v in VARIANTS:
        if v.name == "algorithm_1":
            continue
        if v.is_behavioural:
            if v.behaviour_check in failed:
                matches.append(_entry(v, evidence=f"check {v.behaviour_check} failed"))
            continue
        if not observations:
            continue
        agreed, difference = 0, None
        for observation in observations:
            difference = first_difference(v, observation, dtype)
            if difference is not None:
                break
            agreed += 1
        if difference is None:
            matches.append(_entry(v, evidence=f"reproduces all {len(observations)} examples"))
        else:
            closest.append({**_entry(v), "agreed": agreed, "of": len(observations), "first_difference": difference})
    closest.sort(key=lambda c: -c["agreed"])
    status = "matched" if matches else "no_known_variant"
    return {"status": status, "examples_compared": len(observations), "matches": matches, "closest": closest[:3]}


def _entry(v: Variant, evidence: str = "") -> dict[str, Any]:
    out = {"variant": v.name, "description": v.description, "source": v.source}
    if evidence:
        out["evidence"] = evidence
    return out
