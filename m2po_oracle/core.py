"""The production M2PO loss in torch: vectorised, device-agnostic, fail-closed.

Selection arithmetic (log ratio, M2, prefix means) runs in float64 whatever the input
dtype; the objective runs in at least float32. Follows the implementation contract
(``m2po_oracle.contract``): ``m2po_loss(logp, behavior_logp, advantages, mask, *, tau)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class CoreResult:
    """``loss`` is 0-d and differentiable w.r.t. ``logp``; ``keep`` is bool like ``logp``.

    Metrics are 0-d float64 tensors and counts 0-d int64 tensors, on the input device, so
    that reading them never forces a host synchronisation inside the training step.
    """

    loss: torch.Tensor
    keep: torch.Tensor
    m2_before: torch.Tensor
    m2_after: torch.Tensor
    masked_fraction: torch.Tensor
    trust_region_fraction: torch.Tensor
    valid_count: torch.Tensor
    trust_region_count: torch.Tensor
    kept_trust_region_count: torch.Tensor


def _validate(logp, behavior_logp, advantages, mask, tau) -> None:
    if behavior_logp is None:
        raise ValueError(
            "behavior_logp: required (the rollout engine's log-probs of the sampled tokens); "
            "M2PO fails closed rather than fall back to a recomputed policy"
        )
    tensors = {"logp": logp, "behavior_logp": behavior_logp, "advantages": advantages, "mask": mask}
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    for name in ("behavior_logp", "advantages", "mask"):
        if tensors[name].shape != logp.shape:
            raise ValueError(f"{name}: expected shape {tuple(logp.shape)} (the shape of logp), got {tuple(tensors[name].shape)}")
        if tensors[name].device != logp.device:
            raise ValueError(f"{name}: expected device {logp.device} (the device of logp), got {tensors[name].device}")
    for name in ("logp", "behavior_logp", "advantages"):
        if tensors[name].dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name}: expected a floating dtype (float64/32, bfloat16, float16), got {tensors[name].dtype}")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask: expected dtype torch.bool, got {mask.dtype} (convert explicitly, e.g. mask.bool())")
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) or tau < 0:
        raise ValueError(f"tau: expected a finite Python number >= 0, got {tau!r}")
    for name in ("logp", "behavior_logp", "advantages"):
        values = tensors[name].detach()
        bad = mask & ~torch.isfinite(values)
        if bool(bad.any()):
            index = tuple(int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"{name}: expected finite values on valid tokens (mask True), "
                f"got {values[index].item()} at index {index} ({int(bad.sum())} such tokens)"
            )


def select(d: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, tau: float):
    """Algorithm 1's selection on detached float64 inputs (padding already zeroed).

    Returns ``(keep, trust_region, m2)``. Sorts candidates' M2 ascending and keeps the
    longest prefix whose mean is <= tau; non-candidates sort last as +inf.
    """
    trust = mask & (((advantages > 0) & (d > 0)) | ((advantages < 0) & (d < 0)))
    m2 = d * d
    flat_trust = trust.reshape(-1)
    sort_key = torch.where(flat_trust, m2.reshape(-1), torch.full_like(m2.reshape(-1), math.inf))
    sorted_m2, order = torch.sort(sort_key, stable=True)
    candidate_count = flat_trust.sum()
    position = torch.arange(1, sorted_m2.numel() + 1, device=d.device)
    prefix_sum = torch.cumsum(torch.where(position <= candidate_count, sorted_m2, torch.zeros_like(sorted_m2)), 0)
    within_budget = (prefix_sum / position <= tau) & (position <= candidate_count)
    kept_count = within_budget.sum()
    kept_sorted = position <= kept_count
    removed = torch.zeros_like(flat_trust)
    removed[order] = ~kept_sorted & (position <= candidate_count)
    keep = mask & ~removed.reshape(mask.shape)
    return keep, trust, m2


def m2po_loss(
    logp: torch.Tensor,
    behavior_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    tau: float = 0.04,
) -> CoreResult:
    """M2PO loss for one optimizer batch (Algorithm 1).

    ``loss = -(1/N) * sum(keep * exp(logp - behavior_logp) * advantages)`` with N the valid
    token count before masking. Values at positions where ``mask`` is False may be NaN or
    inf: they reach neither the loss nor its gradient.
    """
    _validate(logp, behavior_logp, advantages, mask, tau)
    zero = torch.zeros((), dtype=torch.float64, device=logp.device)
    d_selection = torch.where(mask, logp.detach().double() - behavior_logp.double(), zero)
    advantages_selection = torch.where(mask, advantages.double(), zero)
    with torch.no_grad():
        keep, trust, m2 = select(d_selection, advantages_selection, mask, float(tau))

    compute_dtype = torch.float64 if logp.dtype == torch.float64 else torch.float32
    valid_count = mask.sum()
    # where() routes gradient only to kept tokens, so padding NaN/inf never meets a zero
    # weight in the backward pass (0 * nan would poison the gradient).
    logp_kept = torch.where(keep, logp.to(compute_dtype), torch.zeros((), dtype=compute_dtype, device=logp.device))
    behavior_kept = torch.where(keep, behavior_logp.detach().to(compute_dtype), torch.zeros_like(logp_kept))
    advantages_kept = torch.where(keep, advantages.detach().to(compute_dtype), torch.zeros_like(logp_kept))
    objective_sum = (torch.exp(logp_kept - behavior_kept) * advantages_kept).sum()
    loss = -objective_sum / valid_count.clamp(min=1).to(compute_dtype)

    with torch.no_grad():
        trust_count = trust.sum()
        kept_trust = trust & keep
        kept_trust_count = kept_trust.sum()
        valid_denominator = valid_count.clamp(min=1).double()
        result = CoreResult(
            loss=loss,
            keep=keep,
            m2_before=torch.where(trust, m2, zero).sum() / trust_count.clamp(min=1),
            m2_after=torch.where(kept_trust, m2, zero).sum() / kept_trust_count.clamp(min=1),
            masked_fraction=(trust_count - kept_trust_count).double() / valid_denominator,
            trust_region_fraction=trust_count.double() / valid_denominator,
            valid_count=valid_count,
            trust_region_count=trust_count,
            kept_trust_region_count=kept_trust_count,
        )
    return result
