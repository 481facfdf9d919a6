"""Exact M2PO selection without sorting all candidates (torch, any device).

Algorithm 1 keeps the k smallest candidates where k is the longest prefix (ascending M2)
whose mean is <= tau. Prefix means are non-decreasing, so the cut can be located by
radix refinement over the float64 bit patterns of M2 (monotone for non-negative values):
per 16-bit digit, one pass of counts and sums per bucket, the cumulative mean up to each
bucket, and only the bucket where it first exceeds tau is refined. What is left after
four digits (or under ``small`` values) is sorted. Among equal values the lowest indices
are kept, as a stable sort would.
"""

from __future__ import annotations

import sys

import torch

DIGIT_BITS = 16
BUCKETS = 1 << DIGIT_BITS
#: Below this many values, sorting the rest is cheaper than another pass.
SMALL = 4096
#: Where a float64's top 16 bits sit among its four int16 words (3 on little-endian).
_TOP_DIGIT = 3 if sys.byteorder == "little" else None


def kept_candidates(m2: torch.Tensor, tau: float, *, small: int = SMALL) -> torch.Tensor:
    """Bool mask over candidate M2 values (1-d float64, >= 0): Algorithm 1's kept set.

    Keys are M2's own bit patterns (monotone for non-negative floats); per bucket, counts
    and sums give the prefix mean up to each bucket without any sort.
    """
    keys = m2.view(torch.int64)
    subset: torch.Tensor | None = None  # None: all candidates (no gather at level 0)
    kept_sum = torch.zeros((), dtype=torch.float64, device=m2.device)  # of the candidates decided kept
    kept_count = torch.zeros((), dtype=torch.float64, device=m2.device)
    prefix, fixed_bits = 0, 0
    ones = torch.ones((), dtype=torch.float64, device=m2.device)
    for level in range(64 // DIGIT_BITS):
        size = m2.numel() if subset is None else subset.numel()
        if size <= small:
            break
        shift = 64 - DIGIT_BITS * (level + 1)
        sub_keys = keys if subset is None else keys[subset]
        sub_m2 = m2 if subset is None else m2[subset]
        if level == 0 and _TOP_DIGIT is not None:
            # The top 16 bits of each float64, read in place (sign bit 0: no mask needed).
            digit = m2.view(torch.int16)[_TOP_DIGIT::4].to(torch.int64)
        else:
            digit = (sub_keys >> shift) & (BUCKETS - 1)
        empty = torch.zeros(BUCKETS, dtype=torch.float64, device=m2.device)
        sums = torch.cumsum(empty.clone().scatter_add_(0, digit, sub_m2), 0) + kept_sum
        counts = torch.cumsum(empty.scatter_add_(0, digit, ones.expand(size)), 0) + kept_count
        # Prefix means are non-decreasing: the first bucket whose cumulative mean exceeds tau
        # holds the cut. (Sum then divide, as the sorting baseline does: no overflow of tau*count.)
        over = sums / counts > tau
        if not bool(over.any()):  # everything still undecided fits
            return _below(keys, prefix + 1, fixed_bits)
        crossing = int(torch.argmax(over.to(torch.uint8)))
        if crossing:
            kept_sum, kept_count = sums[crossing - 1], counts[crossing - 1]
        prefix = (prefix << DIGIT_BITS) | crossing
        fixed_bits += DIGIT_BITS
        chosen = torch.nonzero(digit == crossing).reshape(-1)
        subset = chosen if subset is None else subset[chosen]
    kept = _below(keys, prefix, fixed_bits)
    rest = torch.arange(m2.numel(), device=m2.device) if subset is None else subset
    values, order = torch.sort(m2[rest], stable=True)
    position = torch.arange(1, values.numel() + 1, device=m2.device, dtype=torch.float64)
    fits = int(((torch.cumsum(values, 0) + kept_sum) / (position + kept_count) <= tau).sum())
    kept[rest[order[:fits]]] = True
    return kept


def _below(keys: torch.Tensor, prefix: int, fixed_bits: int) -> torch.Tensor:
    """Candidates whose top ``fixed_bits`` key bits are < ``prefix``: one comparison."""
    if fixed_bits == 0:
        return torch.full(keys.shape, prefix > 0, dtype=torch.bool, device=keys.device)
    threshold = prefix << (64 - fixed_bits)
    if threshold > torch.iinfo(torch.int64).max:  # above every key (keys are non-negative)
        return torch.ones(keys.shape, dtype=torch.bool, device=keys.device)
    return keys < threshold


def kept_candidates_by_sorting(m2: torch.Tensor, tau: float) -> torch.Tensor:
    """The sort-and-prefix-sum baseline every public port uses (for tests and the benchmark)."""
    values, order = torch.sort(m2, stable=True)
    prefix = torch.cumsum(values, 0) / torch.arange(1, values.numel() + 1, device=m2.device, dtype=values.dtype)
    kept_count = int((prefix <= tau).sum())
    kept = torch.zeros(m2.shape, dtype=torch.bool, device=m2.device)
    kept[order[:kept_count]] = True
    return kept


#: Distributed rounds use narrower digits: each round all-reduces 2 x 2**12 float64 (64 KiB).
GROUP_DIGIT_BITS = 12


def kept_candidates_across(m2: torch.Tensor, tau: float, group: object) -> torch.Tensor:
    """Algorithm 1's kept set over the candidates of every rank of ``group``, without
    moving any candidate: per 12-bit digit, counts and sums per bucket are all-reduced
    (a fixed number of rounds, bytes independent of the token count), the crossing bucket
    is refined until all 64 bits are fixed, and the tied values at the cut are split in
    rank order (one all-gather of one count per rank). Returns this rank's kept mask.
    """
    import torch.distributed as dist

    device = m2.device
    keys = m2.view(torch.int64)
    subset = torch.arange(m2.numel(), device=device)
    kept = torch.zeros(m2.shape, dtype=torch.bool, device=device)
    kept_sum = torch.zeros((), dtype=torch.float64, device=device)
    kept_count = torch.zeros((), dtype=torch.float64, device=device)
    fixed, prefix, tied_total = 0, 0, 0
    while fixed < 64:
        bits = min(GROUP_DIGIT_BITS, 64 - fixed)
        digit = (keys[subset] >> (64 - fixed - bits)) & ((1 << bits) - 1)
        histogram = torch.zeros(2, 1 << bits, dtype=torch.float64, device=device)
        histogram[0].scatter_add_(0, digit, m2[subset])
        histogram[1].scatter_add_(0, digit, torch.ones((), dtype=torch.float64, device=device).expand(subset.numel()))
        dist.all_reduce(histogram, group=group)  # every rank now decides identically
        sums = torch.cumsum(histogram[0], 0) + kept_sum
        counts = torch.cumsum(histogram[1], 0) + kept_count
        over = sums / counts > tau
        if not bool(over.any()):
            kept[subset] = True
            return kept
        crossing = int(torch.argmax(over.to(torch.uint8)))
        if crossing:
            kept_sum, kept_count = sums[crossing - 1], counts[crossing - 1]
        kept[subset[digit < crossing]] = True
        subset = subset[digit == crossing]
        tied_total = int(histogram[1][crossing])
        prefix = (prefix << bits) | crossing
        fixed += bits
    # Every remaining value, on every rank, is the float whose bits are ``prefix``.
    tied = torch.tensor(prefix, dtype=torch.int64).view(torch.float64).to(device)
    r = torch.arange(1, tied_total + 1, dtype=torch.float64, device=device)
    fits = int(((kept_sum + r * tied) / (kept_count + r) <= tau).sum())
    # Ties at the cut go to lower ranks first (then lower indices): one count per rank.
    mine = torch.tensor([subset.numel()], dtype=torch.int64, device=device)
    by_rank = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(by_rank, mine, group=group)
    lower = sum(int(c) for c in by_rank[: dist.get_rank(group)])
    kept[subset[: max(0, min(subset.numel(), fits - lower))]] = True
    return kept


def kept_candidates_across_by_gathering(m2: torch.Tensor, tau: float, group: object) -> torch.Tensor:
    """The all-gather baseline public ports use: every rank receives every candidate's M2
    (bytes grow with the token count), sorts them all, and keeps its share of the cut
    (ties by rank, then index). For the benchmark and cross-checks."""
    import math

    import torch.distributed as dist

    world = dist.get_world_size(group)
    local_sorted, local_order = torch.sort(m2, stable=True)
    count = torch.tensor([m2.numel()], dtype=torch.int64, device=m2.device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    sizes = [int(c.item()) for c in counts]
    # gloo's all_gather needs equal sizes: pad with +inf to the largest rank's count.
    padded = torch.full((max(sizes + [1]),), math.inf, dtype=torch.float64, device=m2.device)
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


def kept_candidates_without_sync(m2: torch.Tensor, tau: float, candidates: torch.Tensor | None = None) -> torch.Tensor:
    """The same kept set with no host synchronisation (for GPUs): every shape is fixed.

    Four levels over the full tensor; "still in the crossing bucket" is a boolean mask
    instead of a gathered subset, and the crossing bucket is chosen on the device. After
    64 bits every value still alive is the same float, so each is kept when its rank among
    them (index order) still fits: ``(kept_sum + rank * v) / (kept_count + rank) <= tau``.
    With ``candidates`` (a bool mask over ``m2``) only those compete and only they can be
    kept, so callers need no ``nonzero`` either.
    """
    device = m2.device
    keys = m2.view(torch.int64)
    alive = torch.ones(m2.shape, dtype=torch.bool, device=device) if candidates is None else candidates.clone()
    kept = torch.zeros(m2.shape, dtype=torch.bool, device=device)
    kept_sum = torch.zeros((), dtype=torch.float64, device=device)
    kept_count = torch.zeros((), dtype=torch.float64, device=device)
    ones = torch.ones((), dtype=torch.float64, device=device).expand(m2.shape)
    for level in range(64 // DIGIT_BITS):
        digit = (keys >> (64 - DIGIT_BITS * (level + 1))) & (BUCKETS - 1)
        # Values no longer alive go to one extra bucket past the end, ignored below.
        bucket = torch.where(alive, digit, torch.full_like(digit, BUCKETS))
        sums = torch.zeros(BUCKETS + 1, dtype=torch.float64, device=device).scatter_add_(0, bucket, m2)[:BUCKETS]
        counts = torch.zeros(BUCKETS + 1, dtype=torch.float64, device=device).scatter_add_(0, bucket, ones)[:BUCKETS]
        cumulative_sum = torch.cumsum(sums, 0) + kept_sum
        cumulative_count = torch.cumsum(counts, 0) + kept_count
        over = cumulative_sum / cumulative_count > tau
        crosses = over.any()
        # No crossing: everything alive fits (crossing = BUCKETS keeps every alive digit).
        crossing = torch.where(crosses, torch.argmax(over.to(torch.uint8)), torch.tensor(BUCKETS, device=device))
        kept |= alive & (digit < crossing)
        below = (crossing - 1).clamp(min=0)
        has_below = crosses & (crossing > 0)
        kept_sum = torch.where(has_below, cumulative_sum[below], kept_sum)
        kept_count = torch.where(has_below, cumulative_count[below], kept_count)
        alive &= (digit == crossing) & crosses
    rank = torch.cumsum(alive.to(torch.float64), 0)
    kept |= alive & ((kept_sum + rank * m2) / (kept_count + rank) <= tau)
    return kept
