"""The checks of one reassembled step, each a pass, fail or not run with a self-sufficient
summary; and the comparisons they share with the diagnosis."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from m2po_oracle import oracle
from m2po_oracle.audit.reassembly import AuditStep, algorithm_1_of, scope_groups
from m2po_oracle.audit.records import ROLLOUT_LOGP_DTYPE, AuditCheck, MicroBatch
from m2po_oracle.capture import reader
from m2po_oracle.judge import equivalence
from m2po_oracle.judge.metric_averaging import METRIC_WEIGHTS, UnweightedMean, unweighted_mean_reproduces
from m2po_oracle.oracle.batch import Batch
from m2po_oracle.oracle.record import COUNT_FIELDS, METRIC_FIELDS


def _fmt(mismatches: list[equivalence.Mismatch]) -> str:
    def one(m: equivalence.Mismatch) -> str:
        text = m.summary if m.check.startswith("audit.") else f"[{m.check}] {m.summary}"
        if m.field and m.actual is not None and m.expected is not None and not m.check.startswith("selection."):
            at = f" at index {m.index}" if m.index is not None else ""
            text += f": actual {m.actual!r}, expected {m.expected!r}{at}"
        return text + (f" ({m.details[0]})" if m.details else "")

    text = "; ".join(one(m) for m in mismatches[:3])
    return text + (f"; and {len(mismatches) - 3} more" if len(mismatches) > 3 else "")


def loss_mismatch_at(
    actual: float, expected: float, batch: Batch, grad: np.ndarray, dtype: str, check: str, name: str = "loss"
) -> equivalence.Mismatch | None:
    allowance = equivalence.exp_rounding(batch, grad, dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        scale = float(np.sum(np.abs(grad)))
    return equivalence.compare_values(
        check, name, actual, expected, equivalence.tolerance(dtype, "loss"), scale=scale, allowance=float(np.sum(allowance))
    )


def grad_mismatch_at(
    actual: np.ndarray, expected: np.ndarray, batch: Batch, dtype: str, check: str, name: str, largest: float
) -> equivalence.Mismatch | None:
    tol = equivalence.tolerance(dtype, "gradient")
    return equivalence.compare_values(
        check, name, actual, expected, tol, scale=largest * tol.rtol, allowance=equivalence.exp_rounding(batch, expected, dtype)
    )


def logp_mismatch(
    check: str, what: str, actual: np.ndarray, expected: np.ndarray, valid: np.ndarray, dtype: str
) -> equivalence.Mismatch | None:
    # Log-probs are O(1): scale 1 keeps near-zero log-probs from demanding relative precision.
    return equivalence.compare_values(
        check, what, np.where(valid, actual, 0.0), np.where(valid, expected, 0.0), equivalence.tolerance(dtype, "metric"), scale=1.0
    )


def replicas_check(step: AuditStep) -> AuditCheck:
    if step.topology.tp == 1:
        return AuditCheck("audit.replicas_identical", "not run", "no TP replicas (tp = 1)")
    first = {(r.coords.dp, r.coords.cp, r.micro_batch): r for r in step.replica_set}
    found = []
    for record in step.records:
        if record.coords.tp == 0:
            continue
        twin = first[(record.coords.dp, record.coords.cp, record.micro_batch)]
        for name in ("logp", "behavior_logp", "advantages", "mask", "keep", "selection_logp", "rollout_logp", "grad"):
            mine, theirs = getattr(record, name), getattr(twin, name)
            if (mine is None) != (theirs is None):
                found.append(
                    f"{record.where}: {name} is {'missing' if mine is None else 'recorded'} while its TP rank 0 (rank {twin.rank}) "
                    f"{'records' if mine is None else 'lacks'} it"
                )
            elif mine is not None and mine.shape != theirs.shape:
                found.append(f"{record.where}: {name} has shape {list(mine.shape)}, its TP rank 0 (rank {twin.rank}) {list(theirs.shape)}")
            elif mine is not None and not np.array_equal(mine, theirs, equal_nan=mine.dtype != bool):
                differ = np.argwhere(~((mine == theirs) | (np.isnan(mine) & np.isnan(theirs)) if mine.dtype != bool else mine == theirs))
                at = tuple(int(i) for i in differ[0])
                found.append(
                    f"{record.where}: {name}{list(at)} is {mine[at].item()!r}, its TP rank 0 (rank {twin.rank}) has {theirs[at].item()!r} "
                    f"({len(differ)} element(s) differ)"
                )
        if not (record.loss == twin.loss or (math.isnan(record.loss) and math.isnan(twin.loss))):
            found.append(f"{record.where}: loss {record.loss!r}, its TP rank 0 (rank {twin.rank}) {twin.loss!r}")
    if found:
        return AuditCheck(
            "audit.replicas_identical", "fail", "; ".join(found[:3]) + (f"; and {len(found) - 3} more" if len(found) > 3 else "")
        )
    return AuditCheck(
        "audit.replicas_identical", "pass", f"the {step.topology.tp} TP replicas of each of {len(step.replica_set)} records are identical"
    )


def selection_check(step: AuditStep) -> AuditCheck:
    batch = step.selection_batch
    found = equivalence.check_selection(batch, step.keep, step.dtype)
    if found:
        return AuditCheck("audit.selection", "fail", _fmt(found))
    on = "the selection's log-probs" if any(r.selection_logp is not None for r in step.replica_set) else "logp"
    return AuditCheck(
        "audit.selection",
        "pass",
        f"the assembled keep ({int((step.keep & batch.valid).sum())} of {int(batch.valid.sum())} "
        f"valid tokens kept) is an outcome of Algorithm 1 on the optimizer batch ({on})",
    )


@dataclass(frozen=True)
class LogpBounds:
    """How far two recordings of log-probs may differ per valid token (None: equal at the dtype's
    precision). ``rollout``: the behaviour log-probs against the sampler's, for a trainer that
    recomputes them under the sampler's weights with other kernels; ``policy``: the loss pass
    against the selection's prepass, for nondeterministic kernels (bf16 atomics)."""

    rollout: float | None = None
    policy: float | None = None


