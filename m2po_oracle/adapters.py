"""Adapters: check ports whose signature differs from the contract, without a user shim.

Each adapter turns a function of one signature family into a contract implementation
and says which fields of the result come from the port (and so are checked) and which
the adapter supplies itself:

* ``mask_only``: ``fn(log_ratio, advantages, mask, tau) -> keep``. The port chooses the
  mask; the adapter builds Algorithm 1's objective on it. Checked: the selection.
* ``mask_function``: ``fn(behavior_logp, proximal_logp, loss_mask, threshold) -> loss_mask``
  (no advantages: every valid token is a candidate in such ports). Checked: the selection.
* ``policy_loss``: ``fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
  config) -> loss`` or ``(loss, ...)``, verl's policy-loss registry shape; the mask is not
  returned, so it is inferred from the gradient: a valid token whose gradient is exactly
  zero was masked. Where a kept token's gradient would be zero too (A == 0, or exp(d) * A
  underflows) the port's choice is unobservable; the core's choice completes the mask
  there. Checked: the inferred selection, the loss and the gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from m2po_oracle.contract import Implementation
from m2po_oracle.core import select_tokens


@dataclass(frozen=True)
class Adapter:
    name: str
    signature: str
    checked: tuple[str, ...]  # fields whose values come from the port
    wrap: Callable[[Implementation], Implementation]
    #: The result fields (``M2POResult`` names) the port itself computes; the diagnosis
    #: compares a variant with the port on these only (the adapter built the rest).
    supplies: frozenset[str] = frozenset({"keep"})


def _objective(logp: torch.Tensor, behavior_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    from m2po_oracle.core import loss_from_selection

    return loss_from_selection(logp, behavior_logp, advantages, keep, mask.sum())


def _as_keep(value: Any, mask: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{what}: expected a tensor, got {type(value).__name__}")
    if tuple(value.shape) != tuple(mask.shape):
        raise ValueError(f"{what}: expected shape {tuple(mask.shape)}, got {tuple(value.shape)}")
    # Masks are often float 0/1 in these ports; a value other than 0/1 is not a mask.
    if value.dtype != torch.bool:
        if not bool(((value == 0) | (value == 1)).all()):
            raise ValueError(f"{what}: expected a bool or 0/1 mask, got values other than 0 and 1")
        value = value != 0
    return value & mask


def _mask_only(fn: Implementation) -> Implementation:
    def implementation(logp, behavior_logp, advantages, mask, *, tau):
        log_ratio = torch.where(mask, logp.detach() - behavior_logp, torch.zeros_like(logp))
        keep = _as_keep(fn(log_ratio, advantages, mask, tau), mask, "keep returned by the mask-only function")
        return {"loss": _objective(logp, behavior_logp, advantages, mask, keep), "keep": keep}
    return implementation


def _mask_function(fn: Implementation) -> Implementation:
    def implementation(logp, behavior_logp, advantages, mask, *, tau):
        keep = _as_keep(fn(behavior_logp, logp.detach(), mask, tau), mask, "loss_mask returned by the mask function")
        return {"loss": _objective(logp, behavior_logp, advantages, mask, keep), "keep": keep}
    return implementation


def policy_loss_config(tau: float) -> SimpleNamespace:
    """The config object handed to a policy-loss function: the budget under the names ports use."""
    return SimpleNamespace(tau=tau, m2_threshold=tau, m2po_tau=tau, clip_ratio=0.2, loss_agg_mode="token-mean")


def _policy_loss(fn: Implementation) -> Implementation:
    def implementation(logp, behavior_logp, advantages, mask, *, tau):
        returned = fn(behavior_logp, logp, advantages, mask.to(logp.dtype), "token-mean", policy_loss_config(tau))
        loss = returned[0] if isinstance(returned, (tuple, list)) else returned
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            raise TypeError("the policy loss: expected a differentiable tensor as the (first) return value")
        (grad,) = torch.autograd.grad(loss, logp, retain_graph=True, allow_unused=True)
        grad = torch.zeros_like(logp) if grad is None else grad
        # A kept token's gradient -exp(d) * A / N is zero too when A == 0 or the product
        # underflows: the port's choice for such a token is unobservable (it changes neither
        # loss nor gradient), so it is completed with the core's choice and not judged.
        with torch.no_grad():
            valid_count = mask.sum().clamp(min=1)
            kept_gradient = torch.where(mask, torch.exp(logp.detach() - behavior_logp) * advantages, torch.zeros_like(logp)) / valid_count
            observable = kept_gradient != 0
            completion = select_tokens(logp.detach(), behavior_logp, advantages, mask, tau=tau).keep if not bool(observable[mask].all()) else mask
        keep = mask & torch.where(observable, grad != 0, completion)
        return {"loss": loss, "keep": keep}
    return implementation


ADAPTERS: dict[str, Adapter] = {
    "mask_only": Adapter("mask_only", "fn(log_ratio, advantages, mask, tau) -> keep", ("selection",), _mask_only),
    "mask_function": Adapter("mask_function", "fn(behavior_logp, proximal_logp, loss_mask, threshold) -> loss_mask", ("selection",), _mask_function),
    "policy_loss": Adapter("policy_loss", "fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config) -> loss | (loss, ...)",
                           ("selection (inferred from zero gradients)", "loss", "gradient"), _policy_loss,
                           frozenset({"keep", "loss", "grad"})),
}


def adapt(fn: Implementation, kind: str | None) -> Implementation:
    if kind is None:
        return fn
    if kind not in ADAPTERS:
        raise ValueError(f"adapter: expected one of {sorted(ADAPTERS)}, got {kind!r}")
    wrapped = ADAPTERS[kind].wrap(fn)
    wrapped.adapter = kind  # type: ignore[attr-defined]  # read back by replay commands
    return wrapped
