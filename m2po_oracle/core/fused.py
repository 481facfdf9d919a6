"""The core's CPU passes fused: one read of the batch where torch operators need a dozen.

``m2po_oracle.core.fused_c`` is an optional C extension built at install (``pyproject.toml``'s
``ext-modules``). The core calls it, through the checked functions below, for CPU tensors
that are contiguous and share one dtype of float64, float32 or bfloat16; everywhere else
(a GPU, float16, mixed dtypes, strided views, no compiler at install) it runs its torch
operators. Both give the same results to the last bit (``property_tests/core/test_fused.py``
runs the core both ways).

``M2PO_ORACLE_FUSED=0`` in the environment, or :func:`disabled`, turns the fused passes
off, e.g. to compare the two (``m2po-oracle bench`` times both).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from m2po_oracle.core.fast_selection import BUCKETS, Descent

#: The extension's argument conventions this module calls (its INTERFACE constant).
INTERFACE = 3


def _load() -> tuple[Any, str | None]:
    """The extension, or None and why: not built (no C compiler at install), built for
    other arguments, or (in a source checkout) built before its source last changed."""
    try:
        from m2po_oracle.core import fused_c as extension
    except ImportError as error:
        return None, f"{error} (built without a C compiler? reinstall with one: pip install -e .)"
    if getattr(extension, "INTERFACE", None) != INTERFACE:
        return (
            None,
            f"{extension.__file__} has interface {getattr(extension, 'INTERFACE', None)}, this module calls {INTERFACE}: rebuild (pip install -e .)",
        )
    source = Path(__file__).with_name("fused_c.c")
    if source.exists() and source.stat().st_mtime > Path(extension.__file__).stat().st_mtime:
        return None, f"{source} changed after {extension.__file__} was built: rebuild (pip install -e .)"
    return extension, None


_extension, _IMPORT_ERROR = _load()

#: The extension's dtype codes.
DTYPE_CODES = {torch.float64: 0, torch.float32: 1, torch.bfloat16: 2}
#: Histogram cells after the buckets for non-candidates (never read), as the extension's BANK.
BANK = 256

_STATE = threading.local()


def built() -> bool:
    """Whether the C extension was built at install (for this source and these arguments)."""
    return _extension is not None


def why_not_built() -> str | None:
    """Why the extension is not used (None when it is)."""
    return _IMPORT_ERROR


def enabled() -> bool:
    """Whether the core uses the fused passes where they apply."""
    setting = os.environ.get("M2PO_ORACLE_FUSED", "1")
    if setting not in ("0", "1"):
        raise ValueError(
            f"M2PO_ORACLE_FUSED: expected 0 (the torch operators only) or 1 (the fused passes where they apply), got {setting!r}"
        )
    return built() and setting == "1" and not getattr(_STATE, "off", False)


def first_levels_run() -> int:
    """How many first levels the fused passes have run in this thread (reports count what ran)."""
    return getattr(_STATE, "first_levels", 0)


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within this block (this thread), the core runs its torch operators only."""
    before = getattr(_STATE, "off", False)
    _STATE.off = True
    try:
        yield
    finally:
        _STATE.off = before


def applies(logp: torch.Tensor, behavior_logp: torch.Tensor, advantages: torch.Tensor, *masks: torch.Tensor) -> bool:
    """Whether the fused passes take these 1-d tensors: enabled, every one on the CPU and
    contiguous, the three float ones of one supported dtype, the masks bool."""
    tensors = (logp, behavior_logp, advantages, *masks)
    return (
        enabled()
        and logp.dtype in DTYPE_CODES
        and behavior_logp.dtype == logp.dtype == advantages.dtype
        and all(m.dtype == torch.bool for m in masks)
        and all(t.device.type == "cpu" and t.dim() == 1 and t.is_contiguous() for t in tensors)
        and len({t.numel() for t in tensors}) == 1
    )


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise ValueError(what)


