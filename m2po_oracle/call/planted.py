"""One parameterised torch port of M2PO that realises any :class:`Deviation`: the planted bugs
of the negative controls (:mod:`m2po_oracle.call.controls`), independent of the NumPy
variants the diagnosis compares with (:mod:`m2po_oracle.explain.variants`), so that
``selftest`` checks two realisations of every deviation against each other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, cast

import torch

from m2po_oracle.explain.deviations import MASK_ONLY_KNOBS, Deviation

_DTYPES = {"float64": torch.float64, "float32": torch.float32}
#: Thresholds of the clip family's "harmful" test (algorithm.md §4, fact 1) and stop test (fact 2).
CLIP_ADVANTAGE_EPS = 1e-12
CLIP_RATIO_EPS = 1e-12
CLIP_BUDGET_EPS = 1e-12
#: The release's breakpoint below the exact cap (algorithm.md §4, fact 3).
CLIP_BELOW_OFFSET = 1e-12


def _candidates(
    d: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, how: str, raw_advantages: torch.Tensor | None = None, margin: float = 0.0
) -> torch.Tensor:
    if how == "trust_region":
        return mask & (((advantages > margin) & (d > margin)) | ((advantages < -margin) & (d < -margin)))
    if how == "all_valid":
        return mask.clone()
    if how == "none":
        return torch.zeros_like(mask)
    if how == "swapped_quadrants":
        return mask & (((advantages > margin) & (d < -margin)) | ((advantages < -margin) & (d > margin)))
    if how == "zero_advantage_included":
        return mask & (((advantages >= 0) & (d > margin)) | ((advantages < -margin) & (d < -margin)))
    if how == "first_token_sign":
        first = torch.gather(advantages, 1, mask.long().argmax(dim=1, keepdim=True)).expand_as(advantages)
        return mask & (((first > 0) & (d > 0)) | ((first < 0) & (d < 0)))
    if how == "column0_sign":  # the release: advantages[:, 0] as the caller holds it, padding or not (NaN compares False)
        column0 = _column0(raw_advantages if raw_advantages is not None else advantages)
        return mask & (((column0 > 0) & (d > 0)) | ((column0 < 0) & (d < 0)))
    raise ValueError(f"candidates: unknown {how!r}")


def _column0(advantages: torch.Tensor) -> torch.Tensor:
    """Each row's advantages[:, 0], broadcast along the row (whatever column 0 holds)."""
    return advantages.detach()[:, :1].expand_as(advantages)


def _log_ratio(
    logp: torch.Tensor, behavior_logp: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype, sign: float, clamp: float | None
) -> torch.Tensor:
    """Detached d (clamped when the port clamps), computed in ``dtype``; 0 on padding."""
    raw = sign * (logp.detach().to(dtype) - behavior_logp.detach().to(dtype))
    d = torch.where(mask, raw, torch.zeros((), dtype=dtype))
    if clamp is not None:
        d = d.clamp(-clamp, clamp)
    return d


def _select_flat(m2: torch.Tensor, candidate: torch.Tensor, fixed: torch.Tensor, tau: float, dev: Deviation) -> torch.Tensor:
    """Removed candidates of one selection scope (1-d inputs), by sorted prefix means.

    The arithmetic is in ``m2``'s dtype (the selection dtype), tau rounded to it."""
    dtype = m2.dtype
    key = torch.where(candidate, m2, torch.full_like(m2, math.inf))
    shuffle = torch.randperm(key.numel()) if dev.random_tie_break else torch.arange(key.numel())
    sorted_key, order = torch.sort(key[shuffle], stable=True)
    order = shuffle[order]
    n = int(candidate.sum())
    if n == 0:
        return torch.zeros_like(candidate)
    values = sorted_key[:n]
    k = torch.arange(0, n + 1, dtype=dtype)
    fixed_sum = m2[fixed].sum()
    fixed_count = int(fixed.sum())
    tau = tau * dev.budget_scale
    if dev.noop_margin and bool((values.sum() + fixed_sum) / (n + fixed_count) <= tau + dev.noop_margin):
        return torch.zeros_like(candidate)  # the port's "already within budget" test, with its margin
    sums = torch.cat([torch.zeros(1, dtype=dtype), torch.cumsum(values, 0)]) + fixed_sum
    counts = k + fixed_count
    means = torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums))
    budget = torch.tensor(tau, dtype=dtype)
    within = means < budget if dev.strict_stop else means <= budget
    within[0] = True  # an empty remainder is within budget
    kept = int(torch.nonzero(within).max())  # the loop stops at the largest k within budget
    kept = max(kept, min(dev.min_kept, n))
    if kept < n:
        kept = max(kept - dev.extra_removed, 0)
    removed = torch.zeros_like(candidate)
    removed[order[kept:n]] = True
    return removed


