"""Distributed implementations under test: the core's reference adapter and controls.

The distributed contract: every rank calls

    fn(logp, behavior_logp, advantages, mask, *, tau, parallel) -> result

with the rows of its data-parallel shard as full, context-parallel-reconstructed
sequences (so CP and TP ranks hold replicas), and ``parallel`` (:class:`ParallelState`)
giving the process groups and this rank's CP shard. ``result`` is the single-process
contract's: ``keep`` over the rank's full rows (identical on replicas), ``loss`` this
rank's share, built from its CP shard tokens only (the shares of one replica set sum to
the global loss), metrics optional.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

# The fail-closed control re-enacts the core's old order of steps, so it needs the core's private steps.
from m2po_oracle.core import _check_group, _select_flat, _selection_inputs, _validate, loss_from_selection, select_micro_batches, select_tokens
from m2po_oracle.distributed.topology import RankCoords, Topology, cp_token_indices


@dataclass(frozen=True)
class ParallelState:
    topology: Topology
    coords: RankCoords
    dp_group: Any  # pure data parallel: one rank per CP/TP replica set
    dp_cp_group: Any  # DP x CP: counts CP replicas of reconstructed tensors twice
    cp_group: Any
    tp_group: Any

    def shard_columns(self, seq_len: int) -> torch.Tensor:
        """Positions of this rank's context-parallel shard (Megatron load balancing)."""
        return torch.from_numpy(cp_token_indices(seq_len, self.topology.cp, self.coords.cp))

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, self.shard_columns(x.shape[1]).to(x.device)]


def _result(selection: Any, keep: torch.Tensor, loss: torch.Tensor) -> dict[str, Any]:
    return {"loss": loss, "keep": keep, **{f.name: getattr(selection, f.name) for f in fields(selection) if f.name != "keep"}}


def _select_then_shard_loss(logp, behavior_logp, advantages, mask, *, tau: float, parallel: ParallelState, group: Any,
                            local_denominator: bool = False) -> dict[str, Any]:
    """Select on the reconstructed tensors over ``group``, then this rank's CP-shard loss
    (with the selection's N, or with the shard's own valid count)."""
    selection = select_tokens(logp, behavior_logp, advantages, mask, tau=tau, group=group)
    shard = parallel.shard
    denominator = shard(mask).sum() if local_denominator else selection.valid_count
    loss = loss_from_selection(shard(logp), shard(behavior_logp), shard(advantages), shard(selection.keep), denominator)
    return _result(selection, selection.keep, loss)


def core_distributed(logp, behavior_logp, advantages, mask, *, tau: float, parallel: ParallelState) -> dict[str, Any]:
    """The core, as a Megatron trainer calls it: select over the pure DP group on the
    reconstructed tensors, then the loss of this rank's CP shard with the global N."""
    return _select_then_shard_loss(logp, behavior_logp, advantages, mask, tau=tau, parallel=parallel, group=parallel.dp_group)


def dp_cp_group_double_count(logp, behavior_logp, advantages, mask, *, tau: float, parallel: ParallelState) -> dict[str, Any]:
    """Control: selects over the DP x CP group after CP reconstruction (the production
    port's earlier head): every token is counted once per CP replica."""
    return _select_then_shard_loss(logp, behavior_logp, advantages, mask, tau=tau, parallel=parallel, group=parallel.dp_cp_group)


def local_denominator(logp, behavior_logp, advantages, mask, *, tau: float, parallel: ParallelState) -> dict[str, Any]:
    """Control: the right global mask, but the loss divides by this rank's own valid count."""
    return _select_then_shard_loss(logp, behavior_logp, advantages, mask, tau=tau, parallel=parallel, group=parallel.dp_group,
                                   local_denominator=True)


