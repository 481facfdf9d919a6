"""One optimizer step put back together from every rank's records: TP replicas once, CP
shards back into sequences (the Megatron layout), DP ranks' micro-batches joined; and
Algorithm 1 on it, computed once per step."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from m2po_oracle import oracle
from m2po_oracle.audit.records import MicroBatch, Unusable
from m2po_oracle.distributed.topology import Topology, cp_token_indices
from m2po_oracle.judge import equivalence
from m2po_oracle.oracle.batch import Batch


@dataclass
class AuditStep:
    step: int
    topology: Topology
    records: list[MicroBatch]  # every rank's
    replica_set: list[MicroBatch]  # TP rank 0's: one record per (dp, cp, micro-batch)
    batch: Batch  # the loss pass's log-probs
    selection_batch: Batch  # the selection's log-probs (the loss pass's where not recorded)
    keep: np.ndarray
    blocks: dict[tuple[int, int], slice]  # (dp, micro-batch) -> its rows
    micro_batches: dict[int, int]  # dp rank -> k
    dtype: str

    # Computed once per step and shared by the checks, the diagnosis and the worst step's table.

    @functools.cached_property
    def algorithm_1(self) -> dict[str, Any]:
        """Algorithm 1's keep and metrics on the log-probs the selection saw."""
        return algorithm_1_of(self.selection_batch)

    @functools.cached_property
    def expected(self) -> Any:
        """The oracle's loss and gradient on the run's own mask (the loss pass's log-probs)."""
        return oracle.evaluate_with_mask(self.batch, self.keep)

    @functools.cached_property
    def selected(self) -> Any:
        """The oracle's metrics and counts on the run's own mask, from the log-probs the selection saw."""
        return self.expected if self.selection_batch.logp is self.batch.logp else oracle.evaluate_with_mask(self.selection_batch, self.keep)

    def rows_alone(self, group: list[MicroBatch]) -> tuple[Batch, np.ndarray]:
        """The selection's batch and the run's keep on the whole rows of ``group`` (every CP shard of them)."""
        index = np.concatenate([np.arange(r.rows.start, r.rows.stop) for r in group if r.coords.cp == 0])
        s = self.selection_batch
        return Batch(s.logp[index], s.behavior_logp[index], s.advantages[index], s.valid[index], s.tau), self.keep[index]


def _non_finite_on_valid(record: MicroBatch) -> str | None:
    for name in ("logp", "behavior_logp", "advantages", "selection_logp", "rollout_logp"):
        values = getattr(record, name)
        if values is None:
            continue
        bad = record.mask & ~np.isfinite(values)
        if bad.any():
            first = tuple(int(i) for i in np.argwhere(bad)[0])
            return f"{record.where}: {name} is {values[first].item()!r} on a valid token at {list(first)} ({int(bad.sum())} such token(s))"
    return None