@dataclass(frozen=True)
class ClipCap:
    """The clip family's selection (algorithm.md §4) in the selection dtype.

    ``harmful``: the candidates; ``values``: their d^2 ascending; ``m2_now``: their mean;
    ``cap_squared``: c^2 (None: unconstrained); ``lo``/``hi``: the ratio range after the
    floors (None: unconstrained)."""

    harmful: torch.Tensor
    values: torch.Tensor
    m2_now: torch.Tensor | None
    cap_squared: torch.Tensor | None
    lo: torch.Tensor | None
    hi: torch.Tensor | None

    @property
    def constrained(self) -> bool:
        return self.cap_squared is not None


def cap_squared(values: torch.Tensor, tau: float, kind: str) -> torch.Tensor:
    """c^2 of the water-filling cap for candidate d^2 ``values`` sorted ascending, whose
    mean exceeds the budget (algorithm.md §4, fact 3), in ``values``' dtype.

    g(j) = sum_{i<j} v_i + (n - j) v_j is the capped sum with the cap at v_j (non-decreasing);
    k = #{j : g(j) <= S}, S = tau n. clip_below: the breakpoint below, v_(k-1) - 1e-12
    (0 if k = 0); clip_exact: the exact cap between breakpoints, (S - sum_{i<k} v_i) / (n - k).
    """
    dtype = values.dtype
    n = values.numel()
    budget_sum = torch.tensor(tau, dtype=dtype) * n
    below = torch.cat([torch.zeros(1, dtype=dtype), torch.cumsum(values, 0)])  # below[j] = sum_{i<j} v_i, j = 0..n
    g = below[:n] + (n - torch.arange(n, dtype=dtype)) * values
    k = int((g <= budget_sum).sum())
    if kind == "clip_below":
        if k == 0:
            return torch.zeros((), dtype=dtype)
        return (values[k - 1] - CLIP_BELOW_OFFSET).clamp(min=0)
    if kind == "clip_exact":
        # g(n-1) = n * M2_now > S whenever constrained, so k <= n - 1; the guard only keeps a
        # rounding-level tie (g(n-1) <= S in the selection dtype) from dividing by zero.
        k = min(k, n - 1)
        return ((budget_sum - below[k]) / (n - k)).clamp(min=0)
    raise ValueError(f"selection_kind: no cap for {kind!r}")


def _clip_cap(d: torch.Tensor, sign_source: torch.Tensor, mask: torch.Tensor, tau: float, dev: Deviation) -> ClipCap:
    """Candidates, M2_now, the cap and the ratio range of the clip family (selection dtype)."""
    dtype = d.dtype
    r = torch.exp(d)
    positive = sign_source > CLIP_ADVANTAGE_EPS
    negative = sign_source < -CLIP_ADVANTAGE_EPS
    harmful = mask & ((positive & (r > 1 + CLIP_RATIO_EPS)) | (negative & (r < 1 - CLIP_RATIO_EPS)))
    values, _ = torch.sort((d * d)[harmful])
    # No cap: no range at all, or the range a port returns for "no clip", (0, bound).
    unbounded = (
        (None, None)
        if math.isinf(dev.unconstrained_ratio_bound)
        else (torch.zeros((), dtype=dtype), torch.tensor(dev.unconstrained_ratio_bound, dtype=dtype))
    )
    if values.numel() == 0:
        return ClipCap(harmful, values, None, None, *unbounded)
    m2_now = values.mean()
    tau = tau * dev.budget_scale
    if bool(m2_now <= torch.tensor(tau, dtype=dtype) + CLIP_BUDGET_EPS):
        return ClipCap(harmful, values, m2_now, None, *unbounded)
    c2 = cap_squared(values, tau, dev.selection_kind)
    c = torch.sqrt(c2)
    lo, hi = torch.exp(-c), torch.exp(c)
    if dev.clip_bound_float32:  # c as a Python float into torch's default dtype, then exp there
        lo, hi = torch.exp(-c.float()).to(dtype), torch.exp(c.float()).to(dtype)
    if dev.clip_floors is not None:
        low, high = dev.clip_floors
        lo = torch.minimum(lo, torch.tensor(1 - low, dtype=dtype))
        hi = torch.maximum(hi, torch.tensor(1 + high, dtype=dtype))
    return ClipCap(harmful, values, m2_now, c2, lo, hi)


def _check_knobs(dev: Deviation) -> None:
    if dev.selection_kind == "mask":
        if dev.clip_floors is not None:
            raise ValueError("clip_floors: the floors widen a clip range; they need selection_kind 'clip_below' or 'clip_exact'")
        if dev.unconstrained_ratio_bound != Deviation().unconstrained_ratio_bound:
            raise ValueError("unconstrained_ratio_bound: a bound of the clip range; it needs selection_kind 'clip_below' or 'clip_exact'")
        return
    set_knobs = [name for name in MASK_ONLY_KNOBS if getattr(dev, name) != getattr(Deviation(), name)]
    if set_knobs:
        raise ValueError(
            f"selection_kind {dev.selection_kind!r}: knobs {set_knobs} belong to the mask selection and are not realised for a clip range"
        )


