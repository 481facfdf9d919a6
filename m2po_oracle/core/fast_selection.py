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

import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

import torch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

DIGIT_BITS = 16
BUCKETS = 1 << DIGIT_BITS
#: Below this many values, sorting the rest is cheaper than another pass.
SMALL = 4096
#: Where a float64's top 16 bits sit among its four int16 words (3 on little-endian).
_TOP_DIGIT = 3 if sys.byteorder == "little" else None


class _Float64(TypedDict):
    """The keyword arguments of a float64 tensor on one device (``torch.zeros(n, **f64)``)."""

    dtype: torch.dtype
    device: torch.device | str


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


#: Distributed rounds use narrower digits: each round all-reduces 2 x 2**12 float64 (64 KiB).
GROUP_DIGIT_BITS = 12


def kept_candidates_across(
    m2: torch.Tensor, tau: float, group: ProcessGroup | None, candidates: torch.Tensor | None = None
) -> torch.Tensor:
    """Algorithm 1's kept set over the candidates of every rank of ``group``, without
    moving any candidate and without reading any value on the host: per 12-bit digit,
    counts and sums per bucket are all-reduced (six rounds whatever the data, bytes
    independent of the token count), every rank picks the same crossing bucket on the
    device (``Descent``), and the values tied at the cut after all 64 bits are split in
    rank order, then index order (one all-gather of one count per rank). Returns this
    rank's kept mask over ``m2`` (1-d float64 >= 0); with ``candidates`` (a bool mask over
    ``m2``) only those compete and only they can be kept, so callers gather nothing.
    """
    import torch.distributed as dist

    device, n = m2.device, m2.numel()
    keys = m2.view(torch.int64)  # monotone in the value for non-negative floats
    ones = torch.ones((), dtype=torch.float64, device=device).expand(n)
    bucket = torch.empty(n, dtype=torch.int64, device=device)
    state, fixed = Descent.start(device), 0
    while fixed < 64:
        bits = min(GROUP_DIGIT_BITS, 64 - fixed)
        torch.bitwise_right_shift(keys, 64 - fixed - bits, out=bucket)
        if fixed:
            # Alive values (top bits equal to ``prefix``) become their digit; the rest >= 2**bits.
            bucket.bitwise_xor_(state.prefix << bits)
            out_of_level(bucket, buckets=1 << bits)
        if candidates is not None:
            out_of_level(bucket, inside=candidates, buckets=1 << bits)
        histogram = torch.zeros(2, 2 << bits, dtype=torch.float64, device=device)
        histogram[0].scatter_add_(0, bucket, m2)
        histogram[1].scatter_add_(0, bucket, ones)
        histogram = histogram[:, : 1 << bits].contiguous()  # the bank is never read
        dist.all_reduce(histogram, group=group)  # every rank now decides identically
        state, _ = state.step(histogram[0], histogram[1], tau, 0, bits=bits, fixed_bits=fixed)
        fixed += bits
    # Every alive value, on every rank, is the float whose bits are ``prefix``; the largest
    # count of them that fits is found on a grid (counts are exact in float64 up to 2**53).
    tied_value = state.prefix.view(torch.float64)
    fits = torch.where(state.refining, _tied_fits(state.kept_sum, state.kept_count, tied_value, state.tied_count, tau, 1 << 53), 0)
    tied = keys == torch.where(state.refining, state.prefix, -1)  # -1 is no key: nothing is tied
    if candidates is not None:
        tied &= candidates
    # Ties at the cut go to lower ranks first (then lower indices): one count per rank.
    mine = torch.count_nonzero(tied).reshape(1)
    by_rank = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(by_rank, mine, group=group)
    lower = torch.cat([*by_rank[: dist.get_rank(group)], torch.zeros_like(mine)]).sum()
    kept = (keys < torch.where(state.refining, state.prefix, state.threshold)) | (tied & (torch.cumsum(tied, 0) <= fits - lower))
    return kept if candidates is None else kept & candidates


#: Points of the grid that locates how many tied values fit, per round (rounds: log_G(n)).
TIE_GRID = 4096
_INT64_MAX = torch.iinfo(torch.int64).max


