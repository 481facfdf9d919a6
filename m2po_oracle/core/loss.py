"""The production M2PO loss in torch: vectorised, device-agnostic, fail-closed.

Selection arithmetic (log ratio, M2, prefix means) runs in float64 whatever the input
dtype; the objective runs in at least float32. Follows the implementation contract
(``m2po_oracle.judge.contract``): ``m2po_loss(logp, behavior_logp, advantages, mask, *, tau)``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from m2po_oracle.core import fast_selection, fused
from m2po_oracle.core.fast_selection import BUCKETS, DIGIT_BITS, Descent, cut_of_crossing_bucket, kept_candidates_across

_FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class CoreResult:
    """``loss`` is 0-d and differentiable w.r.t. ``logp``; ``keep`` is bool like ``logp``.

    Metrics are 0-d float64 tensors and counts 0-d int64 tensors, on the input device, so
    that reading them never forces a host synchronisation inside the training step.
    """

    loss: torch.Tensor
    keep: torch.Tensor
    m2_before: torch.Tensor
    m2_after: torch.Tensor
    masked_fraction: torch.Tensor
    trust_region_fraction: torch.Tensor
    valid_count: torch.Tensor
    trust_region_count: torch.Tensor
    kept_trust_region_count: torch.Tensor


_MISSING_BEHAVIOR_LOGP = ("behavior_logp: required (the rollout engine's log-probs of the sampled tokens); "
                          "M2PO fails closed rather than fall back to a recomputed policy")


def _validate(logp, behavior_logp, advantages, mask, tau) -> None:
    """Every input check, in order: the structure, then finite values on valid tokens."""
    _validate_structure(logp, behavior_logp, advantages, mask, tau)
    _validate_finite(logp, behavior_logp, advantages, mask)


def _validate_structure(logp, behavior_logp, advantages, mask, tau) -> None:
    """Types, shapes, devices, dtypes and tau: checks that read no tensor value."""
    if behavior_logp is None:
        raise ValueError(_MISSING_BEHAVIOR_LOGP)
    tensors = {"logp": logp, "behavior_logp": behavior_logp, "advantages": advantages, "mask": mask}
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    for name in ("behavior_logp", "advantages", "mask"):
        if tensors[name].shape != logp.shape:
            raise ValueError(f"{name}: expected shape {tuple(logp.shape)} (the shape of logp), got {tuple(tensors[name].shape)}")
        if tensors[name].device != logp.device:
            raise ValueError(f"{name}: expected device {logp.device} (the device of logp), got {tensors[name].device}")
    for name in ("logp", "behavior_logp", "advantages"):
        if tensors[name].dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name}: expected a floating dtype (float64/32, bfloat16, float16), got {tensors[name].dtype}")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask: expected dtype torch.bool, got {mask.dtype} (convert explicitly, e.g. mask.bool())")
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) or tau < 0:
        raise ValueError(f"tau: expected a finite Python number >= 0, got {tau!r}")


def _validate_finite(logp, behavior_logp, advantages, mask) -> None:
    """Raises naming the first argument with a non-finite value on a valid token."""
    names = ("logp", "behavior_logp", "advantages")
    tensors = dict(zip(names, (logp, behavior_logp, advantages)))
    finite = [torch.isfinite(tensors[name].detach()) for name in names]
    # One host synchronisation in the common case; the per-argument detail only on failure.
    if not bool((mask & ~(finite[0] & finite[1] & finite[2])).any()):
        return
    for name, ok in zip(names, finite):
        bad = mask & ~ok
        if bool(bad.any()):
            index = tuple(int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"{name}: expected finite values on valid tokens (mask True), "
                f"got {tensors[name].detach()[index].item()} at index {index} ({int(bad.sum())} such tokens)"
            )


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


def _check_group(group: Any) -> None:
    if group is None:
        return
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialised; pass group=None for single-process selection")
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"group: expected a torch.distributed.ProcessGroup (the pure data-parallel group) or None, got {type(group).__name__}")


# --- collective fail-closed: every rank of the group refuses the step, with the same error ---

#: The arguments a rank's local checks name, in the order of the agreement record's code
#: (0 = this rank's input is valid).
_ARGUMENTS = ("logp", "behavior_logp", "advantages", "mask", "tau", "micro_batches")
#: UTF-8 bytes of a failing rank's own message carried in its record (longer ones are cut),
#: so that the record is one fixed-size tensor: [code, tau, message words] = 256 bytes.
_MESSAGE_BYTES = 240
_RECORD_WORDS = 2 + _MESSAGE_BYTES // 8
#: Ranks named at most in one message (a 1024-rank group must not make a 1024-entry error).
_NAMED_RANKS = 8


@dataclass(frozen=True)
class _RankRecord:
    code: int
    tau: float
    message: str


def _validate_across(check: Any, tau: Any, logp: Any, group: Any) -> None:
    """Run this rank's local ``check``, then agree with every rank of ``group``: if any rank
    failed, or the ranks' tau differ, every rank raises the same ValueError.

    A rank that raised on its own would leave the others waiting in the selection's first
    collective (a hang, or gloo's "Connection closed by peer"); ranks with different tau
    would silently compute different cuts. Costs one all-gather of 256 bytes per rank.
    """
    try:
        check()
        failure = None
    except ValueError as error:
        failure = error
    records = _exchange(_record(failure, tau), _agreement_device(logp, group), group)
    failed = [i for i, record in enumerate(records) if record.code]
    if failed:
        raise ValueError(_failure_message(records, failed, group))
    if any(record.tau != records[0].tau for record in records):
        raise ValueError(_disagreement_message(records, group))


def validate_across_ranks(logp: Any, behavior_logp: Any, advantages: Any, mask: Any, *, tau: Any, group: Any) -> None:
    """The core's input checks, agreed over ``group``: one rank's invalid input (or a tau
    that differs between ranks) makes every rank raise the same ValueError. For ports that
    select with their own code but must fail closed as the core does."""
    _check_group(group)  # local: a broken group cannot carry an agreement
    _validate_across(lambda: _validate(logp, behavior_logp, advantages, mask, tau), tau, logp, group)


def _record(failure: ValueError | None, tau: Any) -> torch.Tensor:
    """This rank's float64 record: [code, tau, its own message as UTF-8 bytes]."""
    record = torch.zeros(_RECORD_WORDS, dtype=torch.float64)
    record[1] = _tau_value(tau)
    if failure is None:
        return record
    message = str(failure)
    argument = message.split(":", 1)[0].split("[", 1)[0]
    record[0] = 1 + (_ARGUMENTS.index(argument) if argument in _ARGUMENTS else len(_ARGUMENTS))
    encoded = _cut(message.encode("utf-8"))
    record[2:] = torch.frombuffer(bytearray(encoded.ljust(_MESSAGE_BYTES, b"\0")), dtype=torch.float64)
    return record


def _tau_value(tau: Any) -> float:
    # An invalid tau fails the rank's own check; its value only has to survive float64.
    if isinstance(tau, bool) or not isinstance(tau, (int, float)):
        return math.nan
    try:
        return float(tau)
    except OverflowError:
        return math.nan


def _cut(encoded: bytes) -> bytes:
    if len(encoded) <= _MESSAGE_BYTES:
        return encoded
    # Cut on a character boundary, so the message still decodes on every rank.
    return encoded[: _MESSAGE_BYTES - 3].decode("utf-8", "ignore").encode("utf-8") + b"..."


def _agreement_device(logp: Any, group: Any) -> torch.device:
    """Where the record lives: gloo needs CPU, NCCL CUDA; other backends get logp's device."""
    import torch.distributed as dist

    backend = str(dist.get_backend(group))
    on = logp.device if isinstance(logp, torch.Tensor) else None
    if backend == "gloo":
        return torch.device("cpu")
    if backend == "nccl":
        return on if on is not None and on.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    return on if on is not None else torch.device("cpu")


def _exchange(record: torch.Tensor, device: torch.device, group: Any) -> list[_RankRecord]:
    """Every rank's record, in group-rank order: one all-gather and one host copy."""
    import torch.distributed as dist

    mine = record.to(device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    # One host read of the table (a copy from an accelerator; none under gloo), decoded in NumPy.
    table = torch.stack(gathered).cpu().numpy()
    return [_RankRecord(int(row[0]), float(row[1]), _decode(row[2:])) for row in table]


def _decode(words: Any) -> str:
    return words.tobytes().rstrip(b"\0").decode("utf-8", "replace")


def _rank_name(group: Any, index: int) -> str:
    import torch.distributed as dist

    size = dist.get_world_size(group)
    global_rank = dist.get_global_rank(group, index)
    if global_rank == index:
        return f"rank {global_rank} of the group's {size}"
    return f"global rank {global_rank} (rank {index} of the group's {size})"


def _global_ranks(group: Any, indices: Sequence[int]) -> str:
    import torch.distributed as dist

    named = ", ".join(str(dist.get_global_rank(group, i)) for i in indices[:_NAMED_RANKS])
    return named + (f" and {len(indices) - _NAMED_RANKS} more" if len(indices) > _NAMED_RANKS else "")


def _failure_message(records: list[_RankRecord], failed: list[int], group: Any) -> str:
    """Names the lowest failing rank, its argument and its own message (the same on every rank)."""
    first = records[failed[0]]
    argument = _ARGUMENTS[first.code - 1] if first.code <= len(_ARGUMENTS) else "input"
    how = "missing" if first.message == _MISSING_BEHAVIOR_LOGP else "invalid"
    detail = first.message[len(argument) + 2:] if first.message.startswith(f"{argument}: ") else first.message
    size = len(records)
    which = f"; ranks {_global_ranks(group, failed)}" if len(failed) > 1 else ""
    return (f"{argument}: {how} on {_rank_name(group, failed[0])} ({len(failed)} of {size} ranks failed validation{which}; "
            f"every rank refuses the step): {detail}")


def _disagreement_message(records: list[_RankRecord], group: Any) -> str:
    """Rank 0's tau and every rank that differs from it (at most a few named)."""
    import torch.distributed as dist

    named = [0] + [i for i, record in enumerate(records) if record.tau != records[0].tau]
    listed = ", ".join(f"rank {dist.get_global_rank(group, i)}: {records[i].tau!r}" for i in named[:_NAMED_RANKS])
    more = f", and {len(named) - _NAMED_RANKS} more differing ranks" if len(named) > _NAMED_RANKS else ""
    return f"tau: the ranks disagree ({listed}{more}); every rank must pass the same budget"


def _select_across(d: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, tau: float, group: Any) -> Selection:
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
    totals = torch.stack([valid_count.double(), torch.count_nonzero(trust).double(), torch.count_nonzero(kept).double(),
                          torch.where(trust, m2, zero).sum(), torch.where(kept, m2, zero).sum()])
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


#: Tokens per pass of the single-process first level and the loss on CPU. Chunk by chunk,
#: a dozen passes run over data in cache, and their scratch is reused from one forward to
#: the next, where token-sized float64 buffers from 4M tokens up were fresh memory from
#: the OS every forward (glibc maps blocks of 32 MiB and more anew: a page fault per 4 KiB,
#: 147k per forward at 16M). 2**18 was fastest of 2**16 .. 2**20 at 1M and 4M tokens.
#: Other devices take the whole batch in one pass (their caching allocators reuse memory).
CPU_CHUNK = 1 << 18
#: The largest bucket index a finite or infinite M2 >= 0 can have (+inf's top 16 bits); a
#: crossing "above every bucket" is clamped to one past it, so int16 comparisons hold.
_ABOVE_EVERY_BUCKET = 0x7FFF


@dataclass(frozen=True)
class _Scratch:
    """Chunk-sized buffers for the first level and the loss: two float64 and one int64. On
    CPU one set per thread is kept between forwards (up to CPU_CHUNK tokens: 6 MiB at
    2**18), since fresh memory costs a page fault per 4 KiB; elsewhere the device's caching
    allocator keeps memory, and one pass takes the whole batch."""

    chunk: int
    d: torch.Tensor
    other: torch.Tensor
    bits: torch.Tensor

    @classmethod
    def for_device(cls, device: torch.device, n: int) -> "_Scratch":
        if device.type != "cpu":
            return cls._allocate(device, max(n, 1))
        chunk = max(1, min(n, CPU_CHUNK))  # an empty batch still has a (unused) chunk of 1
        kept = getattr(_SCRATCH, "cpu", None)
        if kept is None or kept.chunk < chunk:
            kept = _SCRATCH.cpu = cls._allocate(device, chunk)
        return cls(chunk, kept.d[:chunk], kept.other[:chunk], kept.bits[:chunk])

    @classmethod
    def _allocate(cls, device: torch.device, chunk: int) -> "_Scratch":
        d, other = (torch.empty(chunk, dtype=torch.float64, device=device) for _ in range(2))
        return cls(chunk, d, other, torch.empty(chunk, dtype=torch.int64, device=device))


_SCRATCH = threading.local()


def _token_buffers(device: torch.device, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first level's per-token trust region (bool) and bucket (int16), read only
    within one selection. On CPU one pair per thread is kept and grown to the largest batch
    (3 bytes per token: 48 MiB at 16M), since fresh memory of 32 MiB and more is a page
    fault per 4 KiB every forward (8k per forward at 16M); elsewhere the device's caching
    allocator keeps memory."""
    if device.type != "cpu":
        return torch.empty(n, dtype=torch.bool, device=device), torch.empty(n, dtype=torch.int16, device=device)
    kept = getattr(_SCRATCH, "tokens", None)
    if kept is None or kept[0].numel() < n:
        kept = _SCRATCH.tokens = (torch.empty(n, dtype=torch.bool), torch.empty(n, dtype=torch.int16))
    return kept[0][:n], kept[1][:n]


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
    scratch = _Scratch.for_device(device, n)
    trust, bucket = _token_buffers(device, n)
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


def _first_level_fused(logp: torch.Tensor, behavior_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
                       ) -> tuple[_FirstLevel, int, int, bool]:
    """:func:`_first_level` in one fused pass (``fused.first_level``): the same histogram,
    trust region and buckets, to the last bit; the verdict comes back as a flag, not a sum.
    Also returns, on the host already, the candidate and valid-token counts and the verdict."""
    n = mask.numel()
    sums, counts = torch.empty(BUCKETS, dtype=torch.float64), torch.empty(BUCKETS, dtype=torch.float64)
    trust, bucket = _token_buffers(mask.device, n)
    candidates, valid, finite = fused.first_level(logp, behavior_logp, advantages, mask, sums, counts, trust, bucket)
    return _FirstLevel(sums, counts, trust, bucket, torch.tensor(candidates),
                       torch.tensor(0.0 if finite else math.nan, dtype=torch.float64)), candidates, valid, finite


def _m2_at(logp: torch.Tensor, behavior_logp: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """M2 of the tokens at ``index`` (1-d), computed as the first level computed it."""
    d = logp.index_select(0, index).to(torch.float64).sub_(behavior_logp.index_select(0, index).to(torch.float64))
    return d.mul_(d)


@torch.no_grad()
def _select_local(logp: torch.Tensor, behavior_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, tau: float,
                  on_invalid: Callable[[], None]) -> Selection:
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
        d, a = _selection_inputs(logp, behavior_logp, advantages, mask)
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


def _select_fused(logp: torch.Tensor, behavior_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, tau: float,
                  on_invalid: Callable[[], None]) -> Selection:
    """:func:`_select_local` through the fused CPU passes (``m2po_oracle.core.fused``), with the
    same results to the last bit: the first level and its cut, the finish's pass over every
    token and a crossing bucket of up to SORT_AT_MOST values each one call, whose numbers
    come back to the host with no synchronisation to count (the CPU is the host)."""
    first, candidates, valid, finite = _first_level_fused(logp, behavior_logp, advantages, mask)
    if not finite:
        on_invalid()
    level = fused.first_cut(first.sums, first.counts, tau)
    crossing_size = level.tied_count if level.crossing < BUCKETS else 0
    small = candidates <= fast_selection.SMALL  # as kept_candidates selects so few: the same result to the last bit
    keep, alive = _undecided(first, mask, size=candidates if small else int(crossing_size),
                             crossing=None if small else min(level.crossing, _ABOVE_EVERY_BUCKET), fuse=True)
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


def _undecided(first: _FirstLevel, mask: torch.Tensor, *, size: int, crossing: torch.Tensor | int | None, fuse: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The keep mask of every token but ``alive``: the ``size`` candidates still to decide,
    in index order, those in bucket ``crossing`` (an int with the fused passes, a 0-d tensor
    without), or every candidate where it is None. Candidates below the crossing bucket are
    kept and those above it removed; a token outside the trust region is kept where valid."""
    if fuse:
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


def _select_few(d: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, valid_count: torch.Tensor, tau: float,
                on_invalid: Callable[[], None]) -> Selection:
    """:func:`_select_local` for at most SMALL tokens, from float64 d and A (padding
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


def _sorted_finish(values: torch.Tensor, alive: torch.Tensor, count: int, tau: float, into: torch.Tensor
                   ) -> tuple[fast_selection.DeviceCut, torch.Tensor, torch.Tensor]:
    """As kept_candidates selects a few candidates (``alive``, in index order, with M2
    ``values``): all sorted, no bucket sums. Writes which of them are kept into ``into``
    at ``alive``; returns the cut, and the kept and candidate M2 sums."""
    cut = cut_of_crossing_bucket(values, tau, Descent.start(into.device), small=count)
    into.index_put_((alive,), cut.kept)
    return cut, torch.where(cut.kept, values, 0.0).sum(), values.sum()


def _selection(keep: torch.Tensor, mask: torch.Tensor, valid_count: torch.Tensor, trust_count: torch.Tensor,
               kept_count: torch.Tensor, candidate_sum: torch.Tensor, kept_sum: torch.Tensor) -> Selection:
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


def _selection_inputs(logp, behavior_logp, advantages, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """d = logp - behavior_logp and A in float64, zero on padding: one conversion each, in place after it."""
    padding = ~mask
    # behavior_logp's float64 copy becomes A's buffer once subtracted (a mixed-dtype sub_
    # would allocate that copy anyway, and a fresh token-sized buffer costs page faults).
    buffer = behavior_logp.detach().to(torch.float64, copy=True)
    d = logp.detach().to(torch.float64, copy=True).sub_(buffer).masked_fill_(padding, 0.0)
    return d, buffer.copy_(advantages.detach()).masked_fill_(padding, 0.0)


def select_tokens(logp: torch.Tensor, behavior_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                  tau: float = 0.04, group: Any = None) -> Selection:
    """Algorithm 1's selection for one optimizer batch.

    With ``group`` (a pure data-parallel ProcessGroup) every rank passes its own tokens and
    all ranks agree on one global cut over the union; N and the metrics are global.
    Tensor- and context-parallel replicas must not be in ``group`` (they would be counted
    twice): select over the pure DP group on CP-reconstructed tensors.
    """
    if group is not None:
        validate_across_ranks(logp, behavior_logp, advantages, mask, tau=tau, group=group)
        d, a = _selection_inputs(logp, behavior_logp, advantages, mask)
        with torch.no_grad():
            flat = _select_across(d.reshape(-1), a.reshape(-1), mask.reshape(-1), float(tau), group)
        return replace(flat, keep=flat.keep.reshape(mask.shape))
    _validate_structure(logp, behavior_logp, advantages, mask, tau)
    with torch.no_grad():
        flat = _select_local(*(x.detach().reshape(-1) for x in (logp, behavior_logp, advantages, mask)), float(tau),
                             lambda: _validate_finite(logp, behavior_logp, advantages, mask))
    return replace(flat, keep=flat.keep.reshape(mask.shape))


def _validate_micro_batches(micro_batches: Any, tau: Any, *, finite: bool = True) -> None:
    """Every local check of :func:`select_micro_batches`, in its order (first failure raised);
    ``finite=False`` leaves out the finite-values checks (the only ones that read values)."""
    if not isinstance(micro_batches, Sequence) or not micro_batches:
        raise ValueError(f"micro_batches: expected a non-empty sequence of (logp, behavior_logp, advantages, mask), got {type(micro_batches).__name__}")
    for i, parts in enumerate(micro_batches):
        if len(parts) != 4:
            raise ValueError(f"micro_batches[{i}]: expected (logp, behavior_logp, advantages, mask), got {len(parts)} items")
        (_validate if finite else _validate_structure)(*parts, tau)
    devices = {parts[3].device for parts in micro_batches}
    if len(devices) > 1:
        raise ValueError(f"micro_batches: expected every micro-batch on one device, got {sorted(map(str, devices))}")


def _first_logp(micro_batches: Any) -> Any:
    """The first micro-batch's logp, when there is one (it only picks the record's device)."""
    try:
        return micro_batches[0][0]
    except Exception:  # invalid input: that rank's own check reports it
        return None


def select_micro_batches(micro_batches: Sequence[Sequence[torch.Tensor]], *, tau: float = 0.04, group: Any = None) -> list[Selection]:
    """One selection over every micro-batch of an optimizer step (each ``(logp,
    behavior_logp, advantages, mask)``, shapes may differ, empty ones allowed).

    Returns one :class:`Selection` per micro-batch; all share the optimizer batch's counts,
    so ``loss_from_selection`` on each and summing gives the full-batch loss whatever the
    split.
    """
    if group is None:
        try:
            _validate_micro_batches(micro_batches, tau, finite=False)
        except ValueError:
            # An earlier micro-batch's non-finite value is the first failure, as before.
            _validate_micro_batches(micro_batches, tau)
            raise
        # One selection over the concatenation (torch.cat promotes mixed dtypes exactly).
        flats = [torch.cat([parts[i].detach().reshape(-1) for parts in micro_batches]) for i in range(4)]
        with torch.no_grad():
            whole = _select_local(*flats, float(tau), lambda: _validate_micro_batches(micro_batches, tau))
    else:
        _check_group(group)  # local: a broken group cannot carry an agreement
        _validate_across(lambda: _validate_micro_batches(micro_batches, tau), tau, _first_logp(micro_batches), group)
        flats_d, flats_a = [], []
        for logp, behavior_logp, advantages, mask in micro_batches:
            d, a = _selection_inputs(logp, behavior_logp, advantages, mask)
            flats_d.append(d.reshape(-1))
            flats_a.append(a.reshape(-1))
        with torch.no_grad():
            whole = _select_across(torch.cat(flats_d), torch.cat(flats_a), torch.cat([parts[3].reshape(-1) for parts in micro_batches]),
                                   float(tau), group)
    parts, start = [], 0
    for shape in (parts[3].shape for parts in micro_batches):
        end = start + math.prod(shape)
        parts.append(replace(whole, keep=whole.keep[start:end].reshape(shape)))
        start = end
    return parts


class _KeptRatioLoss(torch.autograd.Function):
    """``-(1/N) * sum(keep * exp(logp - behavior_logp) * advantages)`` on flat tensors,
    forward and backward by hand: the values and gradient autograd gives for the same
    expression (dropped tokens' log-ratio zeroed, then exp, times A zeroed off ``keep``),
    bit masks instead of ``where`` (on CPU a pass over a bool tensor costs 4-10x an
    arithmetic pass), and on CPU chunk by chunk, so that each chunk's passes run in cache.
    The sum adds the chunks' sums: over more than CPU_CHUNK tokens it rounds in another
    order than one sum. The backward recomputes each chunk's terms from the inputs rather
    than keeping two token-sized buffers alive from the forward (fresh memory for them was
    a page fault per 4 KiB: half the forward's time at 16M tokens)."""

    @staticmethod
    def forward(ctx: Any, logp: torch.Tensor, behavior_logp: torch.Tensor, advantages: torch.Tensor, keep: torch.Tensor,
                denominator: torch.Tensor) -> torch.Tensor:
        total = torch.zeros((), dtype=denominator.dtype, device=keep.device)
        for _, _, ratio, weight in _kept_terms(logp, behavior_logp, advantages, keep, denominator.dtype):
            total += ratio.mul_(weight).sum()
        ctx.save_for_backward(logp, behavior_logp, advantages, keep, denominator)
        return -total / denominator

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logp, behavior_logp, advantages, keep, denominator = ctx.saved_tensors
        gradient = torch.empty(keep.numel(), dtype=denominator.dtype, device=keep.device)
        scale = -(grad / denominator)
        for start, end, ratio, weight in _kept_terms(logp, behavior_logp, advantages, keep, denominator.dtype):
            # In autograd's order (division, negation, A, then exp's result): the same bits.
            torch.mul(scale, weight, out=gradient[start:end]).mul_(ratio)
        return gradient.to(logp.dtype), None, None, None, None


def _kept_terms(logp: torch.Tensor, behavior_logp: torch.Tensor, advantages: torch.Tensor, keep: torch.Tensor,
                compute_dtype: torch.dtype) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """The loss's terms chunk by chunk (the whole batch in one chunk off the CPU): each
    chunk's bounds, exp of the log-ratio where kept (exp(+0) = 1 elsewhere) and A where kept
    (+0 elsewhere), in the compute dtype, in the thread's scratch (valid until the next chunk)."""
    n = keep.numel()
    bits_dtype = torch.int64 if compute_dtype == torch.float64 else torch.int32
    scratch = _Scratch.for_device(keep.device, n)
    # The scratch's float64 and int64 buffers seen as chunk-sized buffers of the compute width.
    ratios, weights = (buffer.view(compute_dtype)[: scratch.chunk] for buffer in (scratch.d, scratch.other))
    bits = scratch.bits.view(bits_dtype)[: scratch.chunk]
    fuse = fused.applies(logp, behavior_logp, advantages, keep)
    for start in range(0, n, scratch.chunk):
        end = min(start + scratch.chunk, n)
        r, w = ratios[: end - start], weights[: end - start]
        if fuse:  # the chunk's masked terms in one pass
            fused.loss_terms(logp[start:end], behavior_logp[start:end], advantages[start:end], keep[start:end], r, w)
        else:
            if logp.dtype == behavior_logp.dtype == compute_dtype:
                torch.sub(logp[start:end], behavior_logp[start:end], out=r)
            else:
                r.copy_(logp[start:end]).sub_(behavior_logp[start:end].to(compute_dtype))
            # All-ones bits where kept, 0 where dropped: ANDed into a float, it keeps the
            # value or makes it +0, so padding NaN/inf never meets the loss or the backward.
            kept_bits = bits[: end - start].copy_(keep[start:end].view(torch.uint8)).neg_()
            r.view(bits_dtype).bitwise_and_(kept_bits)
            w.copy_(advantages[start:end]).view(bits_dtype).bitwise_and_(kept_bits)
        yield start, end, r.exp_(), w


def loss_from_selection(logp: torch.Tensor, behavior_logp: torch.Tensor, advantages: torch.Tensor, keep: torch.Tensor,
                        valid_count: torch.Tensor | int) -> torch.Tensor:
    """``-(1/N) * sum(keep * exp(logp - behavior_logp) * advantages)`` with the given global N.

    ``keep`` may be a part of a selection (a micro-batch, a context-parallel shard): only
    its kept tokens carry gradient, and padding never meets the backward pass. Computed in
    float64 for float64 logp, else in float32.
    """
    compute_dtype = torch.float64 if logp.dtype == torch.float64 else torch.float32
    denominator = torch.as_tensor(valid_count, device=logp.device).clamp(min=1).to(compute_dtype)
    flat = [x.reshape(-1) for x in (logp, behavior_logp.detach(), advantages.detach(), torch.broadcast_to(keep, logp.shape))]
    return _KeptRatioLoss.apply(*flat, denominator)


def m2po_loss(
    logp: torch.Tensor,
    behavior_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    tau: float = 0.04,
    group: Any = None,
) -> CoreResult:
    """M2PO loss for one optimizer batch (Algorithm 1).

    ``loss = -(1/N) * sum(keep * exp(logp - behavior_logp) * advantages)`` with N the valid
    token count before masking. Values at positions where ``mask`` is False may be NaN or
    inf: they reach neither the loss nor its gradient. With ``group`` (pure data-parallel)
    the selection and N are global and each rank's loss is its share: the rank losses sum
    to the global loss (under DDP, which averages gradients, scale by the group size).
    """
    selection = select_tokens(logp, behavior_logp, advantages, mask, tau=tau, group=group)
    loss = loss_from_selection(logp, behavior_logp, advantages, selection.keep, selection.valid_count)
    return CoreResult(loss=loss, **{f.name: getattr(selection, f.name) for f in fields(selection)})