def _check_tokens(n: int, dtype: torch.dtype | None = None, **tensors: torch.Tensor) -> None:
    """Every tensor 1-d, contiguous, on the CPU, of ``n`` elements (and ``dtype`` if given):
    the extension reads and writes raw memory, so nothing reaches it unchecked."""
    for name, tensor in tensors.items():
        _require(
            isinstance(tensor, torch.Tensor)
            and tensor.device.type == "cpu"
            and tensor.dim() == 1
            and tensor.is_contiguous()
            and tensor.numel() == n,
            f"{name}: expected a contiguous 1-d CPU tensor of {n} elements, got "
            f"{tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__}",
        )
        if dtype is not None:
            _require(tensor.dtype == dtype, f"{name}: expected dtype {dtype}, got {tensor.dtype}")


def first_level(
    logp: torch.Tensor,
    behavior_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    sums: torch.Tensor,
    counts: torch.Tensor,
    trust: torch.Tensor,
    bucket: torch.Tensor,
) -> tuple[int, int, bool]:
    """The first radix level over every token in one pass: per bucket (M2's top 16 bits)
    the candidates' M2 summed in index order into ``sums`` and counted into ``counts``
    (float64, BUCKETS each, overwritten), ``trust`` (bool) and ``bucket`` (int16) written
    for every token. Returns the candidate count, the valid-token count and whether every
    input on a valid token is finite."""
    n = mask.numel()
    _check_tokens(n, logp.dtype, logp=logp, behavior_logp=behavior_logp, advantages=advantages)
    _require(logp.dtype in DTYPE_CODES, f"logp: expected float64, float32 or bfloat16, got {logp.dtype}")
    _check_tokens(n, torch.bool, mask=mask, trust=trust)
    _check_tokens(n, torch.int16, bucket=bucket)
    _check_tokens(BUCKETS, torch.float64, sums=sums, counts=counts)
    # The histogram's (sum, count) cells, the BANK after the buckets for non-candidates.
    cells = getattr(_STATE, "cells", None)
    if cells is None:
        cells = _STATE.cells = torch.empty(BUCKETS + BANK, 2, dtype=torch.float64)
    _STATE.first_levels = first_levels_run() + 1
    return _extension.first_level(
        logp.data_ptr(),
        behavior_logp.data_ptr(),
        advantages.data_ptr(),
        mask.data_ptr(),
        n,
        DTYPE_CODES[logp.dtype],
        cells.data_ptr(),
        sums.data_ptr(),
        counts.data_ptr(),
        trust.data_ptr(),
        bucket.data_ptr(),
    )


def finish(
    bucket: torch.Tensor, trust: torch.Tensor, mask: torch.Tensor, *, crossing: int | None, size: int, keep: torch.Tensor
) -> torch.Tensor:
    """The selection's pass over every token once the first level's cut is known: writes
    ``keep`` = mask and (not a candidate, or a candidate whose bucket is below ``crossing``)
    and returns the positions, in index order, of the ``size`` candidates still to decide:
    those in bucket ``crossing``, or every candidate (none kept yet) where it is None."""
    n = mask.numel()
    _check_tokens(n, torch.bool, trust=trust, mask=mask, keep=keep)
    _check_tokens(n, torch.int16, bucket=bucket)
    _require(0 <= size <= n, f"size: expected 0 .. {n}, got {size}")
    positions = torch.empty(size, dtype=torch.int64)
    # Every candidate to decide: none is below bucket 0 (a candidate's M2 is >= +0).
    below, alive = (0, -1) if crossing is None else (crossing, crossing)
    found = _extension.finish(
        bucket.data_ptr(), trust.data_ptr(), mask.data_ptr(), n, below, alive, crossing is None, keep.data_ptr(), positions.data_ptr(), size
    )
    if found != size:
        raise RuntimeError(f"fused finish: {found} candidates to decide where the first level counted {size}")
    return positions


