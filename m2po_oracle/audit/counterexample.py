"""The worst step's token table: the tokens (or logged values) that show its first failing check."""

from __future__ import annotations

import math
import shlex
from typing import Any

import numpy as np

from m2po_oracle import oracle
from m2po_oracle.audit.reassembly import AuditStep
from m2po_oracle.audit.records import StepAudit
from m2po_oracle.oracle.encoding import number
from m2po_oracle.oracle.record import COUNT_FIELDS, METRIC_FIELDS

#: Which failing check the worst step's table shows: the first of these that failed.
TABLE_ORDER = (
    "audit.selection",
    "audit.behavior_logp",
    "audit.policy_logp",
    "audit.gradient",
    "audit.loss_sum",
    "audit.metrics",
    "audit.parameter_gradient",
    "audit.replicas_identical",
)


#: Rows of the worst step's token table: enough to see the pattern, short enough to read.
COUNTEREXAMPLE_TOKENS = 24


def _largest_first(error: np.ndarray) -> np.ndarray:
    flat = np.flatnonzero(error)
    flat = flat[np.argsort(-error.flat[flat], kind="stable")]
    return np.stack(np.unravel_index(flat, error.shape), axis=1)


def step_counterexample(
    step: AuditStep, audit: StepAudit, directory: str, noted: dict[int, dict[str, Any]], silent_always: set[str]
) -> dict[str, Any]:
    """What shows the worst step's failure: one row per token (``tokens``) or per logged value (``values``)."""
    check = next(name for name in TABLE_ORDER if name in audit.failing)
    batch, s = step.batch, step.selection_batch
    d = oracle.log_ratio(s.logp, s.behavior_logp, s.valid)
    expected_keep, expected = step.algorithm_1["keep"], step.expected
    grad, rollout = np.full(batch.shape, np.nan), np.full(batch.shape, np.nan)
    owner = np.full(batch.shape, -1, dtype=np.int64)  # index into the replica set, -1 on padding
    for index, r in enumerate(step.replica_set):
        if r.grad is not None:
            grad[r.rows, r.columns] = r.grad
        if r.rollout_logp is not None:
            rollout[r.rows, r.columns] = r.rollout_logp
        owner[r.rows, r.columns] = index
    compared: tuple[str, np.ndarray, np.ndarray] | None = None
    values: list[dict[str, Any]] = []
    order = np.zeros((0, 2), dtype=np.int64)
    if check == "audit.selection":
        note = (
            "tokens whose captured keep differs from Algorithm 1's on the whole optimizer batch "
            "(a tie at the cut may fall either way; the check allows it)"
        )
        order = np.argwhere(batch.valid & (step.keep != expected_keep))
    elif check in ("audit.behavior_logp", "audit.policy_logp"):
        if check == "audit.behavior_logp":
            compared = ("behavior_logp against rollout_logp", batch.behavior_logp, rollout)
            note = "the tokens where the behaviour log-probs the loss used differ most from the sampler's"
        else:
            compared = ("logp against selection_logp", batch.logp, s.logp)
            note = "the tokens where the loss pass's log-probs differ most from those the selection saw"
        with np.errstate(invalid="ignore"):
            order = _largest_first(np.where(batch.valid & np.isfinite(compared[2]), np.abs(compared[1] - compared[2]), 0.0))
    elif check in ("audit.gradient", "audit.loss_sum"):
        error = np.where(batch.valid & np.isfinite(grad), np.abs(np.nan_to_num(grad) - expected.grad), 0.0)
        note = "the tokens where the captured gradient differs most from -(1/N) keep exp(d) A with the global N"
        if not np.any(error):
            error = np.where(step.keep & batch.valid, np.abs(expected.grad), 0.0)
            note = "no gradient captured: the kept tokens with the largest terms of the global loss, -(1/N) exp(d) A"
        order = _largest_first(error)
    elif check == "audit.metrics":
        note = "the logged metrics that differ from the optimizer batch's"
        selected = step.selected
        for r in step.records:
            for name in METRIC_FIELDS + COUNT_FIELDS:
                if name in r.metrics and isinstance(r.metrics[name], (int, float)) and not isinstance(r.metrics[name], bool):
                    want = getattr(selected, name)
                    if not math.isclose(float(r.metrics[name]), float(want), rel_tol=1e-9, abs_tol=1e-12):
                        values.append(
                            {"where": r.where, "name": name, "captured": number(float(r.metrics[name])), "expected": number(float(want))}
                        )
    elif check == "audit.parameter_gradient":
        note = "the trainable parameters whose gradient norm is zero (or that have no gradient) on every rank at every recorded step with a gradient"
        for rank, norms in sorted(noted.items()):
            for name, entry in sorted(norms.items()):
                if entry.get("norm") in (None, 0.0) and name in silent_always:
                    values.append({"where": f"rank {rank}", "name": name, "captured": entry.get("norm"), "expected": "a non-zero norm"})
    else:
        note = "the TP replicas differ: the check's summary names the field, rank and element"
    rows = []
    for row, column in (tuple(int(i) for i in at) for at in order[:COUNTEREXAMPLE_TOKENS]):
        record = step.replica_set[owner[row, column]] if owner[row, column] >= 0 else None
        token = {
            "row": row,
            "position": column,
            "rank": record.rank if record else None,
            "micro_batch": record.micro_batch if record else None,
            "d": number(float(d[row, column])),
            "m2": number(float(d[row, column]) ** 2),
            "advantage": number(float(batch.advantages[row, column])),
            "keep": bool(step.keep[row, column]),
            "algorithm_1_keeps": bool(expected_keep[row, column]),
            "grad": number(float(grad[row, column])) if np.isfinite(grad[row, column]) else None,
            "expected_grad": number(float(expected.grad[row, column])),
        }
        if compared is not None:
            token["compared"] = {
                "what": compared[0],
                "captured": number(float(compared[1][row, column])),
                "expected": number(float(compared[2][row, column])),
            }
        rows.append(token)
    found = len(order) if not values else len(values)
    return {
        "check": check,
        "note": note,
        "tokens": rows,
        "values": values[:COUNTEREXAMPLE_TOKENS],
        "shown": len(rows) or len(values[:COUNTEREXAMPLE_TOKENS]),
        "of": int(found),
        "tau": number(float(batch.tau)),
        "valid_count": int(batch.valid.sum()),
        "replay": shlex.join(["m2po-oracle", "audit", directory, "--step", str(step.step)]),
    }