def planted(
    logp: torch.Tensor, behavior_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, tau: float, deviation: Deviation
) -> dict[str, Any]:
    """An M2PO implementation with the given deviation (all defaults: Algorithm 1).

    ``selection_kind`` "clip_below"/"clip_exact" replaces the mask by the clip family's
    ratio range (algorithm.md §4); their candidates use the sign of the per-token advantage,
    or of ``advantages[:, 0]`` with ``candidates="column0_sign"`` (other candidate sets are
    read as the trust region there)."""
    dev = deviation
    _check_knobs(dev)
    if dev.fails_at_zero_budget and tau == 0:
        raise TypeError("cannot unpack non-iterable float object")  # as the release does: its cap returns 0.0, not a pair
    if dev.sanitise_inputs_in_place:
        advantages.masked_fill_(~mask, 0.0)
    selection_dtype, metrics_dtype = _DTYPES[dev.selection_dtype], _DTYPES[dev.metrics_dtype]
    sign = -1.0 if dev.ratio_inverted else 1.0
    selection_clamp = None if dev.clamp_only_in_loss else dev.clamp_log_ratio
    d = _log_ratio(logp, behavior_logp, mask, selection_dtype, sign, selection_clamp)
    a = torch.where(mask, advantages.double(), torch.zeros((), dtype=torch.float64))
    clip = None
    if dev.selection_kind == "mask":
        if dev.statistic_over_padding:  # a kernel handed no mask: every position, the caller's padding as it is (NaN compares False)
            seen = torch.ones_like(mask)
            d_seen = _log_ratio(logp, behavior_logp, seen, selection_dtype, sign, selection_clamp).nan_to_num(0.0, 0.0, 0.0)
            a_seen = advantages.double()
        else:
            seen, d_seen, a_seen = mask, d, a
        m2 = d_seen * d_seen
        candidate = _candidates(d_seen, a_seen, seen, dev.candidates, advantages, dev.candidate_margin)
        fixed = (seen & ~candidate) if dev.mean_over_valid else torch.zeros_like(mask)
        step = dev.scope_rows or mask.shape[0]
        scopes = [slice(i, i + step) for i in range(0, mask.shape[0], step)] or [slice(None)]
        removed = torch.zeros_like(mask)
        for rows in scopes:
            flat = _select_flat(m2[rows].reshape(-1), candidate[rows].reshape(-1), fixed[rows].reshape(-1), tau, dev)
            removed[rows] = flat.reshape(m2[rows].shape)
        keep = mask & ~removed
    else:
        sign_source = _column0(advantages) if dev.candidates == "column0_sign" else a
        clip = _clip_cap(d, sign_source, mask, tau, dev)

    loss_tokens = mask
    if dev.zero_padding_by_multiplying or dev.padding_through_where:
        live_logp, live_behavior, live_advantages = logp, behavior_logp, advantages
    else:  # padding replaced before any arithmetic, so no 0 * nan reaches the backward pass
        live_logp = torch.where(mask, logp, torch.zeros_like(logp))
        live_behavior = torch.where(mask, behavior_logp, torch.zeros_like(behavior_logp))
        live_advantages = torch.where(mask, advantages, torch.zeros_like(advantages))
    if dev.loss_dtype == "float32":  # the loss's arithmetic in float32; the gradient reaches logp through the cast
        live_logp, live_behavior, live_advantages = live_logp.float(), live_behavior.float(), live_advantages.float()
    d_live = sign * (live_logp - live_behavior)
    if dev.clamp_log_ratio is not None:
        if dev.hard_clamp:  # a real clamp: beyond +-clamp the value is exp(+-clamp) and the gradient 0
            d_live = d_live.clamp(-dev.clamp_log_ratio, dev.clamp_log_ratio)
        else:  # straight-through: clamped value, unclamped gradient
            d_live = d_live + (d_live.clamp(-dev.clamp_log_ratio, dev.clamp_log_ratio) - d_live).detach()
    ratio = torch.exp(d_live)
    if clip is not None:
        # The PPO surrogate with the budget's range: max(-A r, -A clamp(r, lo, hi)), summed as a
        # loss term by term (no outer minus sign). Unconstrained: no clipping at all, or the
        # port's range for "no clip".
        unclipped = -live_advantages * ratio
        if clip.lo is not None:
            assert clip.hi is not None  # lo and hi are set together
            lo, hi = clip.lo.to(ratio.dtype), clip.hi.to(ratio.dtype)
            clipped = -live_advantages * ratio.clamp(lo, hi)
            term = torch.maximum(unclipped, clipped)
            # torch.maximum sends the gradient to the larger branch (half to each on a tie); the
            # clipped branch has none outside [lo, hi]: those tokens' gradient is zeroed.
            with torch.no_grad():
                beyond = mask & (clipped > unclipped) & ((ratio < lo) | (ratio > hi))
        else:
            term = unclipped
            beyond = torch.zeros_like(mask)
        keep = mask & ~beyond
        outer = 1.0
    else:
        loss_tokens = keep if dev.apply_mask else mask
        if dev.ppo_clip is not None:
            clipped = ratio.clamp(1 - dev.ppo_clip, 1 + dev.ppo_clip)
            term = torch.minimum(ratio * live_advantages, clipped * live_advantages)
        else:
            term = ratio * live_advantages
        if dev.masked_keep_value:
            term = torch.where(keep, term, term.detach())
            loss_tokens = mask
        outer = -1.0
    if dev.zero_padding_by_multiplying:
        total = (loss_tokens.to(term.dtype) * term).sum()
    else:
        total = torch.where(loss_tokens, term, torch.zeros_like(term)).sum()
    loss = outer * _aggregate(term, loss_tokens, mask, keep, dev, total)

    trust = _candidates(d, a, mask, "trust_region")
    kept_trust = trust & keep
    valid_count = int(mask.sum())
    masked_count = int((mask & ~keep).sum())
    d_metrics = d if metrics_dtype == selection_dtype else _log_ratio(logp, behavior_logp, mask, metrics_dtype, sign, selection_clamp)
    m2_metrics = d_metrics * d_metrics
    if clip is None:
        after_tokens = keep if dev.m2_after_over_valid else kept_trust
        m2_before = _mean(m2_metrics[trust])
        m2_after = _mean(m2_metrics[after_tokens])
    else:
        harmful_m2 = m2_metrics[clip.harmful]
        m2_before = _mean(harmful_m2)
        m2_after = (
            m2_before if not clip.constrained else _mean(torch.minimum(harmful_m2, cast(torch.Tensor, clip.cap_squared).to(metrics_dtype)))
        )  # constrained: cap_squared is set
    result = {
        "loss": loss,
        "keep": keep,
        "m2_before": m2_before,
        "m2_after": m2_after,
        "masked_fraction": _fraction(masked_count, valid_count, metrics_dtype),
        "trust_region_fraction": _fraction(int(trust.sum()), valid_count, metrics_dtype),
        "valid_count": valid_count,
        "trust_region_count": int(trust.sum()),
        "kept_trust_region_count": int(kept_trust.sum()),
    }
    if clip is not None:
        result["cap_squared"] = float(cast(torch.Tensor, clip.cap_squared)) if clip.constrained else None  # constrained: cap_squared is set
    return result


