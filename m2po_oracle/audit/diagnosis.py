"""Diagnosis of a failing step: each name is tested against the files, never fitted to them
(:data:`~m2po_oracle.audit.records.DESCRIPTIONS`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from m2po_oracle import oracle
from m2po_oracle.audit.checks import (
    REGION_METRICS,
    LogpBounds,
    grad_mismatch_at,
    logged_globally,
    logged_scopes,
    logp_mismatch,
    logp_pairs,
    loss_mismatch_at,
    micro_batch_metrics,
)
from m2po_oracle.audit.reassembly import AuditStep, scope_groups
from m2po_oracle.audit.records import MicroBatch, StepAudit
from m2po_oracle.judge import equivalence
from m2po_oracle.judge.metric_averaging import NAME as METRIC_AVERAGING
from m2po_oracle.oracle.batch import Batch


def _share(record: MicroBatch, denominator: float) -> tuple[float, np.ndarray]:
    """The record's loss and d loss / d logp on its own keep, divided by ``denominator``."""
    own = oracle.evaluate_with_mask(record.batch(), record.keep)
    assert own.valid_count is not None and own.grad is not None  # the oracle's result has every field
    factor = own.valid_count / denominator if denominator else 0.0
    return own.loss * factor, own.grad * factor


def _shares_match(step: AuditStep, denominator: Callable[[MicroBatch], float]) -> bool:
    """Every record's loss (and gradient, where captured) is its share with ``denominator(record)``."""
    for record in step.replica_set:
        loss, grad = _share(record, denominator(record))
        if loss_mismatch_at(record.loss, loss, record.batch(), grad, step.dtype, "diagnosis") is not None:
            return False
        if record.grad is not None:
            largest = float(np.max(np.abs(grad))) if grad.size else 0.0
            if grad_mismatch_at(record.grad, grad, record.batch(), step.dtype, "diagnosis", "grad", largest) is not None:
                return False
    return True


def _group_selects_alone(step: AuditStep, group: list[MicroBatch]) -> bool:
    """The records of ``group`` (one region of the optimizer batch) kept what Algorithm 1 keeps on that region alone."""
    if len(group) == 1 and step.topology.cp > 1:  # one CP shard: its own columns
        r = group[0]
        alone = r.batch(r.logp if r.selection_logp is None else r.selection_logp)
        return not equivalence.check_selection(alone, r.keep, step.dtype)
    # Otherwise the group holds every CP shard of its rows: whole rows of the assembled batch.
    alone, keep = step.rows_alone(group)
    return not equivalence.check_selection(alone, keep, step.dtype)


def _denominators(step: AuditStep) -> dict[str, Callable[[MicroBatch], float]]:
    """The global N and each denominator deviation's divisor per record, in the order ties are resolved."""
    n = float(step.batch.valid.sum())
    kept = float((step.keep & step.batch.valid).sum())
    block_n = {key: float(step.batch.valid[rows].sum()) for key, rows in step.blocks.items()}
    cp_n = {c: float(sum(r.mask.sum() for r in step.replica_set if r.coords.cp == c)) for c in range(step.topology.cp)}
    # The global N first: a deviation whose divisor is N on every record (equal micro-batch
    # counts make k times a micro-batch's count N) is the correct denominator on this step.
    out: dict[str, Callable[[MicroBatch], float]] = {"global": lambda r: n}
    if any(k > 1 for k in step.micro_batches.values()):
        out["per_micro_batch_denominator"] = lambda r: step.micro_batches[r.coords.dp] * block_n[(r.coords.dp, r.micro_batch)]
    out["local_denominator"] = lambda r: float(r.mask.sum())
    if step.topology.cp > 1:
        out["cp_shard_counts"] = lambda r: cp_n[r.coords.cp]
        out["dp_cp_group_double_count"] = lambda r: step.topology.cp * n
    out["kept_count_denominator"] = lambda r: kept
    return out


