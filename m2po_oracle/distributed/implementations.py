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

import functools
from dataclasses import dataclass, fields
from typing import Any

import torch

from m2po_oracle.adapters import adapt
from m2po_oracle.call.resolve import load_attribute

# The fail-closed control re-enacts the core's old order of steps, so it needs the core's own steps.
from m2po_oracle.core.agreement import validate_across_ranks
from m2po_oracle.core.inputs import check_group, selection_inputs, validate_inputs
from m2po_oracle.core.loss import loss_from_selection, select_micro_batches, select_tokens
from m2po_oracle.core.selection import select_across
from m2po_oracle.distributed.topology import RankCoords, Topology, cp_token_indices
from m2po_oracle.errors import LoadError, closest
from m2po_oracle.judge.contract import parse_impl


@dataclass(frozen=True)
class ParallelState:
    topology: Topology
    coords: RankCoords
    dp_group: Any  # pure data parallel: one rank per CP/TP replica set
    dp_cp_group: Any  # DP x CP: counts CP replicas of reconstructed tensors twice
    cp_group: Any
    tp_group: Any

    @classmethod
    def of_rank(cls, ctx: Any) -> ParallelState:
        """The state a world's rank hands the implementation (``ctx``: its ``RankContext``)."""
        g = ctx.groups
        return cls(ctx.topology, ctx.coords, g["dp"], g["dp_cp"], g["cp"], g["tp"])

    def shard_columns(self, seq_len: int) -> torch.Tensor:
        """Positions of this rank's context-parallel shard (Megatron load balancing)."""
        return torch.from_numpy(cp_token_indices(seq_len, self.topology.cp, self.coords.cp))

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, self.shard_columns(x.shape[1]).to(x.device)]


def _result(selection: Any, keep: torch.Tensor, loss: torch.Tensor) -> dict[str, Any]:
    return {"loss": loss, "keep": keep, **{f.name: getattr(selection, f.name) for f in fields(selection) if f.name != "keep"}}


def _select_then_shard_loss(
    logp, behavior_logp, advantages, mask, *, tau: float, parallel: ParallelState, group: Any, local_denominator: bool = False
) -> dict[str, Any]:
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
    return _select_then_shard_loss(
        logp, behavior_logp, advantages, mask, tau=tau, parallel=parallel, group=parallel.dp_group, local_denominator=True
    )


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
    validate_inputs(logp, behavior_logp, advantages, mask, tau)
    check_group(parallel.dp_group)
    d, a = selection_inputs(logp, behavior_logp, advantages, mask)
    with torch.no_grad():
        selection = select_across(d.reshape(-1), a.reshape(-1), mask.reshape(-1), float(tau), parallel.dp_group)
    keep = selection.keep.reshape(mask.shape)
    loss = loss_from_selection(logp, behavior_logp, advantages, keep, selection.valid_count)
    return {"loss": loss, "keep": keep, **{f.name: getattr(selection, f.name) for f in fields(selection) if f.name != "keep"}}


def micro_batched_core(logp, behavior_logp, advantages, mask, *, tau: float, parallel: ParallelState) -> dict[str, Any]:
    """The core through ``select_micro_batches(..., group=dp_group)``, one micro-batch per
    row: the same agreement must hold when a step is accumulated over micro-batches
    (pure data-parallel worlds: the loss is not CP-sharded)."""
    rows = [tuple(_row(x, i) for x in (logp, behavior_logp, advantages, mask)) for i in range(len(mask))]
    selections = select_micro_batches(rows, tau=tau, group=parallel.dp_group)
    loss = sum(loss_from_selection(*part[:3], s.keep, s.valid_count) for part, s in zip(rows, selections))  # type: ignore[call-arg, misc]  # mypy: an unpacked tuple of unknown length may fill every parameter (it holds three here)
    return {"loss": loss, "keep": torch.cat([s.keep for s in selections])}


def _row(x: Any, i: int) -> Any:
    # A probe's bad argument (None) is passed on as is, for the core to refuse.
    return x[i : i + 1] if isinstance(x, torch.Tensor) else x


def _global_count(count: torch.Tensor, group: Any) -> torch.Tensor:
    import torch.distributed as dist

    total = count.to(torch.float64).reshape(1).clone()
    dist.all_reduce(total, group=group)
    return total.reshape(()).to(torch.int64)


def per_rank_selection_global_n(logp, behavior_logp, advantages, mask, *, tau: float, parallel: ParallelState) -> dict[str, Any]:
    """Control: each DP rank selects over its own rows (no selection collective) but
    divides by the global N; reports no metrics, so only the global selection can see it.
    Fails closed across ranks as the core does: its one deviation is the scope."""
    validate_across_ranks(logp, behavior_logp, advantages, mask, tau=tau, group=parallel.dp_group)
    selection = select_tokens(logp, behavior_logp, advantages, mask, tau=tau)
    n = _global_count(mask.sum(), parallel.dp_group)
    shard = parallel.shard
    loss = loss_from_selection(shard(logp), shard(behavior_logp), shard(advantages), shard(selection.keep), n)
    return {"loss": loss, "keep": selection.keep}


