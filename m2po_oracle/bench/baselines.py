"""The selections the public ports use, kept as baselines for the benchmark and the tests:
sorting all candidates and taking the longest prefix whose mean is within tau, and, across
ranks, all-gathering every candidate's M2 first. The core never runs them."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def kept_candidates_by_sorting(m2: torch.Tensor, tau: float) -> torch.Tensor:
    """The sort-and-prefix-sum baseline every public port uses (for tests and the benchmark)."""
    values, order = torch.sort(m2, stable=True)
    prefix = torch.cumsum(values, 0) / torch.arange(1, values.numel() + 1, device=m2.device, dtype=values.dtype)
    kept_count = int((prefix <= tau).sum())
    kept = torch.zeros(m2.shape, dtype=torch.bool, device=m2.device)
    kept[order[:kept_count]] = True
    return kept


def kept_candidates_across_by_gathering(m2: torch.Tensor, tau: float, group: ProcessGroup | None) -> torch.Tensor:
    """The all-gather baseline public ports use: every rank receives every candidate's M2
    (bytes grow with the token count), sorts them all, and keeps its share of the cut
    (ties by rank, then index). For the benchmark and cross-checks."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    local_sorted, local_order = torch.sort(m2, stable=True)
    count = torch.tensor([m2.numel()], dtype=torch.int64, device=m2.device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    sizes = [int(c.item()) for c in counts]
    # gloo's all_gather needs equal sizes: pad with +inf to the largest rank's count.
    padded = torch.full((max([*sizes, 1]),), math.inf, dtype=torch.float64, device=m2.device)
    padded[: m2.numel()] = local_sorted
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    values = torch.cat([g[:n] for g, n in zip(gathered, sizes)])
    owners = torch.cat([torch.full((n,), r, dtype=torch.int64, device=m2.device) for r, n in enumerate(sizes)])
    global_sorted, global_order = torch.sort(values, stable=True)
    position = torch.arange(1, global_sorted.numel() + 1, device=m2.device, dtype=torch.float64)
    kept_count = int((torch.cumsum(global_sorted, 0) / position <= tau).sum())
    mine = int((owners[global_order[:kept_count]] == dist.get_rank(group)).sum())
    kept = torch.zeros(m2.shape, dtype=torch.bool, device=m2.device)
    kept[local_order[:mine]] = True
    return kept
