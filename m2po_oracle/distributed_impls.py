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

from dataclasses import dataclass
from typing import Any

import torch

from m2po_oracle.core import loss_from_selection, select_tokens
from m2po_oracle.topology import RankCoords, Topology, cp_token_indices


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


def _metrics(selection: Any) -> dict[str, Any]:
    return {f: getattr(selection, f) for f in ("m2_before", "m2_after", "masked_fraction", "trust_region_fraction", "valid_count",
                                               "trust_region_count", "kept_trust_region_count")}


def core_distributed(logp, behavior_logp, advantages, mask, *, tau: float, parallel: ParallelState) -> dict[str, Any]:
    """The core, as a Megatron trainer calls it: select over the pure DP group on the
    reconstructed tensors, then the loss of this rank's CP shard with the global N."""
    selection = select_tokens(logp, behavior_logp, advantages, mask, tau=tau, group=parallel.dp_group)
    shard = parallel.shard
    loss = loss_from_selection(shard(logp), shard(behavior_logp), shard(advantages), shard(selection.keep), selection.valid_count)
    return {"loss": loss, "keep": selection.keep, **_metrics(selection)}


def dp_cp_group_double_count(logp, behavior_logp, advantages, mask, *, tau: float, parallel: ParallelState) -> dict[str, Any]:
    """Control: selects over the DP x CP group after CP reconstruction (the production
    port's earlier head): every token is counted once per CP replica."""
    selection = select_tokens(logp, behavior_logp, advantages, mask, tau=tau, group=parallel.dp_cp_group)
    shard = parallel.shard
    loss = loss_from_selection(shard(logp), shard(behavior_logp), shard(advantages), shard(selection.keep), selection.valid_count)
    return {"loss": loss, "keep": selection.keep, **_metrics(selection)}


def local_shard_selection(logp, behavior_logp, advantages, mask, *, tau: float, parallel: ParallelState) -> dict[str, Any]:
    """Control: each rank selects over its own CP shard only, without communication."""
    shard = parallel.shard
    selection = select_tokens(shard(logp), shard(behavior_logp), shard(advantages), shard(mask), tau=tau)
    keep = torch.zeros_like(mask)
    keep[:, parallel.shard_columns(mask.shape[1])] = selection.keep
    loss = loss_from_selection(shard(logp), shard(behavior_logp), shard(advantages), selection.keep, selection.valid_count)
    return {"loss": loss, "keep": keep, **_metrics(selection)}


def local_denominator(logp, behavior_logp, advantages, mask, *, tau: float, parallel: ParallelState) -> dict[str, Any]:
    """Control: the right global mask, but the loss divides by this rank's own valid count."""
    selection = select_tokens(logp, behavior_logp, advantages, mask, tau=tau, group=parallel.dp_group)
    shard = parallel.shard
    local_n = shard(mask).sum()
    loss = loss_from_selection(shard(logp), shard(behavior_logp), shard(advantages), shard(selection.keep), local_n)
    return {"loss": loss, "keep": selection.keep, **_metrics(selection)}


#: Built-in distributed implementations by name, with the check that must catch each control.
DISTRIBUTED_BUILTINS: dict[str, Any] = {
    "core": core_distributed,
    "control:dp_cp_group_double_count": dp_cp_group_double_count,
    "control:local_shard_selection": local_shard_selection,
    "control:local_denominator": local_denominator,
}
DISTRIBUTED_CONTROLS: dict[str, str] = {
    # N and the counts double on most batches; replicas diverge only when the cut falls
    # between a token's two copies (the spec's two-rank example, tested on its own).
    "control:dp_cp_group_double_count": "distributed.metrics",
    "control:local_shard_selection": "distributed.global_selection",
    "control:local_denominator": "distributed.shard_gradient",
}


def load_distributed_implementation(spec: str) -> Any:
    if spec in DISTRIBUTED_BUILTINS:
        return DISTRIBUTED_BUILTINS[spec]
    from m2po_oracle.contract import load_implementation

    return load_implementation(spec)