def logp_pairs(
    check: str,
    records: list[MicroBatch],
    what: str,
    pair: Callable[[MicroBatch], tuple[np.ndarray, np.ndarray]],
    dtype: str,
    atol: float | None,
    flag: str,
) -> tuple[dict[int, equivalence.Mismatch], str, float]:
    """Per record whose two log-prob recordings differ (by ``id``), the mismatch; the precision
    judged at; the largest difference on valid tokens."""
    with np.errstate(invalid="ignore"):
        gaps = {id(r): float(np.max(np.abs(np.subtract(*pair(r))), where=r.mask, initial=0.0)) for r in records}
    largest = max(gaps.values(), default=0.0)
    if atol is None:
        found = {id(r): m for r in records if (m := logp_mismatch(check, f"{what} of {r.where}", *pair(r), r.mask, dtype))}
        return found, f"{dtype} precision", largest
    # The user states how far they may go: kernels and precision differ between the two.
    found = {
        id(r): equivalence.Mismatch(check, f"{what} of {r.where} differs by up to {gaps[id(r)]!r} > {atol!r}")
        for r in records
        if not gaps[id(r)] <= atol
    }
    return found, f"|difference| <= {flag} {atol!r}", largest


def _logp_agreement_check(
    step: AuditStep,
    check: str,
    records: list[MicroBatch],
    missing: str,
    what: str,
    pair: Callable[[MicroBatch], tuple[np.ndarray, np.ndarray]],
    dtype: str,
    atol: float | None,
    flag: str,
    claim: tuple[str, str],
) -> AuditCheck:
    """``claim`` (what passing says, what failing says) judged on every record that holds the pair."""
    if not records:
        return AuditCheck(check, "not run", missing)
    found, precision, largest = logp_pairs(check, records, what, pair, dtype, atol, flag)
    judged = f"({precision}; largest |difference| {largest!r})"
    if found:
        return AuditCheck(check, "fail", f"{len(found)} of {len(records)} records: {claim[1]} {judged}: " + _fmt(list(found.values())))
    return AuditCheck(check, "pass", f"in {len(records)} records {claim[0]} {judged}")


