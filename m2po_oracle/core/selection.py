"""Algorithm 1's selection: the selection record, the single-process selection (a first
radix level over every token, then the crossing bucket's cut; no sort of every
candidate) and the selection across the ranks of a data-parallel group."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from m2po_oracle.core import fast_selection, fused
from m2po_oracle.core.fast_selection import BUCKETS, DIGIT_BITS, Descent, cut_of_crossing_bucket, kept_candidates_across
from m2po_oracle.core.inputs import selection_inputs
from m2po_oracle.core.scratch import Scratch, token_buffers


@dataclass(frozen=True)
class Selection:
    """The mask Algorithm 1 chose for some tokens, with the optimizer batch's global counts.

    ``keep`` has the shape of the tokens it was computed for; counts and metrics are over
    the whole optimizer batch (every micro-batch, every rank of ``group``), so a loss built
    from any part of it uses the global denominator ``valid_count``.
    """

    keep: torch.Tensor
    valid_count: torch.Tensor
    trust_region_count: torch.Tensor
    kept_trust_region_count: torch.Tensor
    m2_before: torch.Tensor
    m2_after: torch.Tensor
    masked_fraction: torch.Tensor
    trust_region_fraction: torch.Tensor


def select_across(d: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, tau: float, group: Any) -> Selection:
    """Selection over every rank of ``group`` from this rank's 1-d float64 d and A
    (padding zeroed; both overwritten): one global cut, global N and metrics."""
    import torch.distributed as dist

    # Padding has d = 0 and A = 0, so it is never a candidate. Every token takes part, the
    # trust region as a mask: nothing is gathered, so nothing waits for a size (the
    # agreement's verdict was this forward's one host read).
    trust = (advantages > 0).logical_and_(d > 0).logical_or_((advantages < 0).logical_and_(d < 0))
    valid_count = torch.count_nonzero(mask)  # no token-sized int64 copy, as a bool sum makes
    m2 = d.mul_(d)
    kept = kept_candidates_across(m2, tau, group, candidates=trust)
    zero = torch.zeros((), dtype=torch.float64, device=d.device)
    # Global counts and sums for N and the metrics: one all-reduce of five numbers.
    totals = torch.stack(
        [
            valid_count.double(),
            torch.count_nonzero(trust).double(),
            torch.count_nonzero(kept).double(),
            torch.where(trust, m2, zero).sum(),
            torch.where(kept, m2, zero).sum(),
        ]
    )
    dist.all_reduce(totals, group=group)
    global_valid, trust_count, kept_count, total, kept_total = (totals[i] for i in range(5))
    valid_denominator = global_valid.clamp(min=1)
    return Selection(
        # kept is within trust, trust within mask: keep = (mask and not trust) or kept.
        keep=mask ^ trust ^ kept,
        valid_count=global_valid.to(torch.int64),
        trust_region_count=trust_count.to(torch.int64),
        kept_trust_region_count=kept_count.to(torch.int64),
        m2_before=total / trust_count.clamp(min=1),
        m2_after=kept_total / kept_count.clamp(min=1),
        masked_fraction=(trust_count - kept_count) / valid_denominator,
        trust_region_fraction=trust_count / valid_denominator,
    )


#: The largest bucket index a finite or infinite M2 >= 0 can have (+inf's top 16 bits); a
#: crossing "above every bucket" is clamped to one past it, so int16 comparisons hold.
_ABOVE_EVERY_BUCKET = 0x7FFF


@dataclass(frozen=True)
class _FirstLevel:
    """The first radix level over every token: the candidates' M2 histogram, the trust
    region, each token's bucket (the top 16 bits of its M2; only candidates' are read),
    and on the device the candidate count and a sum that is finite iff every valid input is."""

    sums: torch.Tensor
    counts: torch.Tensor
    trust: torch.Tensor
    bucket: torch.Tensor
    trust_count: torch.Tensor
    checksum: torch.Tensor


def _first_level(logp: torch.Tensor, behavior_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> _FirstLevel:
    """One pass (per chunk) over the raw 1-d inputs, with no token-sized float64 buffer.

    Bit masks stand in for ``where``: on CPU, operators that read or write bool tensors
    cost 4-10x an arithmetic pass, while ANDing a float's bits with 0 or all-ones selects
    it (padding's NaN/inf included) at the cost of an integer pass.
    """
    device, n = mask.device, mask.numel()
    scratch = Scratch.for_device(device, n)
    trust, bucket = token_buffers(device, n)
    # Candidates go to buckets 0 .. BUCKETS - 1; non-candidates to the bank BUCKETS ..
    # 2 * BUCKETS - 1, which is never read, each at BUCKETS + its own digit: spread as the
    # candidates are (thousands of additions to one bucket are a chain of dependent adds on
    # CPU, 10-25 % slower here, and contended atomics on a GPU). Padding shares one.
    sums, counts = (torch.zeros(2 * BUCKETS, dtype=torch.float64, device=device) for _ in range(2))
    ones = torch.ones((), dtype=torch.float64, device=device).expand(scratch.chunk)
    checksum = torch.zeros((), dtype=torch.float64, device=device)
    trust_count = torch.zeros((), dtype=torch.int64, device=device)
    for start in range(0, n, scratch.chunk):
        end = min(start + scratch.chunk, n)
        d, other, bits = scratch.d[: end - start], scratch.other[: end - start], scratch.bits[: end - start]
        d.copy_(logp[start:end]).sub_(other.copy_(behavior_logp[start:end]))
        # d + 0 * A: d itself when A is finite, NaN when it is not, so that d's sum carries
        # the verdict for all three inputs.
        d.add_(other.copy_(advantages[start:end]), alpha=0.0)
        # Padding's d becomes +0 (all-ones bits on valid tokens, 0 on padding).
        d.view(torch.int64).bitwise_and_(bits.copy_(mask[start:end].view(torch.uint8)).neg_())
        checksum += d.sum()
        # d * sign(A) > 0 exactly when d and A are non-zero with the same sign (sign(A) is
        # -1, 0 or 1, so the product is exact): the trust region. On padding d is +0 and
        # sign(A) finite (sign(NaN) is 0), so the product is never > 0.
        chunk_trust = torch.gt(other.sign_().mul_(d), 0, out=trust[start:end])
        m2 = torch.mul(d, d, out=other)
        # Each token's digit (M2's top 16 bits; M2's sign bit is 0, or NaN's on an invalid
        # token: the verdict refuses those, and index + BUCKETS stays in range), then the
        # bank's offset for non-candidates (d's buffer is free once M2 is computed).
        index = torch.bitwise_right_shift(m2.view(torch.int64), 64 - DIGIT_BITS, out=d.view(torch.int64))
        bucket[start:end].copy_(index)
        is_candidate = bits.copy_(chunk_trust.view(torch.uint8))
        trust_count += is_candidate.sum()
        index.sub_(is_candidate, alpha=BUCKETS).add_(BUCKETS)
        sums.scatter_add_(0, index, m2)
        counts.scatter_add_(0, index, ones[: end - start])
    return _FirstLevel(sums[:BUCKETS], counts[:BUCKETS], trust, bucket, trust_count, checksum)


def _first_level_fused(
    logp: torch.Tensor, behavior_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> tuple[_FirstLevel, int, int, bool]:
    """:func:`_first_level` in one fused pass (``fused.first_level``): the same histogram,
    trust region and buckets, to the last bit; the verdict comes back as a flag, not a sum.
    Also returns, on the host already, the candidate and valid-token counts and the verdict."""
    n = mask.numel()
    sums, counts = torch.empty(BUCKETS, dtype=torch.float64), torch.empty(BUCKETS, dtype=torch.float64)
    trust, bucket = token_buffers(mask.device, n)
    candidates, valid, finite = fused.first_level(logp, behavior_logp, advantages, mask, sums, counts, trust, bucket)
    return (
        _FirstLevel(sums, counts, trust, bucket, torch.tensor(candidates), torch.tensor(0.0 if finite else math.nan, dtype=torch.float64)),
        candidates,
        valid,
        finite,
    )


def _m2_at(logp: torch.Tensor, behavior_logp: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """M2 of the tokens at ``index`` (1-d), computed as the first level computed it."""
    d = logp.index_select(0, index).to(torch.float64).sub_(behavior_logp.index_select(0, index).to(torch.float64))
    return d.mul_(d)


@torch.no_grad()
def select_local(
    logp: torch.Tensor,
    behavior_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    tau: float,
    on_invalid: Callable[[], None],
) -> Selection:
    """Single-process selection over 1-d detached inputs, with one host synchronisation:
    the fail-closed verdict (``on_invalid`` raises, naming the argument and the token).

    The first radix level runs over every token on the device. The verdict's one read also
    brings the candidate count and the crossing bucket's size, so the candidates to finish
    with are gathered with a fixed size (``nonzero_static``) and the rest of the cut runs
    on them alone, again on the device: up to SMALL candidates are all sorted as
    ``kept_candidates`` finishes (the same result to the last bit), and so is a crossing
    bucket of up to SMALL values; a larger crossing bucket is sorted (up to SORT_AT_MOST
    values) or goes through the remaining radix levels, both exact up to float64 rounding
    at tau. Where ``fused.applies``, :func:`_select_fused` makes the same selection, to the
    last bit, through the extension's passes (``m2po_oracle.core.fused``).
    """
    if mask.numel() <= fast_selection.SMALL:
        d, a = selection_inputs(logp, behavior_logp, advantages, mask)
        return _select_few(d, a, mask, torch.count_nonzero(mask), tau, on_invalid)
    if fused.applies(logp, behavior_logp, advantages, mask):  # on the CPU, contiguous, one dtype the passes take
        return _select_fused(logp, behavior_logp, advantages, mask, tau, on_invalid)
    valid_count = torch.count_nonzero(mask)  # no token-sized int64 copy, as a bool sum makes
    first = _first_level(logp, behavior_logp, advantages, mask)
    descent, crossing = Descent.start(mask.device).step(first.sums, first.counts, tau, 0)
    crossing_size = torch.where(crossing < BUCKETS, descent.tied_count, 0).to(torch.int64)
    # Non-candidates have buckets too: only candidates are compared with it.
    cut_bucket = crossing.clamp(max=_ABOVE_EVERY_BUCKET)
    # The forward's one host synchronisation, one int64 (-1: not finite): the verdict, the
    # crossing bucket's size, and above them the candidate count.
    packed = (first.trust_count << 32) | crossing_size
    read = int(torch.where(torch.isfinite(first.checksum), packed, -1).item())
    if read < 0:
        on_invalid()
        # Finite float64 inputs whose d or sums overflow (beyond 1.8e308): one more read, and on.
        read = int(packed.item())
    size, candidates = read & 0xFFFFFFFF, read >> 32
    small = candidates <= fast_selection.SMALL  # as kept_candidates selects so few: the same result to the last bit
    keep, alive = _undecided(first, mask, size=candidates if small else size, crossing=None if small else cut_bucket, fuse=False)
    values = _m2_at(logp, behavior_logp, alive)
    if small:
        cut, kept_sum, candidate_sum = _sorted_finish(values, alive, candidates, tau, keep)
    else:
        cut = cut_of_crossing_bucket(values, tau, descent)
        keep.index_put_((alive,), cut.kept)
        kept_sum, candidate_sum = cut.kept_sum, first.sums.sum()
    return _selection(keep, mask, valid_count, first.trust_count, cut.kept_count, candidate_sum, kept_sum)


def _select_fused(
    logp: torch.Tensor,
    behavior_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    tau: float,
    on_invalid: Callable[[], None],
) -> Selection:
    """:func:`select_local` through the fused CPU passes (``m2po_oracle.core.fused``), with the
    same results to the last bit: the first level and its cut, the finish's pass over every
    token and a crossing bucket of up to SORT_AT_MOST values each one call, whose numbers
    come back to the host with no synchronisation to count (the CPU is the host)."""
    first, candidates, valid, finite = _first_level_fused(logp, behavior_logp, advantages, mask)
    if not finite:
        on_invalid()
    level = fused.first_cut(first.sums, first.counts, tau)
    crossing_size = level.tied_count if level.crossing < BUCKETS else 0
    small = candidates <= fast_selection.SMALL  # as kept_candidates selects so few: the same result to the last bit
    keep, alive = _undecided(
        first,
        mask,
        size=candidates if small else int(crossing_size),
        crossing=None if small else min(level.crossing, _ABOVE_EVERY_BUCKET),
        fuse=True,
    )
    if small:
        cut, kept_sum, candidate_sum = _sorted_finish(_m2_at(logp, behavior_logp, alive), alive, candidates, tau, keep)
        kept_count = cut.kept_count
    elif alive.numel() <= fast_selection.SORT_AT_MOST:
        fits, fitted_sum = fused.sorted_cut(logp, behavior_logp, alive, keep, kept_sum=level.kept_sum, kept_count=level.kept_count, tau=tau)
        kept_count, kept_sum = torch.tensor(level.kept_count + fits, dtype=torch.float64), torch.tensor(fitted_sum, dtype=torch.float64)
        candidate_sum = first.sums.sum()
    else:
        cut = cut_of_crossing_bucket(_m2_at(logp, behavior_logp, alive), tau, level.descent())
        keep.index_put_((alive,), cut.kept)
        kept_count, kept_sum, candidate_sum = cut.kept_count, cut.kept_sum, first.sums.sum()
    return _selection(keep, mask, torch.tensor(valid), first.trust_count, kept_count, candidate_sum, kept_sum)


def _undecided(
    first: _FirstLevel, mask: torch.Tensor, *, size: int, crossing: torch.Tensor | int | None, fuse: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keep mask of every token but ``alive``: the ``size`` candidates still to decide,
    in index order, those in bucket ``crossing`` (an int with the fused passes, a 0-d tensor
    without), or every candidate where it is None. Candidates below the crossing bucket are
    kept and those above it removed; a token outside the trust region is kept where valid."""
    if fuse:
        assert not isinstance(crossing, torch.Tensor)  # the fused passes' crossing is a host int (see above)
        keep = torch.empty_like(mask)
        return keep, fused.finish(first.bucket, first.trust, mask, crossing=crossing, size=size, keep=keep)
    trust = first.trust
    # Kept candidates are within trust, trust within mask: keep = (mask and not trust) or kept.
    if crossing is None:
        return torch.bitwise_xor(trust, mask), torch.nonzero_static(trust, size=size).reshape(-1)
    in_crossing = torch.eq(first.bucket, crossing).logical_and_(trust)
    alive = torch.nonzero_static(in_crossing, size=size).reshape(-1)
    # In the same buffer: a fresh token-sized one is page faults on CPU.
    keep = torch.lt(first.bucket, crossing, out=in_crossing).logical_and_(trust).bitwise_xor_(trust).bitwise_xor_(mask)
    return keep, alive


def _select_few(
    d: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, valid_count: torch.Tensor, tau: float, on_invalid: Callable[[], None]
) -> Selection:
    """:func:`select_local` for at most SMALL tokens, from float64 d and A (padding
    zeroed; both overwritten): every candidate sorted, as its own small-candidate branch
    finishes (the same result to the last bit), without the first radix level, whose
    BUCKETS-sized histogram costs a small batch 10-30x its selection."""
    trust = (advantages > 0).logical_and_(d > 0).logical_or_((advantages < 0).logical_and_(d < 0))
    finite = torch.isfinite(d.sum() + advantages.sum())
    trust_count = torch.count_nonzero(trust)
    read = int(torch.where(finite, trust_count, -1).item())  # the one host synchronisation
    if read < 0:
        on_invalid()
        read = int(trust_count.item())
    m2 = d.mul_(d)
    alive = torch.nonzero_static(trust, size=read).reshape(-1)
    # Kept candidates are within trust, trust within mask: keep = (mask and not trust) or kept.
    keep = torch.bitwise_xor(trust, mask)
    cut, kept_sum, candidate_sum = _sorted_finish(m2.index_select(0, alive), alive, read, tau, keep)
    return _selection(keep, mask, valid_count, trust_count, cut.kept_count, candidate_sum, kept_sum)


def _sorted_finish(
    values: torch.Tensor, alive: torch.Tensor, count: int, tau: float, into: torch.Tensor
) -> tuple[fast_selection.DeviceCut, torch.Tensor, torch.Tensor]:
    """As kept_candidates selects a few candidates (``alive``, in index order, with M2
    ``values``): all sorted, no bucket sums. Writes which of them are kept into ``into``
    at ``alive``; returns the cut, and the kept and candidate M2 sums."""
    cut = cut_of_crossing_bucket(values, tau, Descent.start(into.device), small=count)
    into.index_put_((alive,), cut.kept)
    return cut, torch.where(cut.kept, values, 0.0).sum(), values.sum()


def _selection(
    keep: torch.Tensor,
    mask: torch.Tensor,
    valid_count: torch.Tensor,
    trust_count: torch.Tensor,
    kept_count: torch.Tensor,
    candidate_sum: torch.Tensor,
    kept_sum: torch.Tensor,
) -> Selection:
    """The selection's record from its keep mask, counts and sums."""
    kept_count = kept_count.to(torch.int64)
    valid_denominator = valid_count.clamp(min=1).double()
    return Selection(
        keep=keep,
        valid_count=valid_count,
        trust_region_count=trust_count,
        kept_trust_region_count=kept_count,
        m2_before=candidate_sum / trust_count.clamp(min=1),
        m2_after=kept_sum / kept_count.clamp(min=1),
        masked_fraction=(trust_count - kept_count).double() / valid_denominator,
        trust_region_fraction=trust_count.double() / valid_denominator,
    )
