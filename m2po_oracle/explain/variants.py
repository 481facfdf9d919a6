"""Algorithm 1 with a :class:`~m2po_oracle.explain.deviations.Deviation` applied, in float64 NumPy.

Written from the description of each deviation in docs/explanation/algorithm.md (§3 and §4), independently
of the torch controls, so that diagnosing a control as its own variant is evidence, not
an echo. With every knob at its default this is Algorithm 1 (tested against ``oracle``).
Knobs compose: any set of them is one deviating M2PO.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import numpy as np

from m2po_oracle import oracle
from m2po_oracle.explain.deviations import Deviation
from m2po_oracle.oracle.algorithm import Metrics
from m2po_oracle.oracle.batch import Batch
from m2po_oracle.oracle.record import M2POResult

#: algorithm.md §4: the clip family's thresholds and the bound of an unconstrained range.
HARMFUL_EPSILON = 1e-12


def log_ratio(batch: Batch, dev: Deviation) -> np.ndarray:
    d = oracle.log_ratio(batch.logp, batch.behavior_logp, batch.valid)
    return -d if dev.ratio_inverted else d


def loss_log_ratio(d: np.ndarray, dev: Deviation) -> np.ndarray:
    """d as the loss's ratio sees it: clamped where the port clamps."""
    return np.clip(d, -dev.clamp_log_ratio, dev.clamp_log_ratio) if dev.clamp_log_ratio is not None else d


def selection_log_ratio(d: np.ndarray, dev: Deviation) -> np.ndarray:
    """d as the selection and the metrics see it: the loss's, unless the clamp is the loss's alone."""
    return d if dev.clamp_only_in_loss else loss_log_ratio(d, dev)


def _sign_source(batch: Batch, dev: Deviation) -> np.ndarray:
    """The advantages the candidate test reads: per token, or one per row."""
    a = np.where(batch.valid, batch.advantages, 0.0)
    if dev.candidates == "first_token_sign":  # each row's first valid token
        return np.array([row[v][0] if v.any() else 0.0 for row, v in zip(a, batch.valid)])[:, None] * np.ones_like(a)
    if dev.candidates == "column0_sign" and a.shape[1]:  # column 0 as the caller holds it, padding or not
        with np.errstate(invalid="ignore"):
            return np.broadcast_to(batch.advantages[:, :1], a.shape).copy()
    return a


def _statistic_positions(batch: Batch, dev: Deviation) -> np.ndarray:
    """Where the selection's statistic looks: the valid tokens, or every position when the
    kernel is handed no mask (padding as the caller holds it)."""
    return np.ones_like(batch.valid) if dev.statistic_over_padding else batch.valid


def candidates(d: np.ndarray, batch: Batch, dev: Deviation) -> np.ndarray:
    valid = _statistic_positions(batch, dev)
    a = _sign_source(batch, dev) if not dev.statistic_over_padding else batch.advantages
    m = dev.candidate_margin
    with np.errstate(invalid="ignore"):
        if dev.candidates == "all_valid":
            return valid.copy()
        if dev.candidates == "none":
            return np.zeros_like(valid)
        if dev.candidates == "swapped_quadrants":
            return valid & (((a > m) & (d < -m)) | ((a < -m) & (d > m)))
        if dev.candidates == "zero_advantage_included":
            return valid & (((a >= 0) & (d > m)) | ((a < -m) & (d < -m)))
        return valid & (((a > m) & (d > m)) | ((a < -m) & (d < -m)))