def _distinct(
    step: AuditStep, candidates: dict[str, Callable[[MicroBatch], float]]
) -> tuple[dict[str, Callable[[MicroBatch], float]], dict[str, list[str]]]:
    """The candidates whose divisors differ from every earlier one's on some record, and for
    each the later ones the files cannot tell from it (equal divisors on every record)."""
    first_of: dict[tuple[float, ...], str] = {}
    out: dict[str, Callable[[MicroBatch], float]] = {}
    twins: dict[str, list[str]] = {}
    for name, fn in candidates.items():
        values = tuple(fn(r) for r in step.replica_set)
        if values in first_of:
            twins.setdefault(first_of[values], []).append(name)
            continue
        first_of[values] = name
        out[name] = fn
    return out, twins


def _logged_count(step: AuditStep, fn: Callable[[MicroBatch], float]) -> bool:
    """Every logged ``valid_count`` is ``fn``'s divisor for its record, and not the batch's N:
    a denominator's evidence on a step whose loss cannot show it (nothing kept, or A = 0)."""
    n = int(step.batch.valid.sum())
    twin = {(r.coords.dp, r.coords.cp, r.micro_batch): r for r in step.replica_set}
    logged = [
        (r.metrics["valid_count"], fn(twin[(r.coords.dp, r.coords.cp, r.micro_batch)])) for r in step.records if "valid_count" in r.metrics
    ]
    return bool(logged) and all(value == want for value, want in logged) and any(value != n for value, _ in logged)


#: A selection scope's names by what the loss divides by (the keys are ``scope_groups``'):
#: the global N, the scope's own region's valid count, or another denominator named beside a
#: name that says nothing of N. A scope's name never claims a denominator the loss contradicts.
SCOPE_NAMES: dict[str, tuple[str, str | None, str]] = {
    "per_micro_batch_mask": ("per_micro_batch_mask", None, "per_micro_batch_mask"),
    "per_rank_selection_global_n": ("per_rank_selection_global_n", "per_rank_selection_local_n", "per_rank_selection"),
    "per_cp_shard": ("per_cp_chunk_selection_global_n", "local_shard_selection", "per_cp_chunk_selection"),
}


def _own_count(step: AuditStep, scope: str) -> Callable[[MicroBatch], float] | None:
    """The divisor of a port whose scope divides by its region's own valid count (None: no such name)."""
    if scope == "per_rank_selection_global_n":
        rank_n = {dp: float(sum(r.mask.sum() for r in step.replica_set if r.coords.dp == dp)) for dp in step.micro_batches}
        return lambda r: rank_n[r.coords.dp]
    if scope == "per_cp_shard":
        return lambda r: float(r.mask.sum())
    return None


def _metrics_show(step: AuditStep, scope: str) -> bool:
    """The logged M2 and fractions are the scope's regions' own, and not the optimizer batch's."""
    names = [name for name in REGION_METRICS if any(name in r.metrics for r in step.records)]
    try:
        return bool(names) and not logged_globally(step, names) and scope in logged_scopes(step)
    except (TypeError, ValueError):  # a logged value that is not a number: audit.metrics says so
        return False


