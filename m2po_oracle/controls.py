"""Negative controls: plausible M2PO ports, each with exactly one planted bug.

Each control is data: a name, the bug, the deviation knob it sets on one parameterised
torch implementation (:func:`planted`), and the checks that name its bug. The suite must
catch every control with one of those checks; a check that catches no control is not yet
a check.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from m2po_oracle.deviations import Deviation, variant


def _candidates(d: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    if how == "trust_region":
        return mask & (((advantages > 0) & (d > 0)) | ((advantages < 0) & (d < 0)))
    if how == "all_valid":
        return mask.clone()
    if how == "swapped_quadrants":
        return mask & (((advantages > 0) & (d < 0)) | ((advantages < 0) & (d > 0)))
    if how == "zero_advantage_included":
        return mask & (((advantages >= 0) & (d > 0)) | ((advantages < 0) & (d < 0)))
    if how == "first_token_sign":
        first = torch.gather(advantages, 1, mask.long().argmax(dim=1, keepdim=True)).expand_as(advantages)
        return mask & (((first > 0) & (d > 0)) | ((first < 0) & (d < 0)))
    raise ValueError(f"candidates: unknown {how!r}")


def _select_flat(m2: torch.Tensor, candidate: torch.Tensor, fixed: torch.Tensor, tau: float, dev: Deviation) -> torch.Tensor:
    """Removed candidates of one selection scope (1-d inputs), by sorted prefix means."""
    key = torch.where(candidate, m2, torch.full_like(m2, math.inf))
    shuffle = torch.randperm(key.numel()) if dev.random_tie_break else torch.arange(key.numel())
    sorted_key, order = torch.sort(key[shuffle], stable=True)
    order = shuffle[order]
    n = int(candidate.sum())
    if n == 0:
        return torch.zeros_like(candidate)
    values = sorted_key[:n]
    k = torch.arange(0, n + 1, dtype=torch.float64)
    fixed_sum = m2[fixed].sum()
    fixed_count = int(fixed.sum())
    sums = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(values, 0)]) + fixed_sum
    counts = k + fixed_count
    means = torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums))
    within = means < tau if dev.strict_stop else means <= tau
    within[0] = True  # an empty remainder is within budget
    kept = int(torch.nonzero(within).max())  # the loop stops at the largest k within budget
    kept = max(kept, min(dev.min_kept, n))
    if kept < n:
        kept = max(kept - dev.extra_removed, 0)
    removed = torch.zeros_like(candidate)
    removed[order[kept:n]] = True
    return removed


def planted(logp: torch.Tensor, behavior_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, tau: float, deviation: Deviation) -> dict[str, Any]:
    """An M2PO implementation with the given deviation (all defaults: Algorithm 1)."""
    dev = deviation
    if dev.sanitise_inputs_in_place:
        advantages.masked_fill_(~mask, 0.0)
    zero = torch.zeros((), dtype=torch.float64)
    sign = -1.0 if dev.ratio_inverted else 1.0
    d = torch.where(mask, sign * (logp.detach().double() - behavior_logp.double()), zero)
    if dev.clamp_log_ratio is not None:
        d = d.clamp(-dev.clamp_log_ratio, dev.clamp_log_ratio)
    a = torch.where(mask, advantages.double(), zero)
    m2 = d * d
    candidate = _candidates(d, a, mask, dev.candidates)
    fixed = (mask & ~candidate) if dev.mean_over_valid else torch.zeros_like(mask)
    step = dev.scope_rows or mask.shape[0]
    scopes = [slice(i, i + step) for i in range(0, mask.shape[0], step)] or [slice(None)]
    removed = torch.zeros_like(mask)
    for rows in scopes:
        flat = _select_flat(m2[rows].reshape(-1), candidate[rows].reshape(-1), fixed[rows].reshape(-1), tau, dev)
        removed[rows] = flat.reshape(m2[rows].shape)
    keep = mask & ~removed

    loss_tokens = keep if dev.apply_mask else mask
    if dev.zero_padding_by_multiplying:
        live_logp, live_behavior, live_advantages = logp, behavior_logp, advantages
    else:  # padding replaced before any arithmetic, so no 0 * nan reaches the backward pass
        live_logp = torch.where(mask, logp, torch.zeros_like(logp))
        live_behavior = torch.where(mask, behavior_logp, torch.zeros_like(behavior_logp))
        live_advantages = torch.where(mask, advantages, torch.zeros_like(advantages))
    d_live = sign * (live_logp - live_behavior)
    if dev.clamp_log_ratio is not None:  # straight-through: clamped value, unclamped gradient
        d_live = d_live + (d_live.clamp(-dev.clamp_log_ratio, dev.clamp_log_ratio) - d_live).detach()
    ratio = torch.exp(d_live)
    if dev.ppo_clip is not None:
        clipped = ratio.clamp(1 - dev.ppo_clip, 1 + dev.ppo_clip)
        term = torch.minimum(ratio * live_advantages, clipped * live_advantages)
    else:
        term = ratio * live_advantages
    if dev.masked_keep_value:
        term = torch.where(keep, term, term.detach())
        loss_tokens = mask
    if dev.zero_padding_by_multiplying:
        total = (loss_tokens.to(term.dtype) * term).sum()
    else:
        total = torch.where(loss_tokens, term, torch.zeros_like(term)).sum()
    denominator = {"valid": mask.sum(), "kept": keep.sum(), "padded": torch.tensor(mask.numel())}[dev.denominator]
    loss = -total / denominator.clamp(min=1)

    trust = _candidates(d, a, mask, "trust_region")
    kept_trust = trust & keep
    after_tokens = keep if dev.m2_after_over_valid else kept_trust
    valid_count = int(mask.sum())
    return {
        "loss": loss,
        "keep": keep,
        "m2_before": float(m2[trust].mean()) if trust.any() else 0.0,
        "m2_after": float(m2[after_tokens].mean()) if after_tokens.any() else 0.0,
        "masked_fraction": int((mask & ~keep).sum()) / valid_count if valid_count else 0.0,
        "trust_region_fraction": int(trust.sum()) / valid_count if valid_count else 0.0,
        "valid_count": valid_count,
        "trust_region_count": int(trust.sum()),
        "kept_trust_region_count": int(kept_trust.sum()),
    }


@dataclass(frozen=True)
class NegativeControl:
    name: str
    bug: str
    deviation: Deviation
    caught_by: tuple[str, ...]  # checks that name this bug; the first is the primary one
    fn: Callable[..., Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "fn", partial(planted, deviation=self.deviation))


def _control(name: str, caught_by: tuple[str, ...]) -> NegativeControl:
    """A control plants exactly the deviation of the diagnosis variant of the same name."""
    known = variant(name)
    return NegativeControl(name, known.description, known.deviation, caught_by)


NEGATIVE_CONTROLS: tuple[NegativeControl, ...] = (
    _control("all_valid_candidates", ("selection.only_trust_region_masked", "metrics.masked_fraction", "selection.budget")),
    _control("swapped_quadrants", ("selection.only_trust_region_masked", "selection.budget")),
    _control("zero_advantage_candidate", ("selection.only_trust_region_masked",)),
    _control("first_token_advantage_sign", ("selection.only_trust_region_masked", "selection.budget", "selection.minimal", "selection.largest_removed_first")),
    _control("strict_stop", ("selection.minimal",)),
    _control("mean_over_valid", ("selection.budget", "selection.minimal")),
    _control("per_sequence_selection", ("selection.minimal", "selection.largest_removed_first")),
    _control("one_extra_removed", ("selection.minimal",)),
    _control("kept_count_denominator", ("loss", "gradient")),
    _control("padded_denominator", ("loss", "gradient")),
    _control("ppo_clip_still_applied", ("gradient", "loss")),
    # Inverting the ratio swaps the trust region: every selection and trust-region metric can show it.
    _control("ratio_inverted", ("selection.only_trust_region_masked", "selection.budget", "selection.minimal", "selection.largest_removed_first",
                                "loss", "gradient", "metrics.m2_before", "metrics.m2_after", "metrics.masked_fraction",
                                "metrics.trust_region_fraction", "metrics.trust_region_count", "metrics.kept_trust_region_count")),
    _control("mask_not_applied", ("gradient", "loss")),
    _control("masked_keep_value", ("loss",)),
    _control("nan_padding_leak", ("padding_immunity",)),
    _control("clamped_log_ratio", ("gradient", "loss", "metrics.m2_before", "metrics.m2_after", "selection.budget", "selection.minimal",
                                   "selection.largest_removed_first")),
    _control("mutates_inputs", ("inputs_not_mutated",)),
    _control("m2_after_over_valid", ("metrics.m2_after",)),
    _control("random_tie_break", ("determinism",)),
)


def control(name: str) -> NegativeControl:
    for c in NEGATIVE_CONTROLS:
        if c.name == name:
            return c
    raise ValueError(f"control: unknown name {name!r}; known: {', '.join(c.name for c in NEGATIVE_CONTROLS)}")