def assemble(step: int, topology: Topology, records: list[MicroBatch]) -> AuditStep:
    cp = topology.cp
    by_place = {(r.coords.dp, r.coords.cp, r.coords.tp, r.micro_batch): r for r in records}
    micro_batches: dict[int, int] = {}
    for dp in range(topology.dp):
        counts = {
            (c, t): 1 + max((mb for (d, cc, tt, mb) in by_place if (d, cc, tt) == (dp, c, t)), default=-1)
            for c in range(cp)
            for t in range(topology.tp)
        }
        if len(set(counts.values())) > 1:
            said = ", ".join(f"rank {topology.rank(dp=dp, cp=c, tp=t)}: {k}" for (c, t), k in sorted(counts.items()))
            raise Unusable(
                f"the ranks of DP rank {dp} recorded different numbers of micro-batches ({said}); "
                f"its CP and TP ranks must record the same micro-batches"
            )
        micro_batches[dp] = next(iter(counts.values()))
    for record in records:
        why = _non_finite_on_valid(record)
        if why:
            raise Unusable(f"non-finite input: {why}")

    replica_set = [r for r in records if r.coords.tp == 0]
    blocks: dict[tuple[int, int], slice] = {}
    widths: dict[tuple[int, int], int] = {}
    start = 0
    for dp in range(topology.dp):
        for mb in range(micro_batches[dp]):
            shards = [by_place[(dp, c, 0, mb)] for c in range(cp)]
            shapes = {s.logp.shape for s in shards}
            if len(shapes) > 1:
                said = ", ".join(f"rank {s.rank}: {list(s.logp.shape)}" for s in shards)
                raise Unusable(
                    f"the CP shards of DP rank {dp} micro-batch {mb} disagree in shape ({said}); "
                    f"every CP rank holds the same rows and an equal share of each sequence"
                )
            rows, width = shards[0].logp.shape
            if cp > 1 and width % 2:
                raise Unusable(
                    f"DP rank {dp} micro-batch {mb}: a CP shard of width {width} cannot hold two equal chunks "
                    f"(the Megatron layout: 2 * cp chunks per sequence)"
                )
            blocks[(dp, mb)] = slice(start, start + rows)
            widths[(dp, mb)] = width * cp
            start += rows
    width = max(widths.values(), default=0)
    separate_selection = any(r.selection_logp is not None for r in replica_set)
    logp, behavior, advantages = (np.zeros((start, width)) for _ in range(3))
    selection = np.zeros((start, width)) if separate_selection else logp  # no prepass recorded: the same array
    valid, keep = np.zeros((start, width), bool), np.zeros((start, width), bool)
    for record in replica_set:
        key = (record.coords.dp, record.micro_batch)
        record.rows = blocks[key]
        # A slice where it can be one: a fancy-index scatter of 16M float64 costs 0.3-0.6 s, a slice 0.02 s.
        record.columns = slice(0, widths[key]) if cp == 1 else cp_token_indices(widths[key], cp, record.coords.cp)
        at = (record.rows, record.columns)
        sources = [
            (logp, record.logp),
            (behavior, record.behavior_logp),
            (advantages, record.advantages),
            (valid, record.mask),
            (keep, record.keep),
        ]
        if separate_selection:
            sources.append((selection, record.logp if record.selection_logp is None else record.selection_logp))
        for target, source in sources:
            target[at] = source
    for record in records:  # TP replicas sit where their TP rank 0 sits
        twin = by_place[(record.coords.dp, record.coords.cp, 0, record.micro_batch)]
        record.rows, record.columns = twin.rows, twin.columns
    taus = {r.tau for r in records}
    if len(taus) > 1:
        raise Unusable(f"the records of this step disagree on tau: {sorted(taus)}")
    tau = records[0].tau
    if not math.isfinite(tau) or tau < 0:
        raise Unusable(f"tau {tau!r} is not a finite number >= 0")
    dtype = records[0].dtype if records[0].dtype in equivalence.FORMATS else "float32"
    return AuditStep(
        step,
        topology,
        records,
        replica_set,
        Batch(logp, behavior, advantages, valid, tau),
        Batch(selection, behavior, advantages, valid, tau),
        keep,
        blocks,
        micro_batches,
        dtype,
    )


def algorithm_1_of(batch: Batch) -> dict[str, Any]:
    """Algorithm 1's keep and metrics on ``batch`` (``oracle.m2po`` without its loss and gradient,
    which cost half its time at 16M tokens and are not needed here)."""
    d = oracle.log_ratio(batch.logp, batch.behavior_logp, batch.valid)
    m2 = oracle.second_moment(d)
    trust = oracle.trust_region(d, batch.advantages, batch.valid)
    keep = batch.valid & ~oracle.select_sorted(m2, trust, batch.tau)
    return {"keep": keep, **oracle.metrics(m2, trust, keep, batch.valid)}


def scope_groups(step: AuditStep) -> dict[str, list[list[MicroBatch]]]:
    """The regions each scope deviation selects over, where that scope differs from the others."""
    by_block: dict[tuple[int, int], list[MicroBatch]] = {}
    by_dp: dict[int, list[MicroBatch]] = {}
    for r in step.replica_set:
        by_block.setdefault((r.coords.dp, r.micro_batch), []).append(r)
        by_dp.setdefault(r.coords.dp, []).append(r)
    groups: dict[str, list[list[MicroBatch]]] = {}
    if any(k > 1 for k in step.micro_batches.values()):
        groups["per_micro_batch_mask"] = list(by_block.values())
    if step.topology.dp > 1:
        groups["per_rank_selection_global_n"] = list(by_dp.values())
    if step.topology.cp > 1:
        groups["per_cp_shard"] = [[r] for r in step.replica_set]
    return groups