def diagnose_audit_step(
    step: AuditStep,
    failing: set[str],
    noted: dict[int, dict[str, Any]],
    alternatives: dict[str, list[str]],
    bounds: LogpBounds = LogpBounds(),
) -> list[str]:
    """The deviations the files reproduce; ``alternatives`` gets, per name, the others that
    reproduce this step identically (the files cannot tell them apart)."""
    found: list[str] = []
    denominator = None
    candidates, twins = _distinct(step, _denominators(step))
    matching: list[str] = []
    # A denominator is named only where the loss and the gradient reproduce it and not the
    # global N: a logged valid_count is a number a port may log per micro-batch or per rank
    # whatever it divides by (audit.metrics says what it is), never evidence against them.
    global_n = not failing & {"audit.loss_sum", "audit.gradient"} or _shares_match(step, candidates["global"])
    if not global_n:
        matching = [name for name, fn in candidates.items() if name != "global" and _shares_match(step, fn)]
        if len(matching) > 1:
            # Records without kept terms fit any divisor: a logged valid_count may choose among
            # the divisors the loss and the gradient cannot tell apart, never beyond them.
            matching = [name for name in matching if _logged_count(step, candidates[name])] or matching
    if matching:
        denominator = matching[0]
        same = twins.get(denominator, []) + matching[1:]
        if same:
            alternatives[denominator] = same
    groups = scope_groups(step)
    own = {scope: fn for scope in groups if (fn := _own_count(step, scope)) is not None}
    # Scopes whose name would also explain the loss: the loss and the gradient reproduce the
    # region's own count (one name for the mask and the denominator together beats two).
    own_n = [] if global_n else [scope for scope, fn in own.items() if _shares_match(step, fn)]
    if "audit.selection" in failing:
        # A scope is named where the mask is not Algorithm 1's on the optimizer batch and is the
        # scope's: where the mask is a global outcome, per-region metrics are audit.metrics' finding.
        scopes = [scope for scope, g in groups.items() if all(_group_selects_alone(step, group) for group in g)]
        if scopes and denominator == "dp_cp_group_double_count" and _doubled_selection(step):
            scopes = []  # the doubled multiset's selection: the double count explains the mask too
        if scopes:
            scope, form = next(((s, 1) for s in scopes if s in own_n), (scopes[0], 0 if global_n else 2))
            name = SCOPE_NAMES[scope][form]
            assert name is not None  # form 1 is taken for a scope in own_n only: one with its own count, and a name for it
            found.append(name)
            if form == 1:
                alternatives.pop(cast(str, denominator), None)  # the scope's own count: in its name (None is no key: nothing popped)
                denominator = None
            # The other scopes that reproduce the mask, in the same form (with the loss's own count only where it is theirs).
            others = [SCOPE_NAMES[s][form] for s in scopes if s != scope and SCOPE_NAMES[s][form] and (form != 1 or s in own_n)]
            if others:
                alternatives.setdefault(name, []).extend(cast("list[str]", others))  # the names are filtered on being set
    elif own_n:
        # The mask is a global outcome and each region's own: the global selection with the
        # region's count, and the scope dividing by its own count, reproduce the step alike. The
        # only one that reproduces the loss is named; between two, the logged M2 and fractions
        # (each region's own, or the optimizer batch's) choose, never beyond them.
        tied = [scope for scope in own_n if all(_group_selects_alone(step, group) for group in groups[scope])]
        tied.sort(key=lambda scope: not _metrics_show(step, scope))
        if tied:
            scope_name = SCOPE_NAMES[tied[0]][1]
            assert scope_name is not None  # tied is of own_n: scopes with their own count, each named
            if denominator is None or _metrics_show(step, tied[0]):
                found.append(scope_name)
                same = cast("list[str]", [SCOPE_NAMES[scope][1] for scope in tied[1:]])  # as above: each named
                if denominator is not None:
                    same = [denominator, *alternatives.pop(denominator, []), *same]
                if same:
                    alternatives[scope_name] = same
                denominator = None
            else:
                alternatives.setdefault(denominator, []).extend(cast(str, SCOPE_NAMES[scope][1]) for scope in tied)  # as above: each named
    if denominator is not None:
        found.append(denominator)
    if "audit.behavior_logp" in failing and _behaviour_is_the_policy(step):
        found.append("current_policy_as_behavior")
    if "audit.policy_logp" in failing:
        found += _forward_deviation(step, bounds)
    if "audit.parameter_gradient" in failing:
        found.append("parameters_without_gradient")
    if "audit.metrics" in failing and micro_batch_metrics(step) is not None:
        found.append(METRIC_AVERAGING)  # the averaging of right values: never a selection or mask name
    return found