def policy_logp_check(step: AuditStep, bounds: LogpBounds) -> AuditCheck:
    return _logp_agreement_check(
        step,
        "audit.policy_logp",
        [r for r in step.replica_set if r.selection_logp is not None],
        "no selection_logp recorded: the selection is taken to have seen logp",
        "logp against its selection_logp",
        lambda r: (r.logp, cast(np.ndarray, r.selection_logp)),
        step.dtype,
        bounds.policy,
        "--policy-atol",  # records with one
        ("the loss pass's log-probs equal the selection's", "the loss pass's log-probs are not the selection's"),
    )


def behavior_logp_check(step: AuditStep, bounds: LogpBounds) -> AuditCheck:
    return _logp_agreement_check(
        step,
        "audit.behavior_logp",
        [r for r in step.replica_set if r.rollout_logp is not None],
        "no rollout_logp recorded: nothing to check the behaviour log-probs against",
        "behavior_logp against the sampler's rollout_logp",
        lambda r: (r.behavior_logp, cast(np.ndarray, r.rollout_logp)),  # records with one
        equivalence.coarser(step.dtype, ROLLOUT_LOGP_DTYPE),
        bounds.rollout,
        "--rollout-atol",
        ("the behaviour log-probs equal the sampler's", "the behaviour log-probs are not the sampler's"),
    )


def loss_check(step: AuditStep, expected: Any) -> AuditCheck:
    total = math.fsum(r.loss for r in step.replica_set)
    found = loss_mismatch_at(total, expected.loss, step.batch, expected.grad, step.dtype, "audit.loss_sum")
    if found:
        return AuditCheck("audit.loss_sum", "fail", _fmt([found]))
    return AuditCheck(
        "audit.loss_sum",
        "pass",
        f"the {len(step.replica_set)} captured losses of one replica set add up to {total!r}, "
        f"the global loss {expected.loss!r} (N = {expected.valid_count})",
    )


def gradient_check(step: AuditStep, expected: Any) -> AuditCheck:
    with_grad = [r for r in step.replica_set if r.grad is not None]
    if not with_grad:
        return AuditCheck("audit.gradient", "not run", "no gradient was captured at this step (watch_gradient or record(grad=))")
    largest = float(np.max(np.abs(expected.grad))) if expected.grad.size else 0.0
    found = [
        m
        for r in with_grad
        if (
            m := grad_mismatch_at(
                cast(np.ndarray, r.grad),
                expected.grad[r.rows][:, r.columns],
                r.batch(),
                step.dtype,
                "audit.gradient",
                f"grad of {r.where}",
                largest,
            )
        )
    ]
    if found:
        return AuditCheck("audit.gradient", "fail", _fmt(found))
    return AuditCheck(
        "audit.gradient",
        "pass",
        f"{len(with_grad)} of {len(step.replica_set)} record gradients captured, each equals "
        f"-(1/N) keep exp(d) A with the global N = {expected.valid_count}",
    )


