"""Adapters: check ports whose signature differs from the contract, without a user shim.

Each family public M2PO code uses is one :class:`Adapter` record in :data:`ADAPTERS`
(:mod:`.families`); ``--bind KEY=VALUE`` (:mod:`.binding`) covers what still differs between
ports of one family (names and order of arguments, where the budget goes, which element of
a returned tuple is the loss or the mask, extra keyword arguments). ``m2po-oracle adapters``
lists every family: its signature, what it reads back and which checks it can run.
"""

from __future__ import annotations

from m2po_oracle.adapters.binding import BoundCall, Config, Output, Param, map_metric_name, parse_bindings, parse_value
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


def adapt(fn: Implementation, kind: str | None, bindings: tuple[str, ...] | list[str] = ()) -> Implementation:
    """``fn`` as a contract implementation (itself when ``kind`` is None)."""
    if kind is None:
        if bindings:
            raise UsageError(
                f"bind: {' '.join(bindings)} shapes an adapter's call; give --adapter NAME too (m2po-oracle adapters lists them)"
            )
        return fn
    call = bind(fn, kind, bindings)
    wrapped = ADAPTERS[kind].wrap(call)
    wrapped.adapter = kind  # type: ignore[attr-defined]  # mypy: a function takes no new attributes; read back by replay commands
    wrapped.bound_call = call  # type: ignore[attr-defined]  # as above; the call the port receives, for reports
    return wrapped
