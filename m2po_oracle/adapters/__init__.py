"""Adapters: check ports whose signature differs from the contract, without a user shim.

Each family public M2PO code uses is one :class:`Adapter` record in :data:`ADAPTERS`
(:mod:`.families`); ``--bind KEY=VALUE`` (:mod:`.binding`) covers what still differs between
ports of one family (names and order of arguments, where the budget goes, which element of
a returned tuple is the loss or the mask, extra keyword arguments). ``m2po-oracle adapters``
lists every family: its signature, what it reads back and which checks it can run.
"""

from __future__ import annotations

import inspect

from m2po_oracle.adapters.binding import (
    BoundCall,
    Config,
    Output,
    Param,
    describe_signature,
    map_metric_name,
    parse_bindings,
    parse_value,
)
from m2po_oracle.adapters.families import ADAPTERS, Adapter, policy_loss_config
from m2po_oracle.errors import UsageError
from m2po_oracle.judge.contract import Implementation

__all__ = [
    "ADAPTERS",
    "Adapter",
    "BoundCall",
    "Config",
    "Output",
    "Param",
    "adapt",
    "bind",
    "closest_adapters",
    "contract_misfit",
    "map_metric_name",
    "parse_bindings",
    "parse_value",
    "policy_loss_config",
]


def bind(fn: Implementation, kind: str, bindings: tuple[str, ...] | list[str] = ()) -> BoundCall:
    """``fn`` called as adapter ``kind`` and ``bindings`` say; a UsageError naming the port's
    signature when the bindings do not fit it."""
    if kind not in ADAPTERS:
        raise UsageError(f"adapter: expected one of {sorted(ADAPTERS)}, got {kind!r}")
    adapter = ADAPTERS[kind]
    return BoundCall(kind, fn, adapter.params, adapter.outputs, tuple(bindings))


#: The call the contract makes, for messages.
CONTRACT_CALL = "fn(logp, behavior_logp, advantages, mask, *, tau)"


def contract_misfit(fn: Implementation) -> str | None:
    """Why ``fn``'s signature cannot take the contract's call (None: it can, or it cannot be
    inspected): refused when the port is loaded, not after a battery of failed calls."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(None, None, None, None, tau=None)
    except TypeError as error:
        return str(error)
    return None


def closest_adapters(fn: Implementation, most: int = 2) -> list[tuple[str, BoundCall]]:
    """The adapters whose call ``fn``'s signature takes without a binding, those whose
    parameter names it shares most first (a call that fits by position alone fits loosely)."""
    try:
        names = set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []
    fitting = []
    for kind, adapter in ADAPTERS.items():
        if adapter.distributed:
            continue
        try:
            call = bind(fn, kind)
        except UsageError:
            continue
        shared = len(names & {p.name.split(".")[0] for p in adapter.params})
        if shared:
            fitting.append((shared, kind, call))
    fitting.sort(key=lambda t: -t[0])
    # Only the best fits: an adapter that shares fewer names fits by position alone.
    return [(kind, call) for shared, kind, call in fitting[:most] if shared == fitting[0][0]]


def adapt(fn: Implementation, kind: str | None, bindings: tuple[str, ...] | list[str] = ()) -> Implementation:
    """``fn`` as a contract implementation (itself when ``kind`` is None); a UsageError,
    naming the adapters that would fit, when ``fn`` cannot take the contract's call."""
    if kind is None:
        if bindings:
            raise UsageError(
                f"bind: {' '.join(bindings)} shapes an adapter's call; give --adapter NAME too (m2po-oracle adapters lists them)"
            )
        misfit = contract_misfit(fn)
        if misfit is not None:
            close = closest_adapters(fn)
            hint = (
                "; " + "; or ".join(f"try --adapter {k} (it calls {c.describe_call()})" for k, c in close)
                if close
                else "; m2po-oracle adapters lists the other calling conventions (--adapter NAME, --bind ROLE=NAME)"
            )
            raise UsageError(f"impl: {describe_signature(fn)} cannot take the contract's call {CONTRACT_CALL} ({misfit}){hint}")
        return fn
    call = bind(fn, kind, bindings)
    wrapped = ADAPTERS[kind].wrap(call)
    wrapped.adapter = kind  # type: ignore[attr-defined]  # mypy: a function takes no new attributes; read back by replay commands
    wrapped.bound_call = call  # type: ignore[attr-defined]  # as above; the call the port receives, for reports
    return wrapped