def loss_terms(
    logp: torch.Tensor, behavior_logp: torch.Tensor, advantages: torch.Tensor, keep: torch.Tensor, ratio: torch.Tensor, weight: torch.Tensor
) -> None:
    """The loss's terms before ``exp``: ``ratio`` = logp - behavior_logp and ``weight`` = A
    in the compute precision (float64 for float64 inputs, else float32), both +0 where
    ``keep`` is False."""
    n = keep.numel()
    _check_tokens(n, logp.dtype, logp=logp, behavior_logp=behavior_logp, advantages=advantages)
    _require(logp.dtype in DTYPE_CODES, f"logp: expected float64, float32 or bfloat16, got {logp.dtype}")
    _check_tokens(n, torch.bool, keep=keep)
    compute = torch.float64 if logp.dtype == torch.float64 else torch.float32
    _check_tokens(n, compute, ratio=ratio, weight=weight)
    _extension.loss_terms(
        logp.data_ptr(),
        behavior_logp.data_ptr(),
        advantages.data_ptr(),
        keep.data_ptr(),
        n,
        DTYPE_CODES[logp.dtype],
        ratio.data_ptr(),
        weight.data_ptr(),
    )


@dataclass(frozen=True)
class FirstCut:
    """The first level's cut on the host: the crossing bucket (BUCKETS when nothing
    crosses), the sum and count of the candidates below it (all of them when nothing
    crosses), and the count in bucket min(crossing, BUCKETS - 1)."""

    crossing: int
    kept_sum: float
    kept_count: float
    tied_count: float

    def descent(self) -> Descent:
        """The same state as ``Descent.start(cpu).step(sums, counts, tau, 0)``'s, as tensors."""
        return Descent.after_first_level(self.crossing, self.kept_sum, self.kept_count, self.tied_count)


def first_cut(sums: torch.Tensor, counts: torch.Tensor, tau: float) -> FirstCut:
    """The first level's cut from its histogram (``sums`` and ``counts``, BUCKETS float64
    each), in one pass: the numbers ``Descent.start(cpu).step(sums, counts, tau, 0)`` finds,
    to the last bit."""
    _check_tokens(BUCKETS, torch.float64, sums=sums, counts=counts)
    _require(isinstance(tau, float), f"tau: expected a float, got {type(tau).__name__}")
    return FirstCut(*_extension.first_cut(sums.data_ptr(), counts.data_ptr(), tau))


def sorted_cut(
    logp: torch.Tensor,
    behavior_logp: torch.Tensor,
    positions: torch.Tensor,
    keep: torch.Tensor,
    *,
    kept_sum: float,
    kept_count: float,
    tau: float,
) -> tuple[int, float]:
    """The crossing bucket's cut by sorting, in one call: the M2 of the tokens at
    ``positions`` (the candidates still to decide, in index order) as the core computes
    it, then the cut ``fast_selection.cut_of_crossing_bucket`` makes by sorting them (it
    sorts up to SORT_AT_MOST values, and the core calls this for no more), after a first
    level that kept ``kept_count`` values summing to ``kept_sum``, to the last bit.
    Writes ``keep`` at ``positions``; returns how many of them are kept and the kept sum
    (the first level's and theirs)."""
    n = keep.numel()
    _check_tokens(n, logp.dtype, logp=logp, behavior_logp=behavior_logp)
    _require(logp.dtype in DTYPE_CODES, f"logp: expected float64, float32 or bfloat16, got {logp.dtype}")
    _check_tokens(n, torch.bool, keep=keep)
    size = positions.numel()
    _check_tokens(size, torch.int64, positions=positions)
    for name, value in (("kept_sum", kept_sum), ("kept_count", kept_count), ("tau", tau)):
        _require(isinstance(value, float), f"{name}: expected a float, got {type(value).__name__}")
    pairs = torch.empty(4 * size, dtype=torch.int64)  # (key, index) pairs, twice: the sort's two buffers
    # The extension checks every position against n before it writes (a ValueError naming positions).
    return _extension.sorted_cut(
        logp.data_ptr(),
        behavior_logp.data_ptr(),
        DTYPE_CODES[logp.dtype],
        n,
        positions.data_ptr(),
        size,
        kept_sum,
        kept_count,
        tau,
        pairs.data_ptr(),
        keep.data_ptr(),
    )