def _doubled_selection(step: AuditStep) -> bool:
    """The joined mask is an outcome of Algorithm 1 on the batch with every token counted cp times."""
    s, cp = step.selection_batch, step.topology.cp
    doubled = Batch(*(np.concatenate([a] * cp) for a in (s.logp, s.behavior_logp, s.advantages, s.valid)), s.tau)  # type: ignore[call-arg, arg-type]  # mypy: an unpacked iterable of unknown length may fill every parameter (it holds four here)
    return not equivalence.check_selection(doubled, np.concatenate([step.keep] * cp), step.dtype)


def _behaviour_is_the_policy(step: AuditStep) -> bool:
    """The behaviour log-probs equal the policy's (the selection's forward) on every record, and not the sampler's."""
    with_rollout = [r for r in step.replica_set if r.rollout_logp is not None]
    return bool(with_rollout) and all(
        logp_mismatch(
            "diagnosis", "behavior_logp", r.behavior_logp, r.logp if r.selection_logp is None else r.selection_logp, r.mask, step.dtype
        )
        is None
        for r in with_rollout
    )


def _forward_deviation(step: AuditStep, bounds: LogpBounds) -> list[str]:
    records = [r for r in step.replica_set if r.selection_logp is not None and r.mask.any()]
    found, _, _ = logp_pairs(
        "diagnosis", records, "logp", lambda r: (r.logp, cast(np.ndarray, r.selection_logp)), step.dtype, bounds.policy, "--policy-atol"
    )  # records with one
    differs = {(r.coords.dp, r.coords.cp, r.micro_batch): id(r) in found for r in records}
    if not differs:
        return []
    first = [v for (dp, cp, mb), v in differs.items() if mb == 0]
    later = [v for (dp, cp, mb), v in differs.items() if mb > 0]
    if first and later and not any(first) and all(later):
        return ["optimizer_step_per_micro_batch"]
    if all(differs.values()):
        return ["stochastic_forward"]
    return []


def implied_divisors(step: AuditStep) -> tuple[float | None, list[float | None]]:
    """The divisor the recorded losses imply, for the step and for each micro-batch of one
    replica set: Algorithm 1's terms on the run's own mask summed (N times the oracle's loss,
    or a micro-batch's share of it, each token's gradient being its term over N) over the
    recorded loss. None where the recorded loss is 0 or either is not finite."""
    expected, n = step.expected, step.expected.valid_count

    def divisor(terms: float, recorded: float) -> float | None:
        value = terms / recorded if recorded and math.isfinite(recorded) and math.isfinite(terms) else None
        return value if value is None or math.isfinite(value) else None

    total = math.fsum(r.loss for r in step.replica_set)
    shares = [divisor(n * math.fsum(expected.grad[r.rows][:, r.columns][r.mask].tolist()), r.loss) for r in step.replica_set]
    return divisor(n * expected.loss, total), shares


def observations(step: AuditStep, audit: StepAudit) -> list[str]:
    """What a divergent step's files show beyond the names: that no known deviation explains
    it, and, when the loss sum fails, the divisor the recorded losses imply against N."""
    out = []
    if not audit.diagnosis:
        out.append(f"no known deviation explains it (failing: {', '.join(audit.failing)})")
    if METRIC_AVERAGING in audit.diagnosis:
        averaged = micro_batch_metrics(step)
        if averaged is not None:
            out.append(f"finding: {averaged.summary()}")
    if "audit.loss_sum" in audit.failing:
        whole, shares = implied_divisors(step)
        n = step.expected.valid_count
        if whole is not None:
            known = [d for d in shares if d is not None]
            alike = len(known) == len(shares) > 1 and all(math.isclose(d, known[0], rel_tol=1e-6) for d in known)
            parts = (
                f"; every micro-batch implies {known[0]:.6g}"
                if alike
                else (f"; per micro-batch: {', '.join('-' if d is None else f'{d:.6g}' for d in shares)}" if len(shares) > 1 else "")
            )
            out.append(
                f"the recorded losses imply a divisor of {whole:.6g} ({whole / n:.6g} x N) where Algorithm 1 divides by "
                f"N = {n}, the step's valid tokens{parts}"
            )
    return out
