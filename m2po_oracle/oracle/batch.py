"""One optimizer batch as Algorithm 1 sees it, in float64 NumPy (torch-free)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from m2po_oracle.oracle.encoding import to_builtins


def _decode(rows: list) -> np.ndarray:
    return np.array([[float(v) for v in row] for row in rows], dtype=np.float64).reshape(len(rows), -1)


#: The float inputs padding fills, in the order reports name them.
PADDED_INPUTS: tuple[str, ...] = ("logp", "behavior_logp", "advantages")


@dataclass(frozen=True, eq=False)
class Batch:
    """Inputs of Algorithm 1 for one optimizer batch, shape [B, T].

    ``valid`` is the loss mask; values at invalid positions are padding and may be anything,
    NaN and inf included. ``tau`` is the second-moment budget.
    """

    logp: np.ndarray
    behavior_logp: np.ndarray
    advantages: np.ndarray
    valid: np.ndarray
    tau: float = 0.04

    def __post_init__(self) -> None:
        for name in ("logp", "behavior_logp", "advantages", "valid"):
            value = getattr(self, name)
            if not isinstance(value, np.ndarray):
                raise TypeError(f"Batch.{name}: expected a numpy.ndarray, got {type(value).__name__}")
            if value.ndim != 2:
                raise ValueError(f"Batch.{name}: expected a 2-d array [B, T], got shape {value.shape}")
            if value.shape != self.logp.shape:
                raise ValueError(f"Batch.{name}: shape {value.shape} differs from logp's {self.logp.shape}")
        for name in ("logp", "behavior_logp", "advantages"):
            if getattr(self, name).dtype != np.float64:
                raise ValueError(f"Batch.{name}: expected float64, got {getattr(self, name).dtype}")
        if self.valid.dtype != np.bool_:
            raise ValueError(f"Batch.valid: expected a bool array, got {self.valid.dtype}")
        if isinstance(self.tau, bool) or not isinstance(self.tau, (int, float)) or not math.isfinite(self.tau) or self.tau < 0:
            raise ValueError(f"Batch.tau: expected a finite number >= 0, got {self.tau!r}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.logp.shape

    def to_dict(self) -> dict[str, Any]:
        """Its JSON form (``valid`` as 0/1), derived from the declaration; tau as a float
        (a batch may hold a numpy scalar or an int: the port is called with it as it is)."""
        return {**to_builtins(self), "tau": float(self.tau)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Batch:
        missing = {"logp", "behavior_logp", "advantages", "valid"} - set(data)
        if missing:
            raise ValueError(f"batch: missing field(s) {sorted(missing)}")
        valid_rows = data["valid"]
        valid = np.array(valid_rows, dtype=np.int64).reshape(len(valid_rows), -1)
        if not np.isin(valid, (0, 1)).all():
            raise ValueError("batch.valid: expected 0/1 or true/false entries")
        return cls(
            logp=_decode(data["logp"]),
            behavior_logp=_decode(data["behavior_logp"]),
            advantages=_decode(data["advantages"]),
            valid=valid.astype(bool),
            tau=float(data.get("tau", 0.04)),
        )

    @classmethod
    def from_json(cls, text: str) -> Batch:
        return cls.from_dict(json.loads(text))

    def with_padding(self, value: float) -> Batch:
        """The same batch with every invalid position of every float input set to ``value``."""
        fill = lambda a: np.where(self.valid, a, value)  # noqa: E731
        return Batch(fill(self.logp), fill(self.behavior_logp), fill(self.advantages), self.valid.copy(), self.tau)

    def padding_only_in(self, name: str) -> Batch:
        """The same batch keeping the padding of the one input ``name`` and setting every
        other input's padding to 0: which input a padding leak comes through."""
        if name not in PADDED_INPUTS:
            raise ValueError(f"name: one of {', '.join(PADDED_INPUTS)}, got {name!r}")
        zero = self.with_padding(0.0)
        values = {n: getattr(zero, n) for n in PADDED_INPUTS}
        values[name] = getattr(self, name).copy()
        return Batch(values["logp"], values["behavior_logp"], values["advantages"], self.valid.copy(), self.tau)

    def with_trust_region_padding(self) -> Batch:
        """The same batch with every invalid position made a small trust-region token, as
        real padding looks (finite log-probs, the row's advantage): logp = -1 + 2**-6,
        behavior_logp = -1, A = 1, so d = 2**-6 and M2 = 2**-12 (exact down to bfloat16).
        A selection that lets padding compete keeps such tokens first and so keeps more valid
        ones; NaN/inf padding never competes and 0 or huge padding never changes the cut."""

        def fill(a: np.ndarray, value: float) -> np.ndarray:
            return np.where(self.valid, a, value)

        return Batch(
            fill(self.logp, -1.0 + 2.0**-6), fill(self.behavior_logp, -1.0), fill(self.advantages, 1.0), self.valid.copy(), self.tau
        )

    def with_finite_padding(self, value: float = 0.0) -> Batch:
        """The same batch with every NaN/inf at an invalid position set to ``value`` (finite
        padding is kept): the values a port is judged on, apart from the padding probes."""
        fill = lambda a: np.where(self.valid | np.isfinite(a), a, value)  # noqa: E731
        return Batch(fill(self.logp), fill(self.behavior_logp), fill(self.advantages), self.valid.copy(), self.tau)

    def describe(self) -> str:
        """A compact, copy-pasteable rendering for failure messages."""
        with np.printoptions(precision=17, threshold=10_000, linewidth=120):
            return (
                f"Batch(tau={self.tau!r}, shape={self.shape},\n"
                f"  logp={np.array2string(self.logp, separator=', ')},\n"
                f"  behavior_logp={np.array2string(self.behavior_logp, separator=', ')},\n"
                f"  advantages={np.array2string(self.advantages, separator=', ')},\n"
                f"  valid={np.array2string(self.valid.astype(int), separator=', ')})"
            )