def _select_scope(m2: np.ndarray, candidate: np.ndarray, fixed: np.ndarray, tau: float, dev: Deviation) -> np.ndarray:
    """Removed tokens of one selection scope: the loop 'remove the largest candidate while
    the mean exceeds tau' stops at the largest k whose mean is within budget."""
    order = oracle.sorted_candidates(m2, candidate)
    values = m2.ravel()[order]
    tau = tau * dev.budget_scale
    if (
        dev.noop_margin
        and values.size
        and (math.fsum(values) + math.fsum(m2[fixed])) / (values.size + int(fixed.sum())) <= tau + dev.noop_margin
    ):
        return np.zeros(m2.shape, dtype=bool)  # "already within budget", tested with the port's margin
    if dev.selection_dtype == "float32":
        f32 = np.float32
        sums = np.cumsum(values.astype(f32), dtype=f32) + f32(np.sum(m2[fixed], dtype=f32))
        counts = np.arange(1, values.size + 1) + int(fixed.sum())
        means = sums / counts.astype(f32)
        within = (means < f32(tau)) if dev.strict_stop else (means <= f32(tau))
        kept = int(np.flatnonzero(within)[-1]) + 1 if within.any() else 0
    else:
        fixed_sum, fixed_count = math.fsum(m2[fixed]), int(fixed.sum())
        kept = 0
        for k in range(values.size, 0, -1):
            mean = (math.fsum(values[:k]) + fixed_sum) / (k + fixed_count)
            if (mean < tau) if dev.strict_stop else (mean <= tau):
                kept = k
                break
    kept = max(kept, min(dev.min_kept, values.size))
    if kept < values.size:
        kept = max(kept - dev.extra_removed, 0)
    removed = np.zeros(m2.size, dtype=bool)
    removed[order[kept:]] = True
    return removed.reshape(m2.shape)


def selection_m2(d: np.ndarray, dev: Deviation) -> np.ndarray:
    if dev.selection_dtype == "float32":
        d32 = d.astype(np.float32)
        with np.errstate(over="ignore"):
            return (d32 * d32).astype(np.float64)
    return oracle.second_moment(d)


def select(batch: Batch, dev: Deviation) -> np.ndarray:
    """The deviating selection's ``keep`` mask (for a clip kind: the tokens with a gradient)."""
    if dev.selection_kind != "mask":
        return clip_outcome(batch, dev).keep
    d = selection_log_ratio(_statistic_log_ratio(batch, dev), dev)
    m2 = selection_m2(d, dev)
    candidate = candidates(d, batch, dev)
    fixed = _statistic_positions(batch, dev) & ~candidate if dev.mean_over_valid else np.zeros_like(candidate)
    rows = batch.shape[0]
    step = dev.scope_rows or max(rows, 1)
    removed = np.zeros_like(candidate)
    for start in range(0, rows, step):
        scope = slice(start, start + step)
        removed[scope] = _select_scope(m2[scope], candidate[scope], fixed[scope], batch.tau, dev)
    return batch.valid & ~removed


def _statistic_log_ratio(batch: Batch, dev: Deviation) -> np.ndarray:
    """d where the statistic looks: 0 on padding, or the caller's padding as it is."""
    if not dev.statistic_over_padding:
        return log_ratio(batch, dev)
    with np.errstate(invalid="ignore", over="ignore"):
        d = batch.logp - batch.behavior_logp
    d = np.where(np.isfinite(d), d, 0.0)  # a NaN/inf padding compares False everywhere in a kernel
    return -d if dev.ratio_inverted else d


# --- the clip family (algorithm.md §4) ----------------------------------------------------


def harmful(d: np.ndarray, batch: Batch, dev: Deviation) -> np.ndarray:
    """Fact 1: A > +1e-12 and r > 1 + 1e-12, or A < -1e-12 and r < 1 - 1e-12 (the sign of A
    per token, or of column 0 with ``column0_sign``)."""
    a = _sign_source(batch, dev)
    with np.errstate(over="ignore", invalid="ignore"):
        r = np.exp(d)
        return batch.valid & (((a > HARMFUL_EPSILON) & (r > 1 + HARMFUL_EPSILON)) | ((a < -HARMFUL_EPSILON) & (r < 1 - HARMFUL_EPSILON)))


def cap_squared(v: np.ndarray, tau: float, kind: str) -> float | None:
    """Facts 2-3: the cap c^2 on d^2 for the sorted candidate values ``v`` (None: unconstrained).

    Water-filling: sum_i min(v_i, c^2) = tau * n. With g(j) = sum_{i<j} v_i + (n - j) v_j
    (the capped sum at c^2 = v_j) and k = #{j : g(j) <= S}, the exact cap lies in
    [v_(k-1), v_k]; the release returns the breakpoint below it."""
    n = v.size
    if n == 0 or math.fsum(v) / n <= tau + HARMFUL_EPSILON:
        return None
    budget = tau * n
    prefix = np.concatenate([[0.0], np.cumsum(v)])
    capped_sums = prefix[:-1] + (n - np.arange(n)) * v
    k = int(np.count_nonzero(capped_sums <= budget))
    if kind == "clip_below":
        return max(float(v[k - 1]) - HARMFUL_EPSILON, 0.0) if k >= 1 else 0.0
    return (budget - float(prefix[k])) / (n - k)