def metrics_check(step: AuditStep, expected: Any) -> AuditCheck:
    tol = equivalence.tolerance(step.dtype, "metric")
    allowance = equivalence.m2_rounding(step.selection_batch, expected.keep, step.dtype)
    found, compared = [], set()
    for r in step.records:
        for name in METRIC_FIELDS + COUNT_FIELDS:
            if name not in r.metrics:
                continue
            compared.add(name)
            value, want = r.metrics[name], getattr(expected, name)
            logged_as = f" (logged as {r.metric_sources[name]})" if name in r.metric_sources else ""
            where = f"{name}{logged_as} of {r.where}"
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                found.append(equivalence.Mismatch("audit.metrics", f"{where}: {value!r} is not a number"))
            elif name in COUNT_FIELDS:
                if value != want:
                    found.append(equivalence.Mismatch("audit.metrics", f"{where}: {value!r} differs from the optimizer batch's {want}"))
            else:
                m = equivalence.compare_values("audit.metrics", where, value, want, tol, allowance=allowance.get(name, 0.0))
                if m:
                    found.append(m)
    if not compared:
        return AuditCheck(
            "audit.metrics",
            "not run",
            "no captured metric is named like ours (m2_before, m2_after, masked_fraction, ...) or under a name ports log them by "
            "(m2po/masked_fraction, M2, m2po_m2_after, ...)",
        )
    if found:
        said = _logged_as(step, compared)
        return AuditCheck("audit.metrics", "fail", "".join(f"{what}; " for what in said) + _fmt(found))
    read = sorted({f"{name} as {r.metric_sources[name]}" for r in step.records for name in compared if name in r.metric_sources})
    return AuditCheck(
        "audit.metrics",
        "pass",
        f"{', '.join(sorted(compared))} equal the optimizer batch's in every record" + (f" (read {', '.join(read)})" if read else ""),
    )


#: Logged M2 and fractions, judged per region: a port may log them per micro-batch and still
#: divide by (and log) the optimizer batch's N.
REGION_METRICS = ("m2_before", "m2_after", "masked_fraction")


#: How audit.metrics says a region's own metrics: scope -> (whose, logged how).
REGION_WORDS = {
    "per_cp_shard": ("each CP shard's own", "per CP shard"),
    "per_micro_batch_mask": ("each micro-batch's own", "per micro-batch"),
    "per_rank_selection_global_n": ("each DP rank's own", "per DP rank"),
}