@dataclass(frozen=True)
class DeviceCut:
    """Algorithm 1's cut computed with no host synchronisation: every field is on the device.

    ``kept`` is the kept mask; ``kept_count`` and ``kept_sum`` count and sum the kept M2
    (per bucket, so the sum's rounding differs from a direct sum's by a few ulps).
    """

    kept: torch.Tensor
    kept_count: torch.Tensor
    kept_sum: torch.Tensor


@dataclass(frozen=True)
class Descent:
    """Where the radix descent stands after some levels (0-d tensors on the device).

    ``prefix``: the crossing bucket's top bits so far; ``kept_sum``/``kept_count``: the
    values decided kept (every bucket below the crossings); ``refining``: every level so
    far crossed tau inside a bucket (False: every alive value fitted, and ``threshold`` is
    the key below which everything is kept); ``tied_count``: values in the last crossing bucket.
    """

    prefix: torch.Tensor
    kept_sum: torch.Tensor
    kept_count: torch.Tensor
    threshold: torch.Tensor
    refining: torch.Tensor
    tied_count: torch.Tensor

    @classmethod
    def start(cls, device: torch.device) -> Descent:
        zero = torch.zeros((), dtype=torch.float64, device=device)
        return cls(
            torch.zeros((), dtype=torch.int64, device=device),
            zero,
            zero,
            torch.full((), _INT64_MAX, dtype=torch.int64, device=device),
            torch.ones((), dtype=torch.bool, device=device),
            zero,
        )

    @classmethod
    def after_first_level(
        cls, crossing: int, kept_sum: float, kept_count: float, tied_count: float, device: torch.device | str = "cpu"
    ) -> Descent:
        """The state ``Descent.start(device).step(...)`` reaches at level 0, from its numbers
        found elsewhere (the fused CPU pass): the crossing bucket (BUCKETS: nothing
        crosses), the sum and count of the values below it (all of them when nothing
        crosses) and the count in bucket min(crossing, BUCKETS - 1)."""
        f64: _Float64 = {"dtype": torch.float64, "device": device}
        crosses = crossing < BUCKETS
        return cls(
            torch.tensor(crossing if crosses else 0, dtype=torch.int64, device=device),
            torch.tensor(kept_sum, **f64),
            torch.tensor(kept_count, **f64),
            torch.full((), _INT64_MAX, dtype=torch.int64, device=device),
            torch.tensor(crosses, device=device),
            torch.tensor(tied_count, **f64),
        )

    def step(
        self, sums: torch.Tensor, counts: torch.Tensor, tau: float, level: int, *, bits: int = DIGIT_BITS, fixed_bits: int | None = None
    ) -> tuple[Descent, torch.Tensor]:
        """One level from its histogram (``1 << bits`` sums and counts of the alive values,
        whose top ``fixed_bits`` key bits, default ``DIGIT_BITS * level``, are ``prefix``);
        also returns the level's crossing bucket (``1 << bits`` when nothing crosses)."""
        buckets = 1 << bits
        fixed = DIGIT_BITS * level if fixed_bits is None else fixed_bits
        cumulative_sum = torch.cumsum(sums, 0) + self.kept_sum
        cumulative_count = torch.cumsum(counts, 0) + self.kept_count
        # Prefix means are non-decreasing: the first bucket whose cumulative mean exceeds tau
        # holds the cut. (Sum then divide, as the sorting baseline does.)
        over = cumulative_sum / cumulative_count > tau
        crosses = over.any()
        crossing = torch.where(crosses, torch.argmax(over.to(torch.uint8)), buckets)
        # Nothing crosses: every alive value fits, up to the end of this level's prefix range.
        fits_all = self.refining & ~crosses
        level_end = (self.prefix + 1) << (64 - fixed) if fixed else torch.full_like(self.prefix, _INT64_MAX)
        below = (crossing - 1).clamp(min=0, max=buckets - 1)
        has_below = self.refining & crosses & (crossing > 0)
        refining = self.refining & crosses
        return Descent(
            prefix=torch.where(refining, (self.prefix << bits) | crossing, self.prefix),
            kept_sum=torch.where(fits_all, cumulative_sum[-1], torch.where(has_below, _at(cumulative_sum, below), self.kept_sum)),
            kept_count=torch.where(fits_all, cumulative_count[-1], torch.where(has_below, _at(cumulative_count, below), self.kept_count)),
            threshold=torch.where(fits_all, level_end, self.threshold),
            refining=refining,
            tied_count=_at(counts, crossing.clamp(max=buckets - 1)),
        ), crossing