def local_shard_selection(logp, behavior_logp, advantages, mask, *, tau: float, parallel: ParallelState) -> dict[str, Any]:
    """Control: each rank selects over its own CP shard only, without communication."""
    shard = parallel.shard
    selection = select_tokens(shard(logp), shard(behavior_logp), shard(advantages), shard(mask), tau=tau)
    keep = torch.zeros_like(mask)
    keep[:, parallel.shard_columns(mask.shape[1])] = selection.keep
    loss = loss_from_selection(shard(logp), shard(behavior_logp), shard(advantages), selection.keep, selection.valid_count)
    return _result(selection, keep, loss)


def locally_validated_core(logp, behavior_logp, advantages, mask, *, tau: float, parallel: ParallelState) -> dict[str, Any]:
    """Control: the core as it was before the agreement, validating on its own rank and
    then entering the collective selection (a bad rank raises, its peers wait)."""
    _validate(logp, behavior_logp, advantages, mask, tau)
    _check_group(parallel.dp_group)
    d, a = _selection_inputs(logp, behavior_logp, advantages, mask)
    with torch.no_grad():
        selection = _select_flat(d.reshape(-1), a.reshape(-1), mask.reshape(-1), float(tau), parallel.dp_group)
    keep = selection.keep.reshape(mask.shape)
    loss = loss_from_selection(logp, behavior_logp, advantages, keep, selection.valid_count)
    return {"loss": loss, "keep": keep, **{f.name: getattr(selection, f.name) for f in fields(selection) if f.name != "keep"}}


def micro_batched_core(logp, behavior_logp, advantages, mask, *, tau: float, parallel: ParallelState) -> dict[str, Any]:
    """The core through ``select_micro_batches(..., group=dp_group)``, one micro-batch per
    row: the same agreement must hold when a step is accumulated over micro-batches
    (pure data-parallel worlds: the loss is not CP-sharded)."""
    rows = [tuple(_row(x, i) for x in (logp, behavior_logp, advantages, mask)) for i in range(len(mask))]
    selections = select_micro_batches(rows, tau=tau, group=parallel.dp_group)
    loss = sum(loss_from_selection(*part[:3], s.keep, s.valid_count) for part, s in zip(rows, selections))
    return {"loss": loss, "keep": torch.cat([s.keep for s in selections])}


def _row(x: Any, i: int) -> Any:
    # A probe's bad argument (None) is passed on as is, for the core to refuse.
    return x[i:i + 1] if isinstance(x, torch.Tensor) else x



#: Built-in distributed implementations by name, with the check that must catch each control.
DISTRIBUTED_BUILTINS: dict[str, Any] = {
    "core": core_distributed,
    "control:dp_cp_group_double_count": dp_cp_group_double_count,
    "control:local_shard_selection": local_shard_selection,
    "control:local_denominator": local_denominator,
    # Caught by the collective fail-closed probes (distributed.validation), not by a check.
    "control:locally_validated_core": locally_validated_core,
    "core:micro_batches": micro_batched_core,
}
DISTRIBUTED_CONTROLS: dict[str, str] = {
    # N and the counts double on most batches; replicas diverge only when the cut falls
    # between a token's two copies (the spec's two-rank example, tested on its own).
    "control:dp_cp_group_double_count": "distributed.metrics",
    "control:local_shard_selection": "distributed.global_selection",
    "control:local_denominator": "distributed.shard_gradient",
}


def load_distributed_implementation(spec: str) -> Any:
    """A built-in distributed implementation by name, or a user's ``module:function``."""
    if spec in DISTRIBUTED_BUILTINS:
        return DISTRIBUTED_BUILTINS[spec]
    import difflib

    from m2po_oracle.resolve import load_attribute
    from m2po_oracle.errors import LoadError

    if ":" not in spec or spec.startswith("control:"):
        close = difflib.get_close_matches(spec, DISTRIBUTED_BUILTINS, n=3, cutoff=0.5)
        hint = f"closest matches: {', '.join(close)}" if close else f"built-in distributed names: {', '.join(DISTRIBUTED_BUILTINS)}"
        raise LoadError(f"impl: unknown distributed implementation {spec!r} (expected a built-in name or module:function taking parallel=); {hint}")
    return load_attribute(spec)
