"""The one result record every M2PO computation is reduced to (torch-free).

The oracle fills it with NumPy values, measured implementations are normalised into it by
:mod:`m2po_oracle.judge.contract`, and :mod:`m2po_oracle.judge.equivalence` compares two of them field
by field.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from m2po_oracle.oracle.batch import Batch

#: Scalar metrics of Algorithm 1, in the order reports show them.
METRIC_FIELDS: tuple[str, ...] = (
    "m2_before",
    "m2_after",
    "masked_fraction",
    "trust_region_fraction",
)
#: Integer counts of Algorithm 1.
COUNT_FIELDS: tuple[str, ...] = (
    "valid_count",
    "trust_region_count",
    "kept_trust_region_count",
)


#: The key of a wrapped (adapted) implementation's raw result that says where in the
#: port's return each metric was read (ours -> place): carried into M2POResult.metric_sources.
METRIC_SOURCES = "metric_sources"


@dataclass(frozen=True)
class M2POResult:
    """Every quantity Algorithm 1 defines for one optimizer batch.

    ``keep`` is a bool array shaped like the batch. ``grad`` is d loss / d logp (analytic
    for the oracle, autograd for a measured implementation) or ``None`` where unknown.
    Metrics and counts are ``None`` when an implementation does not report them.
    """

    loss: float
    keep: np.ndarray
    grad: np.ndarray | None = None
    m2_before: float | None = None
    m2_after: float | None = None
    masked_fraction: float | None = None
    trust_region_fraction: float | None = None
    valid_count: int | None = None
    trust_region_count: int | None = None
    kept_trust_region_count: int | None = None
    #: Where an adapted port's metrics were read in its return, ours -> its place (e.g.
    #: ``m2_before: "[1]['m2']"``); empty for an implementation of the contract.
    metric_sources: tuple[tuple[str, str], ...] = ()

    def reported(self) -> dict[str, Any]:
        """Metrics and counts that are not ``None``."""
        names = METRIC_FIELDS + COUNT_FIELDS
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in names and getattr(self, f.name) is not None}


@dataclass(frozen=True)
class PaddingProbe:
    """One padding probe whose result differed from the zero-padded run's: what filled the
    padding (``"nan"``, ``"inf"``, ``"-inf"``, the drawn padding, small trust-region
    tokens), the batch as probed and the implementation's result on it."""

    fill: str
    batch: Batch
    result: M2POResult

    def non_finite(self) -> tuple[str, tuple[int, ...] | None, float] | None:
        """Where the result is NaN/inf: ("loss", None, value), ("valid token" or "padding
        position", index, value) for the gradient, or None where all of it is finite."""
        if not np.isfinite(self.result.loss):
            return ("loss", None, float(self.result.loss))
        grad = self.result.grad
        if grad is None:
            return None
        bad = ~np.isfinite(grad)
        for where, inside in (("valid token", self.batch.valid), ("padding position", ~self.batch.valid)):
            at = np.argwhere(bad & inside)
            if at.size:
                index = tuple(int(i) for i in at[0])
                return (where, index, float(grad[index]))
        return None