def float32_exp(x: float) -> float:
    """exp(x) as a port computes it from a Python float in torch's default dtype
    (``torch.exp(torch.tensor(x))``): x rounded to float32, then float32's exp of it, correctly
    rounded. Rounding x first moves the bound by up to x * 2^-24 relative, more than rounding
    exp(x) alone: the two can fall on either side of a token's ratio at the cap."""
    with np.errstate(over="ignore"):
        return float(np.float32(np.exp(np.float64(np.float32(x)))))


@dataclass(frozen=True)
class ClipOutcome:
    keep: np.ndarray  # valid tokens whose gradient the clip does not zero
    low: float
    high: float
    cap_squared: float | None
    candidate_m2: np.ndarray  # sorted


def clip_outcome(batch: Batch, dev: Deviation) -> ClipOutcome:
    """Fact 4-5: the ratio range [exp(-c), exp(c)], widened by the floors; tokens on the
    harmful side beyond it keep their clipped value and get zero gradient."""
    d = selection_log_ratio(log_ratio(batch, dev), dev)
    candidate = harmful(d, batch, dev)
    v = np.sort(oracle.second_moment(d)[candidate])
    c2 = cap_squared(v, batch.tau * dev.budget_scale, dev.selection_kind)
    # The same exp as the ratio's: at d == c exactly the token is on the bound, not beyond it.
    low, high = (0.0, dev.unconstrained_ratio_bound) if c2 is None else (float(np.exp(-np.sqrt(c2))), float(np.exp(np.sqrt(c2))))
    if dev.clip_bound_float32 and c2 is not None:
        low, high = float32_exp(-math.sqrt(c2)), float32_exp(math.sqrt(c2))
    if dev.clip_floors is not None and c2 is not None:
        low, high = min(low, 1.0 - dev.clip_floors[0]), max(high, 1.0 + dev.clip_floors[1])
    a = np.where(batch.valid, batch.advantages, 0.0)
    with np.errstate(over="ignore", invalid="ignore"):
        r = np.exp(np.where(batch.valid, d, 0.0))
        beyond = batch.valid & (((a > 0) & (r > high)) | ((a < 0) & (r < low)))
    return ClipOutcome(batch.valid & ~beyond, low, high, c2, v)


# --- objective and metrics ---------------------------------------------------------------

#: The aggregations that weigh each row by its own count (the rest divide one sum by one number).
ROW_WEIGHTED = ("seq_mean_token_mean", "row_mean_empty_as_one")


def _denominator(batch: Batch, keep: np.ndarray, dev: Deviation) -> float:
    """The loss's divisor: a count, at least 1 (an empty batch's loss is 0), or N + epsilon."""
    valid = int(batch.valid.sum())
    if dev.denominator == "valid_epsilon":
        return valid + dev.denominator_epsilon
    per_row = batch.valid.sum(axis=1)
    non_empty = int(np.count_nonzero(per_row))
    counts = {
        "valid": valid,
        "kept": int(keep.sum()),
        "padded": batch.valid.size,
        "seq_mean_token_sum": non_empty,
        "seq_mean_token_sum_norm": non_empty * batch.valid.shape[1],
        "valid_empty_rows_as_one": int(np.maximum(per_row, 1).sum()),
    }
    return float(max(counts[dev.denominator], 1))


def _row_divisors(batch: Batch, dev: Deviation) -> np.ndarray:
    """Per row, what its masked sum is divided by (ROW_WEIGHTED aggregations)."""
    per_row = batch.valid.sum(axis=1).astype(np.float64)
    rows = batch.valid.shape[0]
    if dev.denominator == "seq_mean_token_mean":  # verl: over non-empty rows, each by n_i + 1e-8
        return (per_row + 1e-8) * max(int(np.count_nonzero(per_row)), 1)
    return np.maximum(per_row, 1.0) * max(rows, 1)  # TRL grpo: every row, an empty one by 1


