"""The JSON report (schema ``m2po-oracle/compare/1``): built once, rendered to HTML from it.

Every value that comes from the implementation (names, exception text) is stored as
plain data here and escaped only by the renderer. Non-finite numbers are written as the
strings "nan", "inf" and "-inf" so the file stays standard JSON.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from m2po_oracle import oracle
from m2po_oracle.oracle.batch import Batch
from m2po_oracle.judge.equivalence import TOLERANCES, Mismatch, selection_bounds
from m2po_oracle.oracle.record import COUNT_FIELDS, METRIC_FIELDS, M2POResult, number

SCHEMA = "m2po-oracle/compare/1"
#: Counterexamples are shrunk and small; a fallback batch is cut to this many tokens.
MAX_TOKENS = 512


def mismatch_json(m: Mismatch) -> dict[str, Any]:
    return {"check": m.check, "summary": m.summary, "field": m.field, "index": list(m.index) if m.index is not None else None,
            "actual": number(m.actual), "expected": number(m.expected), "details": list(m.details)}


def tolerances_json() -> list[dict[str, Any]]:
    return [{"dtype": dtype, "quantity": quantity, "rtol": tol.rtol, "atol": tol.atol} for (dtype, quantity), tol in TOLERANCES.items()]


def _fields(result: M2POResult | None) -> dict[str, Any]:
    if result is None:
        return {}
    out = {"loss": number(result.loss)}
    out.update({name: number(getattr(result, name)) for name in METRIC_FIELDS + COUNT_FIELDS if getattr(result, name) is not None})
    return out


def counterexample_json(check: str, batch: Batch, actual: M2POResult | None, mismatches: tuple[Mismatch, ...], replay: str, compute_dtype: str) -> dict[str, Any]:
    """One minimal counterexample with its token table and M2 removal curve.

    ``batch`` is what the implementation received. Per token: ``expected_keep`` is
    Algorithm 1's (literal loop), ``expected_grad`` the analytic gradient on the
    implementation's own mask (what the gradient check compares), ``actual_*`` the
    implementation's.
    """
    algorithm = oracle.m2po(batch)
    on_actual_mask = oracle.evaluate_with_mask(batch, actual.keep) if actual is not None else None
    d = oracle.log_ratio(batch.logp, batch.behavior_logp, batch.valid)
    m2 = oracle.second_moment(d)
    trust = oracle.trust_region(d, batch.advantages, batch.valid)
    tokens = []
    for flat, index in enumerate(np.ndindex(*batch.shape)):
        if flat >= MAX_TOKENS:
            break
        tokens.append({
            "index": list(index),
            "valid": bool(batch.valid[index]),
            "log_ratio": number(d[index]) if batch.valid[index] else None,
            "advantage": number(batch.advantages[index]),
            "m2": number(m2[index]) if batch.valid[index] else None,
            "trust_region": bool(trust[index]),
            "expected_keep": bool(algorithm.keep[index]),
            "actual_keep": bool(actual.keep[index]) if actual is not None else None,
            "expected_grad": number(on_actual_mask.grad[index]) if on_actual_mask is not None else number(algorithm.grad[index]),
            "actual_grad": number(actual.grad[index]) if actual is not None and actual.grad is not None else None,
        })
    bounds = selection_bounds(batch, compute_dtype)
    implementation_kept = int((actual.keep & trust).sum()) if actual is not None else None
    return {
        "check": check,
        "summary": mismatches[0].summary if mismatches else "",
        "replay": replay,
        "batch": batch.to_dict(),
        "shape": list(batch.shape),
        "tokens": tokens,
        "tokens_truncated": batch.logp.size > MAX_TOKENS,
        "mismatches": [mismatch_json(m) for m in mismatches],
        "expected": _fields(algorithm),
        "expected_on_actual_mask": _fields(on_actual_mask),
        "actual": _fields(actual),
        "removal_curve": {
            "tau": batch.tau,
            "prefix_means": [number(v) for v in bounds.prefix_means[:MAX_TOKENS]],
            "candidates": int(bounds.order.size),
            "oracle_kept_min": bounds.k_min,
            "oracle_kept_max": bounds.k_max,
            "implementation_kept": implementation_kept,
        },
    }
