"""Logged metrics averaged unweighted over micro-batches: a finding about the logs, not the selection.

Algorithm 1's metrics are means over tokens of the whole optimizer batch: ``masked_fraction``
and ``trust_region_fraction`` over its N valid tokens, ``m2_before`` over its trust-region
tokens, ``m2_after`` over its kept trust-region tokens. A port that computes them on each
micro-batch (its own tokens, on the right mask) and hands them to a trainer that averages what
the loss returns with equal weight per micro-batch (verl 0.9.1 wraps a policy loss's metrics in
``Metric(aggregation=MEAN)``) logs the unweighted mean of the micro-batches' values. Weighted
by each micro-batch's count, the same values give Algorithm 1's number exactly; unweighted,
they differ wherever the micro-batches' counts do.

:func:`unweighted_mean_reproduces` is the rule, pure (no torch, no NumPy): from each
micro-batch's values and counts it computes both means, and reproduces a logged set of
metrics only where every logged metric that is not the weighted value is the unweighted one.
A logged value that is neither gets no explanation from it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

#: The name a step or an audit gives it, and the kind of the report's finding.
NAME = "unweighted_micro_batch_metric_mean"

#: Each logged metric and the count it is a mean over (its weight per micro-batch).
METRIC_WEIGHTS: dict[str, str] = {
    "m2_before": "trust_region_count",
    "m2_after": "kept_trust_region_count",
    "masked_fraction": "valid_count",
    "trust_region_fraction": "valid_count",
}

#: What a trainer does that makes the logged number the unweighted mean (the report says it).
WHAT_THE_TRAINER_DOES = (
    "verl 0.9.1 averages the metrics a policy loss returns with equal weight per micro-batch "
    "(ppo_loss wraps them in Metric(aggregation=MEAN))"
)


@dataclass(frozen=True)
class AveragedMetric:
    """One logged metric beside the two means of its micro-batches' values."""

    name: str
    logged: float
    weighted: float  # the micro-batches' values weighted by their counts: Algorithm 1's value
    unweighted: float  # their plain mean, one weight per micro-batch
    values: tuple[float, ...]  # each micro-batch's own value
    counts: tuple[int, ...]  # each micro-batch's count (METRIC_WEIGHTS)

    def text(self) -> str:
        parts = ", ".join(f"{v:.6g} over {c}" for v, c in zip(self.values, self.counts))
        return (
            f"{self.name} logged {self.logged:.6g}, token-weighted {self.weighted:.6g} "
            f"(the unweighted mean of the micro-batches' own values {parts} is {self.unweighted:.6g})"
        )


@dataclass(frozen=True)
class UnweightedMean:
    """The logged metrics the unweighted mean reproduces, the differing ones first."""

    micro_batches: int
    differing: tuple[AveragedMetric, ...]  # logged values that are not the weighted one (the unweighted one instead)
    agreeing: tuple[AveragedMetric, ...]  # logged values that are the weighted one

    def summary(self) -> str:
        shown = "; ".join(m.text() for m in self.differing)
        same = [m for m in self.agreeing if len(set(m.values)) > 1]  # per-micro-batch values that happen to average right
        alike = (
            f" ({', '.join(m.name for m in same)}: per micro-batch too, but here their unweighted mean happens to be the "
            "token-weighted value)"
            if same
            else ""
        )
        return (
            f"{shown}{alike}: each of the {self.micro_batches} micro-batches reports its own value and the log holds their "
            f"unweighted mean, where Algorithm 1's metric weights each micro-batch by its tokens; {WHAT_THE_TRAINER_DOES}. "
            "The selection is right; only the logged number is not Algorithm 1's"
        )


def weighted_and_unweighted(values: Sequence[float], counts: Sequence[int]) -> tuple[float, float]:
    """The count-weighted mean (0 where every count is 0, as Algorithm 1 writes an empty mean)
    and the plain mean of ``values`` (one per micro-batch)."""
    if len(values) != len(counts) or not values:
        raise ValueError(f"values and counts: expected one of each per micro-batch, got {len(values)} and {len(counts)}")
    total = sum(counts)
    weighted = math.fsum(v * c for v, c in zip(values, counts)) / total if total else 0.0
    return weighted, math.fsum(values) / len(values)


def unweighted_mean_reproduces(
    logged: Mapping[str, float],
    values: Sequence[Mapping[str, float]],
    counts: Sequence[Mapping[str, int]],
    close: Callable[[str, float, float], bool],
) -> UnweightedMean | None:
    """The finding where the logged metrics are the unweighted mean over the micro-batches of
    their own values, and not Algorithm 1's token-weighted mean; else None.

    ``logged``: the logged metrics by our names (others are ignored); ``values``: each
    micro-batch's own metrics (on the step's mask), ``counts``: its counts (by
    :data:`METRIC_WEIGHTS`' names); ``close(name, actual, expected)``: within the metric's
    tolerance. None unless some logged metric differs from the weighted value, and every one
    that does equals the unweighted mean (a logged value that matches neither: None)."""
    if len(values) != len(counts):
        raise ValueError(f"values and counts: expected one of each per micro-batch, got {len(values)} and {len(counts)}")
    differing, agreeing = [], []
    for name, weight in METRIC_WEIGHTS.items():
        if name not in logged or not values:
            continue
        own = tuple(float(v[name]) for v in values)
        n = tuple(int(c[weight]) for c in counts)
        weighted, unweighted = weighted_and_unweighted(own, n)
        value = float(logged[name])
        found = AveragedMetric(name, value, weighted, unweighted, own, n)
        if close(name, value, weighted):
            agreeing.append(found)
        elif close(name, value, unweighted):
            differing.append(found)
        else:
            return None  # neither mean: the averaging does not explain this log
    if not differing:
        return None
    return UnweightedMean(len(values), tuple(differing), tuple(agreeing))
