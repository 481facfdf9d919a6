"""Fitting a deviation's parameters to the examples: floors and epsilon read from them
directly, the rest tried over small grids; the simplest value that reproduces wins."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from m2po_oracle.explain import variants
from m2po_oracle.explain.deviations import (
    ALGORITHM_1,
    Deviation,
    fitted_name,
    variant,
)
from m2po_oracle.explain.evidence import Judge, in_order, merge


@dataclass(frozen=True)
class Parameter:
    """A value a port picks itself: the values the search tries (the default first; none
    where the data pins it down directly), and the range a port would plausibly write, with
    why. A fitted value outside that range is no fit: it describes the data in the words of
    code no port has (a clip floor of 1e16 is a clip that never binds)."""

    grid: tuple[float, ...]
    low: float
    high: float
    reason: str

    def plausible(self, value: float | tuple[float, ...]) -> bool:
        values = value if isinstance(value, tuple) else (value,)
        return all(self.low <= v <= self.high for v in values)


PARAMETERS: dict[str, Parameter] = {
    "clamp_log_ratio": Parameter(
        (20.0, 10.0, 5.0, 15.0, 30.0, 50.0, 1.0, 2.0),
        1.0,
        50.0,
        "a guard on exp(d): a handful to a few tens of nats (exp(50) already overflows nothing a port computes)",
    ),
    "candidate_margin": Parameter((1e-12, 1e-10, 1e-8, 1e-6, 1e-15), 0.0, 1e-4, "a rounding guard in a comparison, far below any d"),
    "noop_margin": Parameter((1e-12, 1e-10, 1e-8, 1e-6, 1e-15), 0.0, 1e-4, "a rounding guard in a comparison, far below any budget"),
    "budget_scale": Parameter((0.5, 0.25, 2.0, 4.0), 0.1, 10.0, "a factor a port writes by mistake: tau / 2, 2 tau"),
    "unconstrained_ratio_bound": Parameter((1e5, 1e4, 1e6, 1e8), 10.0, 1e8, "'no clip' written as a large ratio bound"),
    "clip_floors": Parameter(
        (), 0.0, 0.99, "a miniclip floor is a fraction of the ratio, [1 - low, 1 + high]: at 1 or more it never binds on that side"
    ),
    "denominator_epsilon": Parameter((), 0.0, 1e-3, "an epsilon that guards a division by a token count"),
}


def acts(judge: Judge, dev: Deviation) -> bool:
    """Whether ``dev``'s clip range binds on some example of the sample: a clip that removes
    no gradient anywhere (floors fitted so wide that nothing lies beyond them) is a no-op,
    whatever its name says. Every other deviation acts where it changes a result, which the
    pruning already tests."""
    if dev.selection_kind == "mask":
        return True
    return any(not np.array_equal(judge.predicted_keep(dev, i), judge.observations[i].batch.valid) for i in judge.sample)


def fit_direct(judge: Judge, names: frozenset[str], fitted: frozenset[str]) -> frozenset[str]:
    """``names`` with each of ``fitted`` that a port parameterises given the value the data
    pins down (a cheap fit only: floors and epsilon are read from the examples directly)."""
    for name in fitted:
        known = variant(name)
        fitter = DIRECT_FITTERS.get(known.parameter or "")
        if fitter is None:
            continue
        assert known.parameter is not None  # DIRECT_FITTERS is keyed by parameter names
        rest = merge(names - {name})
        if rest is None:
            continue
        value = fitter(judge, merge(names) or ALGORITHM_1)
        if value is None or value == getattr(known.deviation, known.parameter) or not PARAMETERS[known.parameter].plausible(value):
            continue
        trial = (names - {name}) | {fitted_name(known.base, value)}
        if judge.score(merge(trial) or ALGORITHM_1) > judge.score(merge(names) or ALGORITHM_1):
            names = trial
    return names


def refit_on_grids(judge: Judge, names: frozenset[str]) -> frozenset[str]:
    """The final explanation with each parameter that no direct fit pins tried over its grid."""
    for name in sorted(names, key=in_order):
        known = variant(name)
        grid = PARAMETERS[known.parameter].grid if known.parameter else ()
        if not grid:
            continue
        assert known.parameter is not None  # PARAMETER_GRIDS is keyed by parameter names
        rest = names - {name}
        scored: list[tuple[int, int, frozenset[str]]] = []
        for value in grid:
            trial = rest | {
                fitted_name(known.base, value) if value != getattr(variant(known.base).deviation, known.parameter) else known.base
            }
            dev = merge(trial)
            if dev is not None:
                scored.append((judge.score(dev), -len(scored), trial))
        if scored:
            names = max(scored, key=lambda t: (t[0], t[1]))[2]
    return names


def _simplest_in(lower: float, upper: float, default: float) -> float | None:
    """The default when it lies in [lower, upper), else the number with fewest decimals there."""
    if lower > upper or (lower == upper and lower != default):
        return None
    if lower <= default < upper or default == lower == upper:
        return default
    for decimals in range(1, 7):
        scale = 10.0**decimals
        candidate = math.ceil(lower * scale - 1e-9) / scale
        if candidate < upper:
            return round(candidate, decimals)
    return lower


def _fit_floors(judge: Judge, dev: Deviation) -> tuple[float, float] | None:
    """Floors (low, high) from where the port's clip range ends: a token beyond the budget's
    own range that the port kept (it has a gradient) lies within the floors, one it clipped
    lies beyond them."""
    if dev.selection_kind == "mask" or dev.clip_floors is None:
        return None
    bare = replace(dev, clip_floors=None)
    bounds = {"low": [0.0, math.inf], "high": [0.0, math.inf]}
    evidence = False
    for i in judge.sample:
        batch, actual = judge.observations[i].batch, judge.observations[i].result
        outcome = variants.clip_outcome(batch, bare)
        if outcome.cap_squared is None:
            continue
        d = variants.selection_log_ratio(variants.log_ratio(batch, dev), dev)
        with np.errstate(over="ignore", invalid="ignore"):
            r = np.exp(np.where(batch.valid, d, 0.0))
        a = np.where(batch.valid, batch.advantages, 0.0)
        for side_name, beyond, gap in (("high", (a > 0) & (r > outcome.high), r - 1.0), ("low", (a < 0) & (r < outcome.low), 1.0 - r)):
            beyond &= batch.valid
            kept, clipped = gap[beyond & actual.keep], gap[beyond & ~actual.keep]
            if kept.size:
                bounds[side_name][0] = max(bounds[side_name][0], float(kept.max()))
            if clipped.size:
                bounds[side_name][1] = min(bounds[side_name][1], float(clipped.min()))
            evidence |= bool(kept.size or clipped.size)
    if not evidence:
        return None
    # Only a plausible floor is a fit: bound the intervals before reading values from them.
    most = PARAMETERS["clip_floors"].high
    for side_name in bounds:
        bounds[side_name][1] = min(bounds[side_name][1], most + 1e-9)
        if bounds[side_name][0] > most:
            return None
    low = _simplest_in(*bounds["low"], default=dev.clip_floors[0])  # type: ignore[misc]  # mypy: an unpacked list of unknown length may fill every parameter (it holds two here)
    high = _simplest_in(*bounds["high"], default=dev.clip_floors[1])  # type: ignore[misc]  # mypy: an unpacked list of unknown length may fill every parameter (it holds two here)
    if low is None or high is None:
        return None
    # The selection bounds each floor to an interval; a clipped token's loss VALUE sits on the
    # floor itself, so the round value within the interval that reproduces the most decides.
    for side in (0, 1):
        candidates = _round_values_in(*bounds[("low", "high")[side]], default=dev.clip_floors[side])  # type: ignore[misc, arg-type]  # mypy: an unpacked list of unknown length may fill every parameter (it holds two here)
        if len(candidates) > 1:
            pair = lambda v: (v, high) if side == 0 else (low, v)  # noqa: E731, B023 - called within this iteration
            scored = [(judge.score(replace(dev, clip_floors=pair(v))), -k, v) for k, v in enumerate(candidates)]
            chosen = max(scored)[2]
            low, high = pair(chosen)
    return (low, high)


def _round_values_in(lower: float, upper: float, default: float, most: int = 12) -> list[float]:
    """The default (when inside), then the numbers of one, then two decimals in [lower, upper)."""
    found = [default] if lower <= default < upper else []
    for decimals in (1, 2):
        scale = 10**decimals
        start = math.ceil(lower * scale - 1e-9)
        stop = min(upper * scale, start + most) if math.isfinite(upper) else start + most
        found += [round(k / scale, decimals) for k in range(start, math.ceil(stop - 1e-9)) if round(k / scale, decimals) not in found]
        if len(found) >= most:
            break
    return found[:most]


def _fit_epsilon(judge: Judge, dev: Deviation) -> float | None:
    """The epsilon of N + eps from the loss: loss(N) / loss(N + eps) = 1 + eps / N."""
    if dev.denominator != "valid_epsilon":
        return None
    exact = replace(dev, denominator="valid")
    estimates = []
    for i in judge.sample:
        batch, actual = judge.observations[i].batch, judge.observations[i].result
        if "loss" not in judge.fields[i] or not math.isfinite(actual.loss) or actual.loss == 0:
            continue
        expected = variants.evaluate_with_mask(batch, actual.keep, exact).loss
        if expected == 0 or not math.isfinite(expected):
            continue
        estimates.append(int(batch.valid.sum()) * (expected / actual.loss - 1.0))
    positive = [e for e in estimates if e > 0]
    if len(positive) < max(1, len(estimates) // 2):
        return None
    estimate = float(np.median(positive))
    return float(f"{estimate:.0e}")  # a port writes one significant digit: 1e-8, 1e-6, 5e-7


DIRECT_FITTERS = {"clip_floors": _fit_floors, "denominator_epsilon": _fit_epsilon}
