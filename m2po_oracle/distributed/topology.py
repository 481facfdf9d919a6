"""Rank and shard arithmetic of a Megatron-style DP x CP x TP world (NumPy only, torch-free).

Ranks are laid out as Megatron-core's default order ``tp-cp-ep-dp-pp`` does with ep = pp = 1:
tensor parallel varies fastest, then context parallel, then data parallel, so
``rank = tp_rank + tp * (cp_rank + cp * dp_rank)``.

Context parallelism uses Megatron's load balancing for causal attention: the sequence is cut
into ``2 * cp`` equal chunks and CP rank ``i`` holds chunks ``i`` and ``2 * cp - 1 - i``, so that
every rank gets one cheap early chunk and one expensive late chunk.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import SupportsIndex, cast

import numpy as np

GROUP_KINDS = ("tp", "cp", "dp", "dp_cp")

_AXES = ("dp", "cp", "tp")
# The axes whose coordinate varies inside one group of each kind; the others are shared.
_VARYING = {"tp": ("tp",), "cp": ("cp",), "dp": ("dp",), "dp_cp": ("dp", "cp")}
_PART = re.compile(r"\s*([A-Za-z_]\w*)\s*=\s*([0-9]+)\s*")
_FORM = "'KEY=N' parts joined by commas, KEY one of dp, cp, tp and N an integer >= 1 (e.g. 'dp=2,cp=2,tp=1')"


def _integer(name: str, value: object, minimum: int) -> int:
    # bool is an int subclass; True as a size or rank is always a caller's mistake.
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    try:
        number = operator.index(cast(SupportsIndex, value))  # a TypeError, caught, for anything else
    except TypeError:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}") from None
    if number < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {number}")
    return number


def _index(name: str, value: object, size: int, size_name: str) -> int:
    number = _integer(name, value, 0)
    if number >= size:
        raise ValueError(f"{name} must be in 0..{size - 1} ({size_name} = {size}), got {number}")
    return number


@dataclass(frozen=True)
class RankCoords:
    """Where one global rank sits in the DP x CP x TP grid."""

    dp: int
    cp: int
    tp: int


@dataclass(frozen=True)
class Topology:
    """A DP x CP x TP world of ``dp * cp * tp`` ranks laid out in Megatron order."""

    dp: int
    cp: int
    tp: int

    def __post_init__(self) -> None:
        for axis in _AXES:
            # Normalise NumPy integers to int so equal topologies compare and hash equal.
            object.__setattr__(self, axis, _integer(axis, getattr(self, axis), 1))

    @property
    def world_size(self) -> int:
        """Number of ranks in the world."""
        return self.dp * self.cp * self.tp

    @classmethod
    def parse(cls, text: str) -> Topology:
        """Read ``"dp=2,cp=2,tp=1"``: keys in any order, a missing key means 1.

        The empty string is rejected rather than read as a 1-rank world, so that an unset
        option or a lost command-line argument cannot silently become ``dp=1,cp=1,tp=1``.
        """
        if not isinstance(text, str):
            raise ValueError(f"topology must be a string of {_FORM}, got {text!r}")
        if not text.strip():
            raise ValueError(f"empty topology string: expected {_FORM}")
        sizes: dict[str, int] = {}
        for part in text.split(","):
            match = _PART.fullmatch(part)
            if match is None:
                raise ValueError(f"bad topology part {part!r} in {text!r}: expected {_FORM}")
            key, value = match.group(1), int(match.group(2))
            if key not in _AXES:
                raise ValueError(f"unknown topology key {key!r} in {text!r}: expected {_FORM}")
            if key in sizes:
                raise ValueError(f"duplicate topology key {key!r} in {text!r}: expected {_FORM}")
            if value < 1:
                raise ValueError(f"topology part {part.strip()!r} in {text!r} is < 1: expected {_FORM}")
            sizes[key] = value
        return cls(**{axis: sizes.get(axis, 1) for axis in _AXES})

    def __str__(self) -> str:
        return f"dp={self.dp},cp={self.cp},tp={self.tp}"

    def _grid(self) -> np.ndarray:
        # grid[dp, cp, tp] == global rank; C order makes tp the fastest-varying axis.
        return np.arange(self.world_size).reshape(self.dp, self.cp, self.tp)

    def coords(self, rank: int) -> RankCoords:
        """The (dp, cp, tp) coordinates of a global rank."""
        rank = _index("rank", rank, self.world_size, "world_size")
        rest, tp = divmod(rank, self.tp)
        dp, cp = divmod(rest, self.cp)
        return RankCoords(dp=dp, cp=cp, tp=tp)

    def rank(self, *, dp: int, cp: int, tp: int) -> int:
        """The global rank at the given coordinates (inverse of :meth:`coords`)."""
        dp = _index("dp", dp, self.dp, "dp size")
        cp = _index("cp", cp, self.cp, "cp size")
        tp = _index("tp", tp, self.tp, "tp size")
        return tp + self.tp * (cp + self.cp * dp)

    def groups(self, kind: str) -> list[list[int]]:
        """Every process group of one kind, each sorted, listed by ascending smallest rank.

        ``tp``: ranks sharing (dp, cp); ``cp``: sharing (dp, tp); ``dp``: sharing (cp, tp), the
        pure data-parallel group; ``dp_cp``: sharing tp, Megatron's data-parallel group "with
        context parallel", over which gradients are reduced when CP > 1.
        """
        varying = _varying(kind)
        shared = [axis for axis in _AXES if axis not in varying]
        order = [_AXES.index(axis) for axis in (*shared, *varying)]
        size = int(np.prod([getattr(self, axis) for axis in varying]))
        rows = self._grid().transpose(order).reshape(-1, size)
        return sorted(sorted(int(r) for r in row) for row in rows)

    def group_of(self, rank: int, kind: str) -> list[int]:
        """The sorted ranks of the group of ``kind`` that contains ``rank``."""
        varying = _varying(kind)
        at = self.coords(rank)
        index = tuple(slice(None) if axis in varying else getattr(at, axis) for axis in _AXES)
        return sorted(int(r) for r in self._grid()[index].ravel())


def _varying(kind: object) -> tuple[str, ...]:
    if kind not in GROUP_KINDS:
        raise ValueError(f"unknown group kind {kind!r}: expected one of {GROUP_KINDS}")
    return _VARYING[kind]


def cp_chunk_ids(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two of the ``2 * cp_size`` sequence chunks that CP rank ``cp_rank`` holds, in order."""
    cp_size = _integer("cp_size", cp_size, 1)
    cp_rank = _index("cp_rank", cp_rank, cp_size, "cp_size")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def cp_token_indices(seq_len: int, cp_size: int, cp_rank: int) -> np.ndarray:
    """The int64 sequence positions CP rank ``cp_rank`` holds, in the order it holds them.

    ``seq_len`` must be a multiple of ``2 * cp_size``. With ``cp_size == 1`` any length is
    accepted and the result is ``arange(seq_len)``: Megatron does not slice at all then.
    """
    seq_len = _integer("seq_len", seq_len, 0)
    cp_size = _integer("cp_size", cp_size, 1)
    first, second = cp_chunk_ids(cp_size, cp_rank)
    if cp_size == 1:
        return np.arange(seq_len, dtype=np.int64)
    if seq_len % (2 * cp_size):
        raise ValueError(f"seq_len must be a multiple of 2 * cp_size = {2 * cp_size} for context parallelism, got seq_len = {seq_len}")
    chunk = seq_len // (2 * cp_size)
    return np.concatenate([np.arange(first * chunk, (first + 1) * chunk), np.arange(second * chunk, (second + 1) * chunk)]).astype(np.int64)