def per_cp_chunk_selection_global_n(logp, behavior_logp, advantages, mask, *, tau: float, parallel: ParallelState) -> dict[str, Any]:
    """Control: each CP rank selects over its own shard of its DP rank's rows, with the
    global N (summed over DP and CP); no metrics. Replicas keep different masks. Fails
    closed across ranks as the core does."""
    validate_across_ranks(logp, behavior_logp, advantages, mask, tau=tau, group=parallel.dp_group)
    shard = parallel.shard
    selection = select_tokens(shard(logp), shard(behavior_logp), shard(advantages), shard(mask), tau=tau)
    keep = mask.clone()
    keep[:, parallel.shard_columns(mask.shape[1])] = selection.keep
    n = _global_count(shard(mask).sum(), parallel.dp_cp_group)
    loss = loss_from_selection(shard(logp), shard(behavior_logp), shard(advantages), selection.keep, n)
    return {"loss": loss, "keep": keep}


def kept_count_denominator(logp, behavior_logp, advantages, mask, *, tau: float, parallel: ParallelState) -> dict[str, Any]:
    """Control: the optimizer batch's mask, but the loss divides by the global kept count
    (valid tokens left after masking) instead of N; no metrics."""
    selection = select_tokens(logp, behavior_logp, advantages, mask, tau=tau, group=parallel.dp_group)
    kept = _global_count(selection.keep.sum(), parallel.dp_group)
    shard = parallel.shard
    loss = loss_from_selection(shard(logp), shard(behavior_logp), shard(advantages), shard(selection.keep), kept)
    return {"loss": loss, "keep": selection.keep}


def cp_shard_counts(logp, behavior_logp, advantages, mask, *, tau: float, parallel: ParallelState) -> dict[str, Any]:
    """Control: the right mask, but N counted on this rank's CP shard and summed over DP
    only (not over CP): too low by a factor cp, in the loss and in valid_count."""
    selection = select_tokens(logp, behavior_logp, advantages, mask, tau=tau, group=parallel.dp_group)
    shard = parallel.shard
    n = _global_count(shard(mask).sum(), parallel.dp_group)
    loss = loss_from_selection(shard(logp), shard(behavior_logp), shard(advantages), shard(selection.keep), n)
    return {"loss": loss, "keep": selection.keep, "valid_count": n}


@dataclass(frozen=True)
class DistributedControl:
    """A planted distributed bug: its implementation, the check that must catch it, and the
    topology it shows on (a CP bug needs cp > 1, a DP bug dp > 1)."""

    name: str  # "control:NAME", as --impl takes it
    fn: Any
    caught_by: str
    topology: str


DISTRIBUTED_CONTROL_RECORDS: tuple[DistributedControl, ...] = (
    # N and the counts double on most batches; replicas diverge only when the cut falls
    # between a token's two copies (the two-rank worked example of algorithm.md §1, tested on its own).
    DistributedControl("control:dp_cp_group_double_count", dp_cp_group_double_count, "distributed.metrics", "dp=2,cp=2,tp=1"),
    DistributedControl("control:local_shard_selection", local_shard_selection, "distributed.global_selection", "dp=2,cp=2,tp=1"),
    DistributedControl("control:local_denominator", local_denominator, "distributed.shard_gradient", "dp=1,cp=2,tp=2"),
    DistributedControl(
        "control:per_rank_selection_global_n", per_rank_selection_global_n, "distributed.global_selection", "dp=2,cp=1,tp=1"
    ),
    DistributedControl(
        "control:per_cp_chunk_selection_global_n",
        per_cp_chunk_selection_global_n,
        "distributed.replica_masks_identical",
        "dp=1,cp=2,tp=1",
    ),
    DistributedControl("control:kept_count_denominator", kept_count_denominator, "distributed.shard_gradient", "dp=2,cp=1,tp=1"),
    # With dp=1 it coincides with local_denominator.
    DistributedControl("control:cp_shard_counts", cp_shard_counts, "distributed.metrics", "dp=2,cp=2,tp=1"),
)

#: Built-in distributed implementations by name: the core, every control, and the ones the
#: collective fail-closed probes (distributed.validation) catch rather than a check.
DISTRIBUTED_BUILTINS: dict[str, Any] = {
    "core": core_distributed,
    **{c.name: c.fn for c in DISTRIBUTED_CONTROL_RECORDS},
    "control:locally_validated_core": locally_validated_core,
    "core:micro_batches": micro_batched_core,
}
#: The check that must catch each control, and the topology each shows on (views of the records).
DISTRIBUTED_CONTROLS: dict[str, str] = {c.name: c.caught_by for c in DISTRIBUTED_CONTROL_RECORDS}
CONTROL_TOPOLOGIES: dict[str, str] = {c.name: c.topology for c in DISTRIBUTED_CONTROL_RECORDS}


@functools.cache
def load_distributed_implementation(spec: str, adapter: tuple[str, tuple[str, ...]] | None = None) -> Any:
    """A built-in distributed implementation by name, or a user's ``module:function``
    (loaded once per process: a rank serves every step with the same function).

    ``adapter``: (name, bindings) of a distributed adapter (``--adapter group``) that turns
    the loaded port into the ``parallel=`` contract."""
    if adapter is not None:
        return adapt(load_distributed_implementation(spec), adapter[0], adapter[1])
    if spec in DISTRIBUTED_BUILTINS:
        return DISTRIBUTED_BUILTINS[spec]
    if parse_impl(spec).kind != "attribute":
        hint = closest(spec, DISTRIBUTED_BUILTINS, otherwise=f"; built-in distributed names: {', '.join(DISTRIBUTED_BUILTINS)}")
        raise LoadError(
            f"impl: unknown distributed implementation {spec!r} (expected a built-in name or module:function taking parallel=){hint}"
        )
    return load_attribute(spec)