def evaluate_with_mask(batch: Batch, keep: np.ndarray, dev: Deviation) -> M2POResult:
    """Loss, gradient w.r.t. logp and metrics of the deviating objective on ``keep`` (a clip
    kind computes its own range; ``keep`` then only enters the metrics)."""
    valid = batch.valid
    keep = keep & valid
    sign = -1.0 if dev.ratio_inverted else 1.0
    d = log_ratio(batch, dev)
    d_value = loss_log_ratio(d, dev)  # the clamped value; straight-through keeps the identity gradient
    a = np.where(valid, batch.advantages, 0.0)
    beyond_clamp = (np.abs(d) > dev.clamp_log_ratio) if (dev.hard_clamp and dev.clamp_log_ratio is not None) else np.zeros_like(valid)
    narrow = dev.loss_dtype == "float32"
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        if narrow:  # exp(d) * A in float32: a product below float32's range is exactly 0, as in the port
            ratio = np.exp(np.where(valid, d_value, 0.0).astype(np.float32)).astype(np.float64)
            unclipped = (ratio.astype(np.float32) * a.astype(np.float32)).astype(np.float64)
        else:
            ratio = np.exp(np.where(valid, d_value, 0.0))
            unclipped = ratio * a
        gradient_per_token = np.where(beyond_clamp, 0.0, sign * unclipped)  # d(ratio * A)/d logp
        clip = clip_outcome(batch, dev) if dev.selection_kind != "mask" else None
        if clip is not None:
            # Fact 4: loss_t = max(-A r, -A clamp(r, lo, hi)); the clipped side has no gradient.
            term = -np.maximum(-unclipped, -np.clip(ratio, clip.low, clip.high) * a)
            gradient_per_token = np.where(clip.keep, gradient_per_token, 0.0)
        elif dev.ppo_clip is not None:
            clipped = np.clip(ratio, 1 - dev.ppo_clip, 1 + dev.ppo_clip) * a
            term = np.minimum(unclipped, clipped)
            on_clip = (clipped < unclipped) & ((ratio < 1 - dev.ppo_clip) | (ratio > 1 + dev.ppo_clip))
            gradient_per_token = np.where(on_clip, 0.0, gradient_per_token)
        else:
            term = unclipped
    if clip is not None:
        value_tokens, gradient_tokens = valid, valid
    else:
        value_tokens = valid if (not dev.apply_mask or dev.masked_keep_value) else keep
        gradient_tokens = keep if dev.apply_mask else valid
    if dev.denominator in ROW_WEIGHTED:
        divisors = _row_divisors(batch, dev)
        row_sums = [math.fsum(row) for row in np.where(value_tokens, term, 0.0)]
        loss = -math.fsum(s / divisor for s, divisor in zip(row_sums, divisors)) if valid.any() else 0.0
        grad = np.where(gradient_tokens, -gradient_per_token / divisors[:, None], 0.0)
    else:
        denominator = _denominator(batch, keep, dev)
        loss = -math.fsum(np.where(value_tokens, term, 0.0).ravel()) / denominator if valid.any() else 0.0
        grad = np.where(gradient_tokens, -gradient_per_token / denominator, 0.0)
    return M2POResult(loss=loss, keep=keep, grad=grad, **_metrics(batch, selection_log_ratio(d, dev), keep, dev, clip))


def _metrics(batch: Batch, d: np.ndarray, keep: np.ndarray, dev: Deviation, clip: ClipOutcome | None) -> Metrics:
    valid = batch.valid
    a = np.where(valid, batch.advantages, 0.0)
    m2 = oracle.second_moment(d)
    metrics = oracle.metrics(m2, oracle.trust_region(d, a, valid), keep, valid)
    if dev.m2_after_over_valid:
        metrics["m2_after"] = math.fsum(m2[keep]) / int(keep.sum()) if keep.any() else 0.0
    if clip is not None:  # facts 2 and 7: M2 over the candidates, and after: the capped mean (0 without candidates)
        v = clip.candidate_m2
        metrics["m2_before"] = math.fsum(v) / v.size if v.size else 0.0
        metrics["m2_after"] = (
            (math.fsum(np.minimum(v, clip.cap_squared) if clip.cap_squared is not None else v) / v.size) if v.size else 0.0
        )
    if dev.metrics_dtype == "float32":
        metrics = cast(
            Metrics, {k: (float(np.float32(v)) if isinstance(v, float) else v) for k, v in metrics.items()}
        )  # the same keys, each its type
    return metrics


def m2po(batch: Batch, dev: Deviation) -> M2POResult:
    return evaluate_with_mask(batch, select(batch, dev), dev)
