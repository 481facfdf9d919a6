"""A small, self-contained M2PO port for the tutorial (docs/tutorial/).

``m2po_loss`` is Algorithm 1 written directly in torch, the way a framework would port it:
sort the trust-region candidates' M2, keep the longest prefix whose mean is at most tau.
``m2po_loss_kept_mean`` is the same port with one line changed: it divides the loss by the
number of kept tokens instead of N, the valid tokens before masking.

    m2po-oracle compare --impl docs/tutorial/my_port.py:m2po_loss --examples 100
    m2po-oracle compare --impl docs/tutorial/my_port.py:m2po_loss_kept_mean --examples 100
"""

import torch


def _check(logp, behavior_logp, advantages, mask, tau):
    """Refuse invalid input with a ValueError or TypeError naming the argument."""
    if behavior_logp is None:
        raise ValueError("behavior_logp: required (the sampler's log-probs)")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask: expected a bool tensor, got {mask.dtype}")
    if not (logp.shape == behavior_logp.shape == advantages.shape == mask.shape):
        raise ValueError("logp, behavior_logp, advantages, mask: shapes differ")
    for name, value in (("logp", logp), ("behavior_logp", behavior_logp), ("advantages", advantages)):
        if not torch.isfinite(value[mask]).all():
            raise ValueError(f"{name}: NaN or inf on a valid token")
    if not (tau >= 0 and tau != float("inf")):
        raise ValueError(f"tau: expected a finite number >= 0, got {tau!r}")


def _select(logp, behavior_logp, advantages, mask, tau):
    """keep: the valid tokens that Algorithm 1 does not mask (computed in float64)."""
    with torch.no_grad():
        d = torch.where(mask, logp.double() - behavior_logp.double(), 0.0)
        a = torch.where(mask, advantages.double(), 0.0)
        trust = mask & (((a > 0) & (d > 0)) | ((a < 0) & (d < 0)))
        m2 = (d * d)[trust]
        sorted_m2, order = torch.sort(m2, stable=True)
        counts = torch.arange(1, m2.numel() + 1, dtype=torch.float64)
        kept = int((torch.cumsum(sorted_m2, 0) / counts <= tau).sum())  # the prefix means never decrease
        kept_candidates = torch.zeros_like(m2, dtype=torch.bool)
        kept_candidates[order[:kept]] = True
        keep = mask.clone()
        keep[trust] = kept_candidates
    return keep


def _loss(logp, behavior_logp, advantages, keep, denominator):
    zero = torch.zeros_like(logp)
    # torch.where before exp: padding may be NaN or inf and must reach neither the loss nor the gradient.
    ratio = torch.exp(torch.where(keep, logp - behavior_logp, zero))
    return -torch.where(keep, ratio * torch.where(keep, advantages, zero), zero).sum() / denominator


def m2po_loss(logp, behavior_logp, advantages, mask, *, tau):
    _check(logp, behavior_logp, advantages, mask, tau)
    keep = _select(logp, behavior_logp, advantages, mask, tau)
    return {"loss": _loss(logp, behavior_logp, advantages, keep, mask.sum().clamp(min=1)), "keep": keep}


def m2po_loss_kept_mean(logp, behavior_logp, advantages, mask, *, tau):
    _check(logp, behavior_logp, advantages, mask, tau)
    keep = _select(logp, behavior_logp, advantages, mask, tau)
    return {"loss": _loss(logp, behavior_logp, advantages, keep, keep.sum().clamp(min=1)), "keep": keep}
