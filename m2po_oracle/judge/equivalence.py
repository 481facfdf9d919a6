"""Equivalence semantics: when an implementation's output counts as Algorithm 1's.

Selection. ``keep`` is correct if Algorithm 1 can produce it:
  * invalid tokens are never kept, valid tokens outside the trust region always are;
  * the kept candidates are the k smallest by M2, where tokens whose M2 differ by no more
    than the rounding of the compute dtype count as ties at the cut (any choice allowed);
  * k lies in [k_min, k_max]: the prefix-mean decision ``P_k <= tau`` may go either way
    only where P_k is within the rounding band of tau for the compute dtype. A decision
    whose terms, prefix sums, prefix mean and tau are all exactly representable in the
    compute dtype is decided exactly (dyadic cases such as d = 0.25, tau = 0.0625).
Loss, gradient and metrics are compared with the oracle evaluated on the mask the
implementation chose, under one tolerance table keyed by (dtype, quantity).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property

import numpy as np

from m2po_oracle import oracle
from m2po_oracle.oracle.batch import Batch
from m2po_oracle.oracle.record import COUNT_FIELDS, METRIC_FIELDS, M2POResult


@dataclass(frozen=True)
class FloatFormat:
    precision_bits: int  # significand bits, implicit bit included
    min_exponent: int  # smallest normal exponent (value = m * 2**e, 0.5 <= m < 1 in frexp terms)
    max_exponent: int

    @property
    def unit_roundoff(self) -> float:
        return 2.0**-self.precision_bits


FORMATS: dict[str, FloatFormat] = {
    "float64": FloatFormat(53, -1021, 1024),
    "float32": FloatFormat(24, -125, 128),
    "bfloat16": FloatFormat(8, -125, 128),
    "float16": FloatFormat(11, -13, 16),
}


@dataclass(frozen=True)
class Tolerance:
    """``|actual - expected| <= atol + rtol * max(|expected|, scale)``; both always given."""

    rtol: float
    atol: float


QUANTITIES = ("loss", "gradient", "metric")

#: The one tolerance table, keyed by (input dtype, quantity). ``scale`` for the loss is the
#: mean absolute kept term (losses of group-normalised batches cancel towards 0), for the
#: gradient a small fraction of the largest expected magnitude.
TOLERANCES: dict[tuple[str, str], Tolerance] = {
    ("float64", "loss"): Tolerance(rtol=1e-10, atol=1e-300),
    ("float64", "gradient"): Tolerance(rtol=1e-10, atol=1e-300),
    ("float64", "metric"): Tolerance(rtol=1e-10, atol=1e-300),
    ("float32", "loss"): Tolerance(rtol=1e-4, atol=1e-30),
    ("float32", "gradient"): Tolerance(rtol=1e-5, atol=1e-30),
    ("float32", "metric"): Tolerance(rtol=1e-4, atol=1e-30),
    ("bfloat16", "loss"): Tolerance(rtol=2e-2, atol=1e-30),
    ("bfloat16", "gradient"): Tolerance(rtol=2e-2, atol=1e-30),
    ("bfloat16", "metric"): Tolerance(rtol=2e-2, atol=1e-30),
    # float16 results underflow below its smallest subnormal 2**-24: a true gradient of
    # 3e-8 is legitimately returned as 0 by autograd in float16.
    ("float16", "loss"): Tolerance(rtol=5e-3, atol=2.0**-24),
    ("float16", "gradient"): Tolerance(rtol=5e-3, atol=2.0**-24),
    ("float16", "metric"): Tolerance(rtol=5e-3, atol=2.0**-24),
}


def tolerance(dtype: str, quantity: str) -> Tolerance:
    try:
        return TOLERANCES[(dtype, quantity)]
    except KeyError:
        raise ValueError(
            f"tolerance: no entry for dtype {dtype!r} and quantity {quantity!r}; dtypes {sorted(FORMATS)}, quantities {QUANTITIES}"
        ) from None


@dataclass(frozen=True)
class Mismatch:
    """One violated property. ``check`` names the property (e.g. ``selection.minimal``)."""

    check: str
    summary: str
    field: str = ""
    index: tuple[int, ...] | None = None
    actual: object = None
    expected: object = None
    details: tuple[str, ...] = dataclasses.field(default_factory=tuple)


# --- selection ---------------------------------------------------------------------------


def representable(value: float, fmt: FloatFormat) -> bool:
    """True if ``value`` (a float64) is exactly a normal number or zero of ``fmt``."""
    if value == 0.0:
        return True
    if not math.isfinite(value):
        return False
    mantissa, exponent = math.frexp(value)
    if not fmt.min_exponent <= exponent <= fmt.max_exponent:
        return False
    scaled = mantissa * 2.0**fmt.precision_bits
    return scaled == int(scaled)


def _exact_decision(sorted_d: np.ndarray, k: int, tau: float, fmt: FloatFormat) -> bool | None:
    """``P_k <= tau`` decided exactly if every quantity is representable in ``fmt``, else None."""
    if not representable(tau, fmt):
        return None
    total = Fraction(0)
    for d in sorted_d[:k]:
        if not representable(float(d), fmt):
            return None
        square = Fraction(float(d)) ** 2
        if not representable(float(square), fmt) or Fraction(float(square)) != square:
            return None
        total += square
        if not representable(float(total), fmt) or Fraction(float(total)) != total:
            return None
    mean = total / k
    if Fraction(float(mean)) != mean or not representable(float(mean), fmt):
        return None
    return mean <= Fraction(tau)


@dataclass(frozen=True)
class SelectionBounds:
    """The outcomes Algorithm 1 can produce for one batch and compute dtype."""

    sorted_m2: np.ndarray
    prefix_means: np.ndarray
    band: np.ndarray  # rounding band of each prefix-mean decision
    k_min: int  # fewest candidates Algorithm 1 may keep
    k_max: int  # most candidates Algorithm 1 may keep
    tie_rtol: float
    m2: np.ndarray = dataclasses.field(repr=False)  # every token's M2 (0 on padding)
    trust: np.ndarray = dataclasses.field(repr=False)  # the candidates

    @cached_property
    def order(self) -> np.ndarray:
        """Flat candidate indices, M2 ascending (ties by descending index): computed on first
        use only, since a full index sort of millions of candidates costs seconds and the
        checks need the sorted values alone."""
        return oracle.sorted_candidates(self.m2, self.trust)


_EXACT_CHECK_LIMIT = 20_000  # candidates; beyond this an ambiguous decision stays ambiguous


def selection_bounds(batch: Batch, compute_dtype: str = "float64") -> SelectionBounds:
    d = oracle.log_ratio(batch.logp, batch.behavior_logp, batch.valid)
    return _selection_bounds(batch, d, oracle.trust_region(d, batch.advantages, batch.valid), compute_dtype)


def _selection_bounds(batch: Batch, d: np.ndarray, trust: np.ndarray, compute_dtype: str) -> SelectionBounds:
    fmt = FORMATS[compute_dtype]
    u = fmt.unit_roundoff
    m2 = oracle.second_moment(d)
    sorted_m2 = np.sort(m2[trust])  # = m2.ravel()[order]: equal values are equal whatever their order
    means = oracle.prefix_means(sorted_m2)
    # Rounding of d, of d^2, of a k-term sum and of the division, with a factor 2 to spare,
    # plus the rounding of tau itself; in float64 this is ~1e-16 * k relative. Computed as
    # 2.0 * (k + 3) * u * |P_k| + 2.0 * u * tau, operation by operation, in place.
    band = np.multiply(2.0, np.arange(4, means.size + 4))
    band *= u
    band *= np.abs(means)
    band += 2.0 * u * batch.tau
    tau = batch.tau
    with np.errstate(invalid="ignore"):
        keep_clear = means <= tau - band
        remove_clear = means > tau + band
    ambiguous = np.flatnonzero(~keep_clear & ~remove_clear)
    if 0 < ambiguous.size <= 16 and means.size <= _EXACT_CHECK_LIMIT:
        sorted_d = d.ravel()[oracle.sorted_candidates(m2, trust)]
        for i in ambiguous:
            decided = _exact_decision(sorted_d, int(i) + 1, tau, fmt)
            if decided is not None:
                keep_clear[i], remove_clear[i] = decided, not decided
    k_min = int(np.argmin(keep_clear)) if not keep_clear.all() else int(means.size)
    k_max = int(np.argmax(remove_clear)) if remove_clear.any() else int(means.size)
    return SelectionBounds(
        sorted_m2, means, band, k_min, max(k_min, k_max), tie_rtol=4.0 * u if compute_dtype != "float64" else 0.0, m2=m2, trust=trust
    )


def _index(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(flat, shape))


def check_selection(batch: Batch, keep: np.ndarray, compute_dtype: str = "float64") -> list[Mismatch]:
    """Every way ``keep`` fails to be an outcome of Algorithm 1 (empty list: admissible)."""
    valid = batch.valid
    d = oracle.log_ratio(batch.logp, batch.behavior_logp, valid)
    trust = oracle.trust_region(d, batch.advantages, valid)
    found: list[Mismatch] = []
    kept_padding = keep & ~valid
    if kept_padding.any():
        found.append(
            _count_mismatch("selection.keep_only_valid", "padding tokens kept (keep True where mask is False)", kept_padding, keep, valid)
        )
    masked_outside = valid & ~trust & ~keep
    if masked_outside.any():
        found.append(
            _count_mismatch(
                "selection.only_trust_region_masked", "tokens outside the trust region were masked", masked_outside, keep, valid
            )
        )

    bounds = _selection_bounds(batch, d, trust, compute_dtype)
    # The candidates in flat index order; no index sort is needed: the properties below
    # depend on the M2 values alone, and "first in M2 order among equal values" is the
    # highest flat index (sorted_candidates' tie order).
    candidate_index = np.flatnonzero(trust)
    candidate_m2 = bounds.m2.ravel()[candidate_index]
    kept_flat = keep.ravel()[candidate_index]
    kept_count = int(np.count_nonzero(kept_flat))
    candidates = int(candidate_index.size)
    if kept_count > bounds.k_max:
        mean_kept = float(np.mean(np.sort(candidate_m2[kept_flat]))) if kept_count else 0.0  # in M2 order, as summed before
        found.append(
            Mismatch(
                "selection.budget",
                f"kept {kept_count} of {candidates} trust-region tokens; Algorithm 1 keeps at most {bounds.k_max}: "
                f"the mean M2 of the kept trust-region tokens is {mean_kept!r} > tau {batch.tau!r}",
                field="kept trust-region tokens",
                actual=kept_count,
                expected=_range(bounds),
            )
        )
    elif kept_count < bounds.k_min:
        next_mean = float(bounds.prefix_means[kept_count])
        found.append(
            Mismatch(
                "selection.minimal",
                f"kept {kept_count} of {candidates} trust-region tokens; Algorithm 1 keeps at least {bounds.k_min}: "
                f"keeping the next-smallest removed token gives mean M2 {next_mean!r} <= tau {batch.tau!r}",
                field="kept trust-region tokens",
                actual=kept_count,
                expected=_range(bounds),
            )
        )
    if 0 < kept_count < candidates:
        kept_m2 = candidate_m2[kept_flat]
        removed_m2 = candidate_m2[~kept_flat]
        if kept_m2.max() > removed_m2.min() * (1.0 + bounds.tie_rtol):
            # The first largest kept and the first smallest removed in M2 order: among equal
            # values, the highest index.
            kept_at = candidate_index[kept_flat][np.flatnonzero(kept_m2 == kept_m2.max())[-1]]
            removed_at = candidate_index[~kept_flat][np.flatnonzero(removed_m2 == removed_m2.min())[-1]]
            found.append(
                Mismatch(
                    "selection.largest_removed_first",
                    f"kept trust-region token at {_index(kept_at, keep.shape)} with M2 {float(kept_m2.max())!r} while removing "
                    f"the token at {_index(removed_at, keep.shape)} with smaller M2 {float(removed_m2.min())!r}",
                    field="M2 of a kept token",
                    index=_index(kept_at, keep.shape),
                    actual=float(kept_m2.max()),
                    expected=f"<= {float(removed_m2.min())!r}",
                )
            )
    return found


def valid_m2(batch: Batch) -> np.ndarray:
    """Each token's M2, NaN on padding (the levels ``same_up_to_ties`` compares)."""
    return np.where(batch.valid, oracle.second_moment(oracle.log_ratio(batch.logp, batch.behavior_logp, batch.valid)), np.nan)