def cut_without_sync(m2: torch.Tensor, tau: float, *, first_level: int = 0, descent: Descent | None = None) -> DeviceCut:
    """Algorithm 1's kept set over 1-d float64 ``m2`` (+0.0 .. +inf; +inf is never kept)
    with fixed shapes throughout, so nothing waits for the device: 16-bit levels over the
    whole tensor, the crossing bucket chosen on the device, then the values tied at the
    cut kept in index order while they fit.

    Values outside the crossing bucket of a level fall into a second bank of buckets that
    is never read (no mask, no gather); what the cut keeps is decided once, at the end,
    by one threshold on the keys and one rank among the tied values. A caller that must
    exclude some tokens sets their M2 to +inf: a prefix mean that includes +inf exceeds
    every finite tau. With ``first_level`` and ``descent``, ``m2`` is the content of the
    crossing bucket of the levels already descended (the caller's own first levels).
    """
    device = m2.device
    n = m2.numel()
    keys = m2.view(torch.int64)  # monotone in the value for non-negative floats
    f64: _Float64 = {"dtype": torch.float64, "device": device}
    ones = torch.ones((), **f64).expand(n)
    bucket = torch.empty(n, dtype=torch.int64, device=device)
    state = Descent.start(device) if descent is None else descent
    for level in range(first_level, 64 // DIGIT_BITS):
        torch.bitwise_right_shift(keys, 64 - DIGIT_BITS * (level + 1), out=bucket)
        # XOR with the crossing bucket's bits: alive values (top bits equal to ``prefix``)
        # become their digit, 0 .. BUCKETS - 1; every other value becomes >= BUCKETS.
        if level:
            bucket.bitwise_xor_(state.prefix << DIGIT_BITS)
        out_of_level(bucket)
        sums = torch.zeros(2 * BUCKETS, **f64).scatter_add_(0, bucket, m2)[:BUCKETS]
        counts = torch.zeros(2 * BUCKETS, **f64).scatter_add_(0, bucket, ones)[:BUCKETS]
        state, _ = state.step(sums, counts, tau, level)
    # Every value still alive is the float whose bits are ``prefix``: keep the first ``fits`` of them.
    tied_value = state.prefix.view(torch.float64)
    fits = torch.where(state.refining, _tied_fits(state.kept_sum, state.kept_count, tied_value, state.tied_count, tau, n), 0)
    tied = keys == torch.where(state.refining, state.prefix, -1)  # -1 is no key: nothing is tied
    kept = (keys < torch.where(state.refining, state.prefix, state.threshold)) | (tied & (torch.cumsum(tied, 0) <= fits))
    tied_sum = torch.where(fits > 0, fits * tied_value, 0.0)  # not 0 * inf
    return DeviceCut(kept, state.kept_count + fits, state.kept_sum + tied_sum)


def out_of_level(bucket: torch.Tensor, inside: torch.Tensor | None = None, *, buckets: int = BUCKETS) -> None:
    """In place: values not ``inside`` a level (or, without ``inside``, every bucket index
    >= ``buckets``) go to the bank ``buckets`` .. 2 * ``buckets`` - 1, spread by position.
    Thousands of equal keys (every +inf, every tie, every padding token) in one bucket would
    make a histogram a chain of dependent additions (4x slower on CPU, contended atomics on a
    GPU). The bank is broadcast over rows of ``buckets`` tokens: nothing token-sized is allocated.
    """
    bank = torch.arange(buckets, 2 * buckets, dtype=torch.int64, device=bucket.device)
    full = bucket.numel() - bucket.numel() % buckets
    for part, rows in ((slice(0, full), (-1, buckets)), (slice(full, None), (-1,))):
        target = bucket[part].view(rows)
        spread = bank[: target.shape[-1]]
        if inside is None:
            torch.minimum(target, spread, out=target)
        else:
            torch.where(inside[part].view(rows), target, spread, out=target)


#: Up to this many values in the crossing bucket are sorted rather than refined (a dozen
#: operators instead of a few hundred small ones, each a kernel launch on a GPU). Three
#: more 16-bit levels cost about 4 ms on one CPU thread whatever the bucket's size (two
#: 65536-bucket histograms each); a stable sort of 5,249 values (a 1M-token batch's crossing
#: bucket) 0.7 ms, of 21,015 (4M) 2.4 ms, of 84,504 (16M) 9.3 ms. A bucket of up to SMALL
#: values finishes exactly as :func:`kept_candidates` does (it sorts after its first level
#: too); a larger one, sorted or refined, is exact up to float64 rounding at tau (the
#: sorted prefix sums add in another order than the bucket sums).
SORT_AT_MOST = 1 << 15


def cut_of_crossing_bucket(values: torch.Tensor, tau: float, descent: Descent, *, small: int | None = None) -> DeviceCut:
    """The rest of the cut once the first level is descended: ``values`` are the crossing
    bucket's M2 in index order. Up to ``small`` of them are sorted (stable: ties keep the
    lowest indices) and the prefix means counted, as :func:`kept_candidates` finishes; more
    go through the remaining radix levels (``small`` defaults to :data:`SORT_AT_MOST`). No
    host synchronisation either way.
    """
    if values.numel() > (SORT_AT_MOST if small is None else small):
        return cut_without_sync(values, tau, first_level=1, descent=descent)
    if values.numel() == 0:
        return DeviceCut(torch.zeros(0, dtype=torch.bool, device=values.device), descent.kept_count, descent.kept_sum)
    # Sorted by their bit patterns (int64, monotone in the value for M2 >= 0): the same
    # stable order as sorting the floats, and torch's CPU sort takes a radix path for
    # integers (84,504 values, a 16M-token batch's crossing bucket: 6.6 -> 0.6 ms).
    keys, order = torch.sort(values.view(torch.int64), stable=True)
    ordered = keys.view(torch.float64)
    prefix_sums = torch.cumsum(ordered, 0) + descent.kept_sum
    position = torch.arange(1, ordered.numel() + 1, device=values.device, dtype=torch.float64)
    fits = (prefix_sums / (position + descent.kept_count) <= tau).sum()
    kept = torch.empty_like(values, dtype=torch.bool).scatter_(0, order, position <= fits)
    kept_sum = torch.where(fits > 0, _at(prefix_sums, (fits - 1).clamp(min=0)), descent.kept_sum)
    return DeviceCut(kept, descent.kept_count + fits, kept_sum)


def _at(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``values[index]`` for a 0-d index tensor without reading it on the host (plain
    indexing would convert the index to a Python int: a synchronisation)."""
    return values.gather(0, index.reshape(1)).reshape(())


def _tied_fits(
    kept_sum: torch.Tensor, kept_count: torch.Tensor, value: torch.Tensor, count: torch.Tensor, tau: float, n: int
) -> torch.Tensor:
    """The largest r in [0, count] with (kept_sum + r * value) / (kept_count + r) <= tau.

    The mean is non-decreasing in r (``value`` is at least every kept value), so a grid of
    TIE_GRID + 1 points narrows the answer by that factor per round, on the device: a fixed
    number of rounds for ``n`` values, each a handful of small operations.
    """
    grid = torch.arange(TIE_GRID + 1, dtype=torch.int64, device=value.device)
    lo = torch.zeros((), dtype=torch.int64, device=value.device)  # fits (r = 0 always does)
    hi = count.to(torch.int64)  # hi + 1 does not fit, or hi is every tied value
    rounds = max(1, math.ceil(math.log(n + 1) / math.log(TIE_GRID)))
    for _ in range(rounds):
        r = lo + (hi - lo) * grid // TIE_GRID
        rf = r.to(torch.float64)
        fits = ((kept_sum + rf * value) / (kept_count + rf) <= tau) | (r == 0)
        last = fits.sum() - 1  # the fitting points are a prefix of the grid
        hi = torch.where(last < TIE_GRID, _at(r, (last + 1).clamp(max=TIE_GRID)) - 1, hi)
        lo = _at(r, last)
    return lo