def _aggregate(
    term: torch.Tensor, loss_tokens: torch.Tensor, mask: torch.Tensor, keep: torch.Tensor, dev: Deviation, total: torch.Tensor
) -> torch.Tensor:
    """The loss's normaliser applied to the masked terms (``total``: their sum), as the
    frameworks aggregate (algorithm.md §5)."""
    per_row = mask.sum(dim=1).to(total.dtype)
    non_empty = (per_row > 0).sum().to(total.dtype)
    how = dev.denominator
    if how == "valid_epsilon":  # verl's token-mean: sum / (N + eps), in the loss dtype
        return total / (mask.sum().to(total.dtype) + dev.denominator_epsilon)
    if how in ("seq_mean_token_mean", "row_mean_empty_as_one"):
        row_sums = torch.where(loss_tokens, term, torch.zeros_like(term)).sum(dim=1)
        if how == "seq_mean_token_mean":  # verl: mean over non-empty rows of row sum / (n_i + 1e-8)
            return (row_sums / (per_row + 1e-8)).sum() / non_empty.clamp(min=1)
        return (row_sums / per_row.clamp(min=1)).mean() if mask.shape[0] else total  # TRL grpo: every row
    denominator = {
        "valid": mask.sum(),
        "kept": keep.sum(),
        "padded": torch.tensor(mask.numel()),
        "seq_mean_token_sum": non_empty,
        "seq_mean_token_sum_norm": non_empty * mask.shape[1],
        "valid_empty_rows_as_one": per_row.clamp(min=1).sum(),
    }[how]
    return total / denominator.clamp(min=1)


def _mean(values: torch.Tensor) -> float:
    """The mean in ``values``' dtype as a Python float (0 for none)."""
    return float(values.mean()) if values.numel() else 0.0


def _fraction(count: int, total: int, dtype: torch.dtype) -> float:
    if not total:
        return 0.0
    if dtype == torch.float64:
        return count / total
    return float(torch.tensor(count, dtype=dtype) / torch.tensor(total, dtype=dtype))
