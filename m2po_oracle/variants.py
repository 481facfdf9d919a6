"""Algorithm 1 with a :class:`~m2po_oracle.deviations.Deviation` applied, in float64 NumPy.

Written from the spec's description of each deviation, independently of the torch
controls, so that diagnosing a control as its own variant is evidence, not an echo.
With every knob at its default this is Algorithm 1 (tested against ``oracle``).
"""

from __future__ import annotations

import math

import numpy as np

from m2po_oracle import oracle
from m2po_oracle.batch import Batch
from m2po_oracle.deviations import Deviation
from m2po_oracle.record import M2POResult


def log_ratio(batch: Batch, dev: Deviation) -> np.ndarray:
    d = oracle.log_ratio(batch.logp, batch.behavior_logp, batch.valid)
    return -d if dev.ratio_inverted else d


def selection_log_ratio(d: np.ndarray, dev: Deviation) -> np.ndarray:
    return np.clip(d, -dev.clamp_log_ratio, dev.clamp_log_ratio) if dev.clamp_log_ratio is not None else d


def candidates(d: np.ndarray, advantages: np.ndarray, valid: np.ndarray, dev: Deviation) -> np.ndarray:
    a = np.where(valid, advantages, 0.0)
    if dev.candidates == "trust_region":
        return oracle.trust_region(d, a, valid)
    if dev.candidates == "all_valid":
        return valid.copy()
    if dev.candidates == "swapped_quadrants":
        return valid & (((a > 0) & (d < 0)) | ((a < 0) & (d > 0)))
    if dev.candidates == "zero_advantage_included":
        return valid & (((a >= 0) & (d > 0)) | ((a < 0) & (d < 0)))
    # first_token_sign: each row uses the advantage of its first valid token
    first = np.array([row[v][0] if v.any() else 0.0 for row, v in zip(a, valid)])[:, None]
    return valid & (((first > 0) & (d > 0)) | ((first < 0) & (d < 0)))


def _select_scope(m2: np.ndarray, candidate: np.ndarray, fixed: np.ndarray, tau: float, dev: Deviation) -> np.ndarray:
    """Removed tokens of one selection scope: the loop 'remove the largest candidate while
    the mean exceeds tau' stops at the largest k whose mean is within budget."""
    order = oracle.sorted_candidates(m2, candidate)
    values = m2.ravel()[order]
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


def select(batch: Batch, dev: Deviation) -> np.ndarray:
    """The deviating selection's ``keep`` mask."""
    d = selection_log_ratio(log_ratio(batch, dev), dev)
    m2 = oracle.second_moment(d)
    candidate = candidates(d, batch.advantages, batch.valid, dev)
    fixed = batch.valid & ~candidate if dev.mean_over_valid else np.zeros_like(candidate)
    rows = batch.shape[0]
    step = dev.scope_rows or max(rows, 1)
    removed = np.zeros_like(candidate)
    for start in range(0, rows, step):
        scope = slice(start, start + step)
        removed[scope] = _select_scope(m2[scope], candidate[scope], fixed[scope], batch.tau, dev)
    return batch.valid & ~removed


def evaluate_with_mask(batch: Batch, keep: np.ndarray, dev: Deviation) -> M2POResult:
    """Loss, gradient w.r.t. logp and metrics of the deviating objective on ``keep``."""
    valid = batch.valid
    keep = keep & valid
    sign = -1.0 if dev.ratio_inverted else 1.0
    d = log_ratio(batch, dev)
    d_value = selection_log_ratio(d, dev)  # straight-through: clamped value, identity gradient
    a = np.where(valid, batch.advantages, 0.0)
    with np.errstate(over="ignore", invalid="ignore"):
        ratio = np.exp(np.where(valid, d_value, 0.0))
        unclipped = ratio * a
        gradient_per_token = sign * ratio * a  # d(ratio * A)/d logp
        if dev.ppo_clip is not None:
            clipped = np.clip(ratio, 1 - dev.ppo_clip, 1 + dev.ppo_clip) * a
            term = np.minimum(unclipped, clipped)
            on_clip = (clipped < unclipped) & ((ratio < 1 - dev.ppo_clip) | (ratio > 1 + dev.ppo_clip))
            gradient_per_token = np.where(on_clip, 0.0, gradient_per_token)
        else:
            term = unclipped
    value_tokens = valid if (not dev.apply_mask or dev.masked_keep_value) else keep
    gradient_tokens = keep if dev.apply_mask else valid
    denominator = {"valid": int(valid.sum()), "kept": int(keep.sum()), "padded": valid.size}[dev.denominator]
    denominator = max(denominator, 1)
    loss = -math.fsum(np.where(value_tokens, term, 0.0).ravel()) / denominator if valid.any() else 0.0
    grad = np.where(gradient_tokens, -gradient_per_token / denominator, 0.0)

    m2 = oracle.second_moment(d_value)
    metrics = oracle.metrics(m2, oracle.trust_region(d_value, a, valid), keep, valid)
    if dev.m2_after_over_valid:
        metrics["m2_after"] = math.fsum(m2[keep]) / int(keep.sum()) if keep.any() else 0.0
    return M2POResult(loss=loss, keep=keep, grad=grad, **metrics)


def m2po(batch: Batch, dev: Deviation) -> M2POResult:
    return evaluate_with_mask(batch, select(batch, dev), dev)
