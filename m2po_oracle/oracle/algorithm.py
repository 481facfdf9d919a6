"""Algorithm 1 of M2PO, transcribed step by step in float64 NumPy.

Definition: ``docs/explanation/algorithm.md`` §1. One function per step; no torch.
Values at invalid (padding) positions are never read: every step masks them first.
"""

from __future__ import annotations

import heapq
import math
from typing import TypedDict

import numpy as np

from m2po_oracle.oracle.batch import Batch
from m2po_oracle.oracle.exactsum import fsum
from m2po_oracle.oracle.record import M2POResult


# Step 1: log ratio and second moment.
def log_ratio(logp: np.ndarray, behavior_logp: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """d = log r = logp - behavior_logp on valid tokens, 0 on padding."""
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.subtract(logp, behavior_logp)
    if d.shape != np.shape(valid) or d.dtype.kind != "f":
        return np.where(valid, d, 0.0)
    np.copyto(d, 0.0, where=np.logical_not(valid))  # in place: one array of the batch's size, not two
    return d


def second_moment(d: np.ndarray) -> np.ndarray:
    """M2 = d^2 per token."""
    with np.errstate(over="ignore"):
        return d * d


# Step 2: trust-region (candidate) tokens: PPO's active clipping quadrants.
def trust_region(d: np.ndarray, advantages: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """T = valid & ((A > 0 & d > 0) | (A < 0 & d < 0)); A == 0 or d == 0 is never a candidate.
    (Padding values of A, NaN included, never matter: ``valid &`` drops those positions.)"""
    with np.errstate(invalid="ignore"):
        return valid & (((advantages > 0) & (d > 0)) | ((advantages < 0) & (d < 0)))


# Step 3: selection, literally: remove the largest M2 while the remaining mean exceeds tau.
def select_loop(m2: np.ndarray, trust: np.ndarray, tau: float) -> np.ndarray:
    """Algorithm 1's loop. Returns the bool mask of removed (masked) tokens.

    "The largest remaining M2" comes from a heap (ties: lowest flat index first, as
    ``argmax`` would), and the remaining sum is kept exactly (:class:`ExactSum`), so each
    ``mean > tau`` test is decided without rounding and the loop stays O(n log n).
    """
    flat = m2.ravel()
    remaining = [(-flat[i], int(i)) for i in np.flatnonzero(trust)]
    heapq.heapify(remaining)
    total = ExactSum(flat[trust.ravel()])
    masked = np.zeros(flat.size, dtype=bool)
    while remaining and total.mean_exceeds(tau, len(remaining)):
        _, index = heapq.heappop(remaining)
        total.remove(flat[index])
        masked[index] = True
    return masked.reshape(m2.shape)


class ExactSum:
    """A sum of non-negative float64 values held exactly, as an integer count of 2**-1074
    (the smallest subnormal), so values can be removed without rounding error."""

    SCALE = 1074

    def __init__(self, values: np.ndarray) -> None:
        self.infinite = int(np.isinf(values).sum())
        self.scaled = sum(self._scaled(float(v)) for v in values if math.isfinite(v))

    @classmethod
    def _scaled(cls, value: float) -> int:
        numerator, denominator = value.as_integer_ratio()  # denominator is a power of two
        return numerator * ((1 << cls.SCALE) // denominator)

    def remove(self, value: float) -> None:
        if math.isinf(value):
            self.infinite -= 1
        else:
            self.scaled -= self._scaled(float(value))

    def mean_exceeds(self, tau: float, count: int) -> bool:
        """sum / count > tau, decided exactly."""
        if self.infinite:
            return True
        numerator, denominator = float(tau).as_integer_ratio()
        return self.scaled * denominator > numerator * count * (1 << self.SCALE)


# Step 4: the equivalent vectorised form.
def sorted_candidates(m2: np.ndarray, trust: np.ndarray) -> np.ndarray:
    """Flat indices of the trust-region tokens, M2 ascending.

    Equal M2 values are ordered by descending index, so that the vectorised cut removes
    the same token among ties as :func:`select_loop` does.
    """
    flat = np.flatnonzero(trust)
    return flat[np.lexsort((-flat, m2.ravel()[flat]))]


def prefix_means(sorted_m2: np.ndarray) -> np.ndarray:
    """P_k = mean of the k smallest candidate M2, k = 1..n (non-decreasing)."""
    with np.errstate(over="ignore", invalid="ignore"):
        sums = np.cumsum(sorted_m2)
        # k < 2^53: the float64 counts are exactly the integers; in place for float64 sums.
        return np.divide(sums, np.arange(1, sorted_m2.size + 1, dtype=np.float64), out=sums if sums.dtype == np.float64 else None)


def select_sorted(m2: np.ndarray, trust: np.ndarray, tau: float) -> np.ndarray:
    """Vectorised selection: keep the k* = #{k : P_k <= tau} smallest candidates.

    The same mask as removing ``sorted_candidates(m2, trust)[k*:]``, without ordering the
    candidates: only their M2 values are sorted (the prefix means depend on nothing else),
    then everything above the k*-th value is removed and, among the candidates equal to it,
    the lowest indices (which ``sorted_candidates`` puts last among ties).
    """
    candidates = np.flatnonzero(trust)
    values = m2.ravel()[candidates]
    sorted_m2 = np.sort(values)
    kept_count = int(np.count_nonzero(prefix_means(sorted_m2) <= tau))
    masked = np.zeros(m2.size, dtype=bool)
    masked[candidates[removed_beyond(values, sorted_m2, kept_count)]] = True
    return masked.reshape(m2.shape)


def removed_beyond(values: np.ndarray, sorted_values: np.ndarray, kept_count: int) -> np.ndarray:
    """Which of ``values`` (candidate M2 in flat index order; ``sorted_values`` the same,
    ascending) are not among the first ``kept_count`` in :func:`sorted_candidates` order
    (M2 ascending, equal M2 by descending index)."""
    if kept_count >= values.size:
        return np.zeros(values.size, dtype=bool)
    cut = sorted_values[kept_count]  # the smallest removed value
    removed = values > cut
    tied = np.flatnonzero(values == cut)  # ascending index
    kept_tied = kept_count - int(np.searchsorted(sorted_values, cut, side="left"))
    removed[tied[: tied.size - kept_tied]] = True
    return removed


# Objective: loss = -(1/N) sum keep * exp(d) * A, N = valid count before masking.
def objective(d: np.ndarray, advantages: np.ndarray, keep: np.ndarray, valid_count: int) -> float:
    if valid_count == 0:
        return 0.0
    keep, d, advantages = np.broadcast_arrays(np.asarray(keep, dtype=bool), d, advantages)
    with np.errstate(over="ignore", invalid="ignore"):
        terms = np.exp(d[keep]) * advantages[keep]  # the kept tokens' terms: padding is never read
    return -fsum(terms) / valid_count


def gradient(d: np.ndarray, advantages: np.ndarray, keep: np.ndarray, valid_count: int) -> np.ndarray:
    """d loss / d logp = -(1/N) * keep * exp(d) * A; exactly 0 on masked and invalid tokens."""
    if valid_count == 0:
        return np.zeros(d.shape)
    keep, d, advantages = np.broadcast_arrays(np.asarray(keep, dtype=bool), d, advantages)
    with np.errstate(over="ignore", invalid="ignore"):
        kept = -np.exp(d[keep]) * advantages[keep] / valid_count
    grad = np.zeros(keep.shape, dtype=kept.dtype)
    grad[keep] = kept
    return grad


class Metrics(TypedDict):
    """What :func:`metrics` returns: M2POResult's metric and count fields, by name."""

    m2_before: float
    m2_after: float
    masked_fraction: float
    trust_region_fraction: float
    valid_count: int
    trust_region_count: int
    kept_trust_region_count: int


def metrics(m2: np.ndarray, trust: np.ndarray, keep: np.ndarray, valid: np.ndarray) -> Metrics:
    """The logged metrics. ``masked`` counts every valid token not kept (for Algorithm 1's
    own mask these are all trust-region tokens)."""
    kept_trust = trust & keep
    valid_count = int(valid.sum())
    trust_count = int(trust.sum())
    kept_trust_count = int(kept_trust.sum())
    masked_count = int((valid & ~keep).sum())
    return {
        "m2_before": fsum(m2[trust]) / trust_count if trust_count else 0.0,
        "m2_after": fsum(m2[kept_trust]) / kept_trust_count if kept_trust_count else 0.0,
        "masked_fraction": masked_count / valid_count if valid_count else 0.0,
        "trust_region_fraction": trust_count / valid_count if valid_count else 0.0,
        "valid_count": valid_count,
        "trust_region_count": trust_count,
        "kept_trust_region_count": kept_trust_count,
    }


def evaluate_with_mask(batch: Batch, keep: np.ndarray) -> M2POResult:
    """The objective, gradient and metrics of Algorithm 1 for a given ``keep`` mask.

    Used to judge an implementation's loss and gradient on the mask it actually chose
    (ties and rounding may legitimately change the mask; see ``equivalence``).
    """
    keep = keep & batch.valid
    d = log_ratio(batch.logp, batch.behavior_logp, batch.valid)
    m2 = second_moment(d)
    trust = trust_region(d, batch.advantages, batch.valid)
    valid_count = int(batch.valid.sum())
    return M2POResult(
        loss=objective(d, batch.advantages, keep, valid_count),
        keep=keep,
        grad=gradient(d, batch.advantages, keep, valid_count),
        **metrics(m2, trust, keep, batch.valid),
    )


def m2po(batch: Batch, *, vectorised: bool = False) -> M2POResult:
    """Algorithm 1 end to end: selection, then objective, gradient and metrics."""
    d = log_ratio(batch.logp, batch.behavior_logp, batch.valid)
    m2 = second_moment(d)
    trust = trust_region(d, batch.advantages, batch.valid)
    select = select_sorted if vectorised else select_loop
    masked = select(m2, trust, batch.tau)
    return evaluate_with_mask(batch, batch.valid & ~masked)