def same_up_to_ties(keep: np.ndarray, other: np.ndarray, m2: np.ndarray) -> bool:
    """True if the masks differ only in which of several equal-M2 tokens are kept."""
    differ = keep != other
    for value in np.unique(m2[differ]):
        level = m2 == value
        if int((keep & level).sum()) != int((other & level).sum()):
            return False
    return True


def _range(bounds: SelectionBounds) -> int | str:
    return bounds.k_min if bounds.k_min == bounds.k_max else f"{bounds.k_min}..{bounds.k_max} (rounding band)"


def _count_mismatch(check: str, summary: str, wrong: np.ndarray, keep: np.ndarray, valid: np.ndarray) -> Mismatch:
    first = _index(int(np.flatnonzero(wrong)[0]), keep.shape)
    return Mismatch(
        check,
        f"{summary}: {int(wrong.sum())} / {wrong.size} tokens, first at index {first}",
        field="keep",
        index=first,
        actual=bool(keep[first]),
        expected=bool(valid[first]) and not bool(keep[first]),
    )


# --- values ------------------------------------------------------------------------------


def compare_values(
    check: str,
    name: str,
    actual: np.ndarray | float | None,
    expected: np.ndarray | float | None,
    tol: Tolerance,
    scale: float = 0.0,
    allowance: np.ndarray | float = 0.0,
) -> Mismatch | None:
    """Element-wise closeness with the PyTorch-style report of the worst element.
    ``allowance`` (per element or one value) widens the bound by an error the dtype itself
    is known to put into the expected value."""
    actual_array = np.asarray(actual, dtype=np.float64)
    expected_array = np.asarray(expected, dtype=np.float64)
    if actual_array.shape != expected_array.shape:
        return Mismatch(check, f"{name}: shape {actual_array.shape} differs from expected {expected_array.shape}", field=name)
    allowance_array = np.asarray(allowance, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        if expected_array.ndim and allowance_array.shape in ((), expected_array.shape):
            # atol + rtol * max(|expected|, scale) + allowance, operation by operation, in
            # place: two arrays of the input's size instead of six (millions of tokens).
            allowed = np.abs(expected_array)
            np.maximum(allowed, scale, out=allowed)
            np.multiply(tol.rtol, allowed, out=allowed)
            np.add(tol.atol, allowed, out=allowed)
            allowed += allowance_array
            difference = np.subtract(actual_array, expected_array)
            np.abs(difference, out=difference)
        else:
            allowed = tol.atol + tol.rtol * np.maximum(np.abs(expected_array), scale) + allowance_array
            difference = np.abs(actual_array - expected_array)
        bad = ~(difference <= allowed)  # NaN counts as a mismatch
    if not bad.any():
        return None
    total = bad.size
    worst = int(np.nanargmax(np.where(bad, np.nan_to_num(difference, nan=np.inf), -1.0).ravel()))
    index = tuple(int(i) for i in np.unravel_index(worst, actual_array.shape)) if actual_array.ndim else None
    at = f" at index {index}" if index is not None else ""
    act, exp = float(actual_array.ravel()[worst]) + 0.0, float(expected_array.ravel()[worst]) + 0.0  # + 0.0: never "-0.0"
    rel = float(difference.ravel()[worst]) / abs(exp) if exp else math.inf  # Python floats: an overflow is inf, not a warning
    return Mismatch(
        check,
        f"{name} is not close: mismatched elements {int(bad.sum())} / {total}",
        field=name,
        index=index,
        actual=act,
        expected=exp,
        details=(
            f"greatest absolute difference {float(difference.ravel()[worst])!r}{at} (allowed {float(allowed.ravel()[worst])!r})",
            # The bound is atol + rtol * max(|expected|, floor) + the dtype's own error: said as such,
            # so that no word of it reads as the loss's own scale.
            f"greatest relative difference {rel!r}{at} (allowed: atol {tol.atol} + rtol {tol.rtol} x max(|expected|, {scale!r})"
            + (
                f" + the dtype's rounding of exp(d) {float(np.broadcast_to(allowance, difference.shape).ravel()[worst])!r})"
                if np.any(allowance)
                else ")"
            ),
        ),
    )


SELECTION_CHECKS: tuple[str, ...] = (
    "selection.keep_only_valid",
    "selection.only_trust_region_masked",
    "selection.budget",
    "selection.minimal",
    "selection.largest_removed_first",
)


def checks_run_on(actual: M2POResult) -> tuple[str, ...]:
    """The checks :func:`compare_to_oracle` runs on ``actual``: a metric it does not report,
    or a gradient it has not got, is not checked."""
    metrics = tuple(f"metrics.{name}" for name in METRIC_FIELDS + COUNT_FIELDS if getattr(actual, name) is not None)
    return SELECTION_CHECKS + ("loss",) + (("gradient",) if actual.grad is not None else ()) + metrics


def coarser(dtype: str, other: str | None) -> str:
    """The less precise of two dtypes (``other`` None: ``dtype``)."""
    if other is None:
        return dtype
    return max(dtype, other, key=lambda name: FORMATS[name].unit_roundoff)


def exp_rounding(batch: Batch, expected_grad: np.ndarray, dtype: str) -> np.ndarray:
    """Per token, the error ``dtype`` itself puts into exp(d) * A / N: d rounds with a
    relative error u, so exp(d) carries a relative error of about u * (|d| + 1), which at
    |d| near 50 in bfloat16 is tens of percent (a factor 2 to spare)."""
    u = FORMATS[dtype].unit_roundoff
    d = oracle.log_ratio(batch.logp, batch.behavior_logp, batch.valid)
    if np.shape(expected_grad) != d.shape:
        with np.errstate(over="ignore", invalid="ignore"):
            return np.nan_to_num(2.0 * u * (np.abs(d) + 1.0) * np.abs(expected_grad), nan=0.0, posinf=np.inf)
    with np.errstate(over="ignore", invalid="ignore"):
        # 2u (|d| + 1) |g| in that order, in place (one array of the batch's size, not five);
        # NaN (0 * inf) becomes 0, inf stays (-inf cannot occur: every factor is >= 0).
        allowance = np.abs(d, out=d)
        allowance += 1.0
        np.multiply(2.0 * u, allowance, out=allowance)
        allowance *= np.abs(expected_grad)
    allowance[np.isnan(allowance)] = 0.0
    return allowance


def m2_rounding(batch: Batch, keep: np.ndarray, dtype: str) -> dict[str, float]:
    """The error ``dtype`` puts into the M2 metrics: d = logp - behavior_logp loses about
    u * (|logp| + |behavior_logp|) absolutely (a small d of large log-probs loses all its
    digits), so d^2 is off by up to that times (2 |d| + that), averaged like the metric."""
    if dtype == "float64":
        return {}
    u = FORMATS[dtype].unit_roundoff
    valid = batch.valid
    d = oracle.log_ratio(batch.logp, batch.behavior_logp, valid)
    trust = oracle.trust_region(d, batch.advantages, valid)
    # Only trust-region tokens (all valid) enter the means: the error of those alone, in
    # flat order, element for element the values the full-size arrays would hold there.
    logp, behavior, d = batch.logp[trust], batch.behavior_logp[trust], d[trust]
    with np.errstate(over="ignore", invalid="ignore"):
        lost = 2.0 * u * (np.abs(logp) + np.abs(behavior))
        error = np.nan_to_num(lost * (2.0 * np.abs(d) + lost), nan=np.inf)
    kept = keep[trust]
    mean = lambda values: float(values.mean()) if values.size else 0.0  # noqa: E731
    return {"m2_before": mean(error), "m2_after": mean(error[kept])}


def compare_fields(
    batch: Batch,
    actual: M2POResult,
    expected: M2POResult,
    dtype: str,
    compute_dtype: str | None = None,
    *,
    metrics_dtype: str | None = None,
    loss_dtype: str | None = None,
) -> list[Mismatch]:
    """Loss, gradient, metrics and counts of ``actual`` against ``expected`` (both on the same
    mask). Loss and gradient are judged at the input dtype (or the coarser ``loss_dtype``),
    widened by the rounding that dtype puts into exp(d); the metrics, derived from the
    selection arithmetic, at the coarser of the input and compute dtypes (or ``metrics_dtype``)."""
    found: list[Mismatch] = []
    dtype_of_metrics, dtype = dtype, coarser(dtype, loss_dtype)
    allowance = exp_rounding(batch, expected.grad, dtype) if expected.grad is not None else np.zeros(batch.shape)
    with np.errstate(over="ignore", invalid="ignore"):
        term_scale = float(np.sum(np.abs(expected.grad))) if expected.grad is not None else 0.0  # = mean |kept term|, bounds |loss|
    loss_mismatch = compare_values(
        "loss", "loss", actual.loss, expected.loss, tolerance(dtype, "loss"), scale=term_scale, allowance=float(np.sum(allowance))
    )
    if loss_mismatch:
        found.append(loss_mismatch)
    if actual.grad is not None and expected.grad is not None:
        grad_tol = tolerance(dtype, "gradient")
        scale = float(np.max(np.abs(expected.grad))) * grad_tol.rtol if expected.grad.size else 0.0
        grad_mismatch = compare_values("gradient", "grad", actual.grad, expected.grad, grad_tol, scale=scale, allowance=allowance)
        if grad_mismatch:
            found.append(grad_mismatch)
    metric_dtype = coarser(metrics_dtype or dtype_of_metrics, compute_dtype)
    metric_tol = tolerance(metric_dtype, "metric")
    m2_allowance = m2_rounding(batch, expected.keep, metric_dtype)
    # An adapted port's metric may be its own value under another name ('m2' read as
    # m2_before): the mismatch says which value of the port was judged.
    sources = dict(actual.metric_sources)
    read_from = lambda name: (f"read from the port's {sources[name]}",) if name in sources else ()  # noqa: E731
    for name in METRIC_FIELDS:
        value = getattr(actual, name)
        if value is None:
            continue
        mismatch = compare_values(
            f"metrics.{name}", name, value, getattr(expected, name), metric_tol, allowance=m2_allowance.get(name, 0.0)
        )
        if mismatch:
            found.append(dataclasses.replace(mismatch, details=read_from(name) + mismatch.details))
    for name in COUNT_FIELDS:
        value = getattr(actual, name)
        if value is not None and value != getattr(expected, name):
            found.append(
                Mismatch(
                    f"metrics.{name}",
                    f"{name}: {value} differs from Algorithm 1's {getattr(expected, name)}",
                    field=name,
                    actual=value,
                    expected=getattr(expected, name),
                    details=read_from(name),
                )
            )
    return found


def compare_to_oracle(batch: Batch, actual: M2POResult, dtype: str, compute_dtype: str | None = None) -> list[Mismatch]:
    """Every mismatch between ``actual`` and Algorithm 1 on ``batch`` (the values the
    implementation received). Loss, gradient and metrics are judged on ``actual.keep``."""
    compute_dtype = compute_dtype or dtype
    found = check_selection(batch, actual.keep, compute_dtype)
    found += compare_fields(batch, actual, oracle.evaluate_with_mask(batch, actual.keep), dtype, compute_dtype)
    return found


# --- the one formatter -------------------------------------------------------------------


def format_mismatches(mismatches: list[Mismatch], *, batch: Batch | None = None, where: str = "", replay: str = "") -> str:
    """The failure message: what differed, where, both values, the batch, how to replay."""
    checks = len(dict.fromkeys(m.check for m in mismatches))
    counted = f"this batch fails {checks} check(s)" + (f" ({len(mismatches)} mismatches)" if len(mismatches) > checks else "")
    lines = [f"{counted}{(' ' + where) if where else ''}:"]
    for m in mismatches:
        lines.append(f"- [{m.check}] {m.summary}")
        if m.field and (m.actual is not None or m.expected is not None):
            at = f" at index {m.index}" if m.index is not None else ""
            lines.append(f"    {m.field}{at}: actual {m.actual!r}, expected {m.expected!r}")
        lines.extend(f"    {detail}" for detail in m.details)
    if batch is not None:
        lines.append("minimal batch:")
        lines.append("  " + batch.describe().replace("\n", "\n  "))
    if replay:
        lines.append(f"replay: {replay}")
    return "\n".join(lines)