def micro_batch_metrics(step: AuditStep) -> UnweightedMean | None:
    """Where every record logs its own micro-batch's metrics on the step's mask (Algorithm 1's
    on the optimizer batch), and their mean with equal weight per micro-batch, which a trainer
    averaging its micro-batches' logs (verl 0.9.1) logs, is not Algorithm 1's token-weighted
    value: the two means, per metric. Else None (CP shards: not judged)."""
    records = step.replica_set
    names = [name for name in METRIC_WEIGHTS if any(name in r.metrics for r in step.records)]
    if step.topology.cp > 1 or not names or not records:
        return None
    if equivalence.check_selection(step.selection_batch, step.keep, step.dtype):
        return None  # the mask itself is not Algorithm 1's: no averaging explains the metrics
    tol = equivalence.tolerance(step.dtype, "metric")
    allowance = equivalence.m2_rounding(step.selection_batch, step.keep, step.dtype)

    def close(name: str, actual: float, expected: float) -> bool:
        return equivalence.compare_values("diagnosis", name, actual, expected, tol, allowance=allowance.get(name, 0.0)) is None

    parts = [oracle.evaluate_with_mask(r.batch(r.logp if r.selection_logp is None else r.selection_logp), r.keep) for r in records]
    for r, own in zip(records, parts):
        for name in names:
            value = r.metrics.get(name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not close(name, float(value), getattr(own, name)):
                return None  # a record that does not log its own micro-batch's value
    values = [{name: float(getattr(own, name)) for name in names} for own in parts]
    counts = [{count: int(getattr(own, count)) for count in set(METRIC_WEIGHTS.values())} for own in parts]
    logged = {name: math.fsum(float(r.metrics[name]) for r in records) / len(records) for name in names}
    return unweighted_mean_reproduces(logged, values, counts, close)


def _logged_as(step: AuditStep, compared: set[str]) -> list[str]:
    """What logged metrics that are not the optimizer batch's are instead, where the files show it:
    each region's own M2 (Algorithm 1 on a micro-batch, DP rank or CP shard alone) and a
    valid_count of another scope. A statement about the logs, never a diagnosis of the loss."""
    said = []
    n = int(step.batch.valid.sum())
    counts = [
        (r, r.metrics["valid_count"])
        for r in step.records
        if isinstance(r.metrics.get("valid_count"), (int, float)) and not isinstance(r.metrics["valid_count"], bool)
    ]
    if counts and any(value != n for _, value in counts):
        for words, count in _count_scopes(step):
            if all(value == count(r) for r, value in counts):
                said.append(f"every logged valid_count is {words}, not the optimizer batch's N = {n}")
                break
    names = [name for name in REGION_METRICS if name in compared]
    averaged = micro_batch_metrics(step)
    if averaged is not None:  # each record's own micro-batch's values on the right mask, not a selection of its own
        said.append(
            f"every record logs its own micro-batch's {', '.join(m.name for m in averaged.differing + averaged.agreeing)} on the "
            "optimizer batch's mask: averaged with equal weight per micro-batch (as verl logs them) "
            f"{', '.join(m.name for m in averaged.differing)} are not Algorithm 1's token-weighted values (the step's finding "
            "gives both)"
        )
        return said
    scopes = logged_scopes(step) if names and not logged_globally(step, names) else []
    if scopes:
        whose, how = REGION_WORDS[scopes[0]]
        said.append(f"{', '.join(names)} are {whose} (Algorithm 1 on it alone): metrics logged {how}")
    return said


def _count_scopes(step: AuditStep) -> list[tuple[str, Callable[[MicroBatch], int]]]:
    """The valid counts a port may log instead of N, each said as what it is, narrowest first."""
    cp = step.topology.cp
    block_n = {key: int(step.batch.valid[rows].sum()) for key, rows in step.blocks.items()}
    rank_n = {dp: sum(block_n[(dp, mb)] for mb in range(k)) for dp, k in step.micro_batches.items()}
    out: list[tuple[str, Callable[[MicroBatch], int]]] = [
        (f"its record's own valid count (logged per micro-batch{' and CP shard' if cp > 1 else ''})", lambda r: int(r.mask.sum()))
    ]
    if cp > 1:
        out.append(
            ("its micro-batch's valid count over every CP shard (logged per micro-batch)", lambda r: block_n[(r.coords.dp, r.micro_batch)])
        )
    out.append(("its DP rank's valid count (logged per DP rank)", lambda r: rank_n[r.coords.dp]))
    if cp > 1:
        out.append((f"{cp} x N (every token counted once per CP replica)", lambda r: cp * int(step.batch.valid.sum())))
    return out


def _close(step: AuditStep, logged: Any, want: Any) -> bool:
    return equivalence.compare_values("diagnosis", "metric", logged, want, equivalence.tolerance(step.dtype, "metric")) is None


def logged_globally(step: AuditStep, names: list[str]) -> bool:
    selected = step.selected
    return all(_close(step, r.metrics[name], getattr(selected, name)) for r in step.records for name in names if name in r.metrics)


def logged_scopes(step: AuditStep) -> list[str]:
    """The scopes whose regions, each run through Algorithm 1 alone, give every record's logged
    M2 and fractions (a port that selects per micro-batch logs per-micro-batch M2, also on a
    step where its masks happen to agree with the optimizer batch's). The narrowest region
    first: a CP shard's metrics can equal its DP rank's by chance (the other shard all padding),
    not the reverse."""
    groups_by_scope = scope_groups(step)
    matching = []
    for scope in sorted(groups_by_scope, key=lambda name: name != "per_cp_shard"):
        verdicts: list[bool] = []
        places: set[tuple[int, ...]]  # (dp, cp, micro-batch) of a CP shard, else (dp, micro-batch)
        for group in groups_by_scope[scope]:
            if scope == "per_cp_shard":
                r = group[0]
                alone = algorithm_1_of(r.batch(r.logp if r.selection_logp is None else r.selection_logp))
                places = {(r.coords.dp, r.coords.cp, r.micro_batch)}
                logged = [t for t in step.records if (t.coords.dp, t.coords.cp, t.micro_batch) in places]
            else:
                alone = algorithm_1_of(step.rows_alone(group)[0])
                places = {(r.coords.dp, r.micro_batch) for r in group}
                logged = [t for t in step.records if (t.coords.dp, t.micro_batch) in places]
            verdicts += [_close(step, t.metrics[name], alone[name]) for t in logged for name in REGION_METRICS if name in t.metrics]
        if verdicts and all(verdicts):
            matching.append(scope)
    return matching


def always_silent_parameters(capture: reader.Capture) -> tuple[set[str], int]:
    """The parameters with no or an all-zero gradient at every recorded step where some parameter
    has one, and the number of such steps.

    One step is not evidence: a parameter's gradient can be exactly zero at one step for good
    reasons (an attention query or key projection when every position attends to one key).
    A freeze or a detach on the wrong tensor silences it at every step. All the capture's
    steps count, not only the audited ones (``--step``): the norms are in the manifests.
    """
    silent: set[str] | None = None
    steps = 0
    for step in capture.steps():
        noted = capture.parameter_gradients(step)
        norms: dict[str, list[Any]] = {}
        for by_name in noted.values():
            for name, entry in by_name.items():
                norms.setdefault(name, []).append(entry.get("norm"))
        if not any(n not in (None, 0.0) for values in norms.values() for n in values):
            continue  # no gradient at all this step (nothing kept, or advantages all zero)
        steps += 1
        here = {name for name, values in norms.items() if all(n in (None, 0.0) for n in values)}
        silent = here if silent is None else silent & here
    return silent or set(), steps


def parameter_check(noted: dict[int, dict[str, Any]], expected: Any, silent_always: set[str], steps_with_gradient: int) -> AuditCheck:
    if not noted:
        return AuditCheck(
            "audit.parameter_gradient", "not run", "no rank noted its parameters' gradient norms (record_parameter_gradients)"
        )
    names = sorted({name for norms in noted.values() for name in norms})
    if not np.any(expected.grad):
        return AuditCheck(
            "audit.parameter_gradient",
            "pass",
            f"{len(names)} parameters noted; the loss's gradient is zero at this step, so no parameter needs one",
        )
    silent_here = [
        name for name in names if all((norms.get(name) or {}).get("norm") in (None, 0.0) for norms in noted.values() if name in norms)
    ]
    frozen = [name for name in silent_here if name in silent_always]
    if frozen:
        none = [n for n in frozen if all((noted[r].get(n) or {}).get("norm") is None for r in noted if n in noted[r])]
        shown = ", ".join(f"{n} ({'no gradient' if n in none else 'all zero'})" for n in frozen[:5])
        more = f" and {len(frozen) - 5} more" if len(frozen) > 5 else ""
        return AuditCheck(
            "audit.parameter_gradient",
            "fail",
            f"{len(frozen)} of {len(names)} trainable parameters have no or an all-zero "
            f"gradient on every rank at every one of the {steps_with_gradient} recorded step(s) with a gradient: {shown}{more}",
        )
    passing = f"all {len(names)} trainable parameters noted by {len(noted)} rank(s) have a gradient"
    if silent_here:
        passing = (
            f"{len(names) - len(silent_here)} of {len(names)} trainable parameters have a gradient; {', '.join(silent_here[:3])}"
            f"{' and more' if len(silent_here) > 3 else ''} are all zero at this step but not at every step (a gradient can be "
            f"exactly zero at one step, e.g. attention with one key)"
        )
    return AuditCheck("audit.parameter_gradient", "pass", passing)