def _sequence_array(name: str, x: object) -> np.ndarray:
    array = np.asarray(x)
    if array.ndim < 1:
        raise ValueError(f"{name} must have a sequence (last) axis, shape [B, T]; got a 0-d array")
    return array


def cp_shard(x: np.ndarray, cp_size: int, cp_rank: int) -> np.ndarray:
    """The part of ``x`` (shape [B, T], sequence last) that CP rank ``cp_rank`` holds: [B, T // cp_size]."""
    x = _sequence_array("x", x)
    return x[..., cp_token_indices(x.shape[-1], cp_size, cp_rank)]


def cp_reconstruct(shards: Sequence[np.ndarray], cp_size: int) -> np.ndarray:
    """Undo :func:`cp_shard`: the full [B, T] array from the shards of CP ranks 0..cp_size-1 in order."""
    cp_size = _integer("cp_size", cp_size, 1)
    if len(shards) != cp_size:
        raise ValueError(f"shards must hold one array per CP rank (cp_size = {cp_size}), got {len(shards)}")
    arrays = [_sequence_array(f"shards[{i}]", s) for i, s in enumerate(shards)]
    shape = arrays[0].shape
    for i, array in enumerate(arrays):
        if array.shape != shape:
            raise ValueError(f"shards must all have one shape; shards[0] is {shape}, shards[{i}] is {array.shape}")
    if cp_size > 1 and shape[-1] % 2:
        raise ValueError(f"each shard holds two equal chunks, so its length must be even; got {shape[-1]}")
    seq_len = shape[-1] * cp_size
    out = np.empty((*shape[:-1], seq_len), dtype=np.result_type(*arrays))
    for cp_rank, array in enumerate(arrays):
        out[..., cp_token_indices(seq_len, cp_size, cp_rank)] = array
    return out


def dp_row_slices(rows: int, dp_size: int) -> list[slice]:
    """Contiguous row ranges of a batch for DP ranks 0..dp_size-1, as ``numpy.array_split`` cuts.

    Sizes differ by at most one, the first ``rows % dp_size`` ranks getting the extra row; a rank
    may get none when ``rows < dp_size``.
    """
    rows = _integer("rows", rows, 0)
    dp_size = _integer("dp_size", dp_size, 1)
    base, extra = divmod(rows, dp_size)
    slices, start = [], 0
    for dp_rank in range(dp_size):
        stop = start + base + (dp_rank < extra)
        slices.append(slice(start, stop))
        start = stop
    return slices
