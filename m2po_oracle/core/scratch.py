"""The core's reused buffers: chunk-sized scratch for the first level and the loss, and
the first level's per-token buffers, kept per thread on CPU."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

#: Tokens per pass of the single-process first level and the loss on CPU. Chunk by chunk,
#: a dozen passes run over data in cache, and their scratch is reused from one forward to
#: the next, where token-sized float64 buffers from 4M tokens up were fresh memory from
#: the OS every forward (glibc maps blocks of 32 MiB and more anew: a page fault per 4 KiB,
#: 147k per forward at 16M). 2**18 was fastest of 2**16 .. 2**20 at 1M and 4M tokens.
#: Other devices take the whole batch in one pass (their caching allocators reuse memory).
CPU_CHUNK = 1 << 18


@dataclass(frozen=True)
class Scratch:
    """Chunk-sized buffers for the first level and the loss: two float64 and one int64. On
    CPU one set per thread is kept between forwards (up to CPU_CHUNK tokens: 6 MiB at
    2**18), since fresh memory costs a page fault per 4 KiB; elsewhere the device's caching
    allocator keeps memory, and one pass takes the whole batch."""

    chunk: int
    d: torch.Tensor
    other: torch.Tensor
    bits: torch.Tensor

    @classmethod
    def for_device(cls, device: torch.device, n: int) -> Scratch:
        if device.type != "cpu":
            return cls._allocate(device, max(n, 1))
        chunk = max(1, min(n, CPU_CHUNK))  # an empty batch still has a (unused) chunk of 1
        kept = getattr(_SCRATCH, "cpu", None)
        if kept is None or kept.chunk < chunk:
            kept = _SCRATCH.cpu = cls._allocate(device, chunk)
        return cls(chunk, kept.d[:chunk], kept.other[:chunk], kept.bits[:chunk])

    @classmethod
    def _allocate(cls, device: torch.device, chunk: int) -> Scratch:
        d, other = (torch.empty(chunk, dtype=torch.float64, device=device) for _ in range(2))
        return cls(chunk, d, other, torch.empty(chunk, dtype=torch.int64, device=device))


_SCRATCH = threading.local()


def token_buffers(device: torch.device, n: int) -> tuple[torch.Tensor, torch.Tensor]:
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
