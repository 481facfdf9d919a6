"""Diagnosis of a distributed step: which known distributed deviation reproduces it.

Each variant is computed from the batch and the topology alone (never fitted to the
implementation's output) and compared with what every rank returned:

* ``local_shard_selection``: each rank runs Algorithm 1 on its own CP shard of its rows;
* ``local_denominator``: the global mask, but each rank's gradient divided by its own
  shard's valid count;
* ``dp_cp_group_double_count``: selection over the DP x CP group after CP reconstruction,
  i.e. over the batch with every token counted once per CP replica (N and counts x cp).
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np

from m2po_oracle import oracle
from m2po_oracle.distributed.topology import Topology, cp_token_indices
from m2po_oracle.distributed.world import RankOutcome
from m2po_oracle.explain.step_deviations import described
from m2po_oracle.judge.equivalence import compare_values, same_up_to_ties, tolerance, valid_m2
from m2po_oracle.oracle.batch import Batch

DESCRIPTIONS = described("distributed")


#: Variants that keep the optimizer batch's (correct) mask and differ in the denominator.
GLOBAL_MASK_VARIANTS = ("local_denominator", "kept_count_denominator", "cp_shard_counts")


def _shard_columns(batch: Batch, topology: Topology, cp_rank: int) -> np.ndarray:
    return cp_token_indices(batch.shape[1], topology.cp, cp_rank)


def _sub(batch: Batch, rows: slice, columns: np.ndarray | slice = slice(None)) -> Batch:
    pick = lambda a: a[rows][:, columns]  # noqa: E731
    return Batch(pick(batch.logp), pick(batch.behavior_logp), pick(batch.advantages), pick(batch.valid), batch.tau)


def _first_difference(variant: str, batch: Batch, topology: Topology, outcomes: list[RankOutcome], dtype: str) -> str | None:
    grad_tol = tolerance(dtype, "gradient")
    global_result = oracle.m2po(batch)
    n_global = int(batch.valid.sum())
    if variant in GLOBAL_MASK_VARIANTS:
        # Ties at the cut may fall on either rank: the mask is judged assembled, not per rank.
        assembled = np.zeros(batch.shape, dtype=bool)
        for o in outcomes:
            if o.coords.cp == 0 and o.coords.tp == 0:
                assembled[slice(*o.value["rows"])] = o.value["result"].keep
        if not same_up_to_ties(global_result.keep, assembled, valid_m2(batch)):
            return "the assembled mask differs from the global selection beyond ties"
    for o in outcomes:
        result = o.value["result"]
        rows = slice(*o.value["rows"])
        columns = _shard_columns(batch, topology, o.coords.cp)
        local = _sub(batch, rows)
        if variant == "local_shard_selection":
            shard = _sub(batch, rows, columns)
            expected = oracle.m2po(shard)
            d = oracle.log_ratio(shard.logp, shard.behavior_logp, shard.valid)
            if not same_up_to_ties(expected.keep, result.keep[:, columns], np.where(shard.valid, d * d, np.nan)):
                return f"rank {o.rank}: its shard's mask is not Algorithm 1 on the shard alone"
            # ... and its loss divided by the shard's own valid count.
            want = np.zeros(local.shape)
            want[:, columns] = oracle.evaluate_with_mask(shard, result.keep[:, columns]).grad
            if compare_values("diagnosis", "grad", result.grad, want, grad_tol, float(np.abs(want).max(initial=0)) * grad_tol.rtol):
                return f"rank {o.rank}: gradient is not the shard-alone one"
            continue
        if variant == "local_denominator":
            keep = result.keep
            n_local = int(local.valid[:, columns].sum())
            want = np.zeros(local.shape)
            on_shard = oracle.evaluate_with_mask(local, keep)
            assert on_shard.grad is not None  # the oracle's result always has its gradient
            want[:, columns] = on_shard.grad[:, columns] * int(local.valid.sum()) / max(n_local, 1)
            if compare_values("diagnosis", "grad", result.grad, want, grad_tol, float(np.abs(want).max(initial=0)) * grad_tol.rtol):
                return f"rank {o.rank}: gradient is not the shard-local-denominator one"
            continue
        if variant == "per_rank_selection_global_n" and topology.dp == 1:
            return "dp = 1: a rank's rows are the whole batch"
        if variant in ("per_cp_chunk_selection_global_n", "cp_shard_counts") and topology.cp == 1:
            return "cp = 1: a rank's shard is its whole rows"
        if variant in ("per_rank_selection_global_n", "per_cp_chunk_selection_global_n"):
            own = _sub(batch, rows) if variant == "per_rank_selection_global_n" else _sub(batch, rows, columns)
            keep = result.keep if variant == "per_rank_selection_global_n" else result.keep[:, columns]
            d = oracle.log_ratio(own.logp, own.behavior_logp, own.valid)
            if not same_up_to_ties(oracle.m2po(own).keep, keep, np.where(own.valid, d * d, np.nan)):
                return f"rank {o.rank}: its mask is not Algorithm 1 on its own {'rows' if variant == 'per_rank_selection_global_n' else 'CP shard'} alone"
            want = np.zeros(local.shape)
            on_own = (
                cast(np.ndarray, oracle.evaluate_with_mask(own, keep).grad) * int(own.valid.sum()) / max(n_global, 1)
            )  # the oracle's grad is set
            if variant == "per_rank_selection_global_n":
                want[:, columns] = on_own[:, columns]
            else:
                want[:, columns] = on_own
            if compare_values("diagnosis", "grad", result.grad, want, grad_tol, float(np.abs(want).max(initial=0)) * grad_tol.rtol):
                return f"rank {o.rank}: gradient is not its own selection's with the global N"
            continue
        if variant in ("kept_count_denominator", "cp_shard_counts"):
            keep = result.keep
            if variant == "kept_count_denominator":
                denominator = sum(int((r.value["result"].keep).sum()) for r in outcomes if r.coords.cp == 0 and r.coords.tp == 0)
            else:
                denominator = sum(
                    int(_sub(batch, slice(*r.value["rows"]), _shard_columns(batch, topology, o.coords.cp)).valid.sum())
                    for r in outcomes
                    if r.coords.cp == o.coords.cp and r.coords.tp == 0
                )
            want = np.zeros(local.shape)
            want[:, columns] = (
                cast(np.ndarray, oracle.evaluate_with_mask(local, keep).grad)[:, columns] * int(local.valid.sum()) / max(denominator, 1)
            )  # the oracle's grad is set
            if compare_values("diagnosis", "grad", result.grad, want, grad_tol, float(np.abs(want).max(initial=0)) * grad_tol.rtol):
                return f"rank {o.rank}: gradient is not the one with denominator {denominator}"
            continue
        if variant == "dp_cp_group_double_count":
            # Every token appears cp times in the group; valid count and trust-region
            # counts scale by cp, and the global cut is taken over the doubled multiset.
            if topology.cp == 1:
                return "cp = 1: no replica to count twice"
            if result.valid_count is None and result.kept_trust_region_count is None:
                return f"rank {o.rank} reports no counts: a double count cannot be told from its loss alone"
            if result.valid_count is not None and result.valid_count != topology.cp * n_global:
                return f"rank {o.rank}: valid_count {result.valid_count}, the double count is {topology.cp * n_global}"
            # mypy: an unpacked iterable of unknown length may fill every parameter (it holds four here)
            doubled = Batch(  # type: ignore[call-arg]
                *(np.concatenate([a] * topology.cp) for a in (batch.logp, batch.behavior_logp, batch.advantages, batch.valid)),  # type: ignore[arg-type]
                batch.tau,
            )
            expected = oracle.m2po(doubled)
            if result.kept_trust_region_count is not None and result.kept_trust_region_count != expected.kept_trust_region_count:
                return f"rank {o.rank}: kept {result.kept_trust_region_count} trust-region tokens, the double count keeps {expected.kept_trust_region_count}"
            continue
    return None


def diagnose_step(batch: Batch, topology: Topology, outcomes: list[RankOutcome], dtype: str) -> list[dict[str, Any]]:
    """The distributed variants that reproduce this step (empty if none or if a rank failed)."""
    if any(not (o.value or {}).get("result") for o in outcomes):
        return []
    return [
        {
            "variant": name,
            "description": DESCRIPTIONS[name],
            "source": "docs/explanation/algorithm.md §3 / production PR (distributed scope)",
        }
        for name in DESCRIPTIONS
        if _first_difference(name, batch, topology, outcomes, dtype) is None
    ]
