"""Diagnosis: the smallest set of known deviations that explains what a port computed.

Each known deviation (:data:`~m2po_oracle.explain.deviations.VARIANTS`) is a set of knobs; any
set of them composes into one deviating M2PO (:mod:`~m2po_oracle.explain.variants`), which
computes its own mask, loss, gradient and metrics from the batch alone. A combination
*reproduces* a field of an observation when its mask equals the port's up to a choice
among equal M2 values (the mask of a port whose selection is Algorithm 1's may be any
admissible outcome), or when its objective evaluated on the port's own mask matches the
port's loss, gradient or metric within the tolerance policy. Only the fields the port
itself supplied are compared (an adapter may build the rest).

The search (on a sample of the observations) grows combinations one move at a time: a
known deviation, or a group whose members only act together (:data:`JOINT_MOVES`, a
variant's ``acts_with``); a deviation whose value a port picks itself (floors, clamp bound,
epsilon, budget scale, margins) is fitted to the data and named with its value. It keeps
the few combinations that reproduce the most (observation, field) pairs, until one
reproduces every pair or nothing grows; deviations whose removal loses nothing are dropped.

Coverage, not unanimity: real ports carry quirks on a few examples (a margin at an exact
tie), so for every failing check the report states the share of its failing examples the
explanation reproduces and the examples it contradicts. A check is named by the deviations
without which fewer of its failing examples are reproduced, when the explanation is
net-supported (:func:`net_supported`: a clear majority reproduced, few contradicted); the rest
is its *residual*: how many, the batch features they share, and one of them as a
counterexample of its own. Otherwise the check is unexplained and the combination only its
closest lead. Behavioural deviations (input mutation, nondeterminism, padding leaks) are
recognised by the check that shows them alone; a padding leak only where some padding made
the loss, or the gradient at any position, NaN/inf (:func:`padding_leak`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
import math
from dataclasses import dataclass, field, fields, replace
import functools
import json
from typing import Any

import numpy as np

from m2po_oracle.explain import variants
from m2po_oracle.oracle.batch import PADDED_INPUTS, Batch
from m2po_oracle.judge.checks import result_field
from m2po_oracle.explain.deviations import ALGORITHM_1, JOINT_MOVES, LOSS_EFFECTS, VARIANTS, Deviation, combine, fitted_name, loss_effects, variant
from m2po_oracle.judge.equivalence import check_selection, coarser, compare_fields, same_up_to_ties
from m2po_oracle.oracle.record import COUNT_FIELDS, METRIC_FIELDS, M2POResult, PaddingProbe

#: The knobs that shape the mask; the rest shape only loss, gradient and metrics.
SELECTION_KNOBS = ("candidates", "strict_stop", "mean_over_valid", "scope_rows", "extra_removed", "min_kept", "clamp_log_ratio",
                   "ratio_inverted", "selection_kind", "clip_floors", "selection_dtype", "candidate_margin", "noop_margin",
                   "statistic_over_padding", "budget_scale", "clip_bound_float32", "clamp_only_in_loss", "unconstrained_ratio_bound")
#: The knobs that shape loss, gradient and metrics on a given mask.
OBJECTIVE_KNOBS = ("denominator", "ppo_clip", "ratio_inverted", "apply_mask", "masked_keep_value", "clamp_log_ratio", "hard_clamp", "clamp_only_in_loss",
                   "selection_kind", "clip_floors", "metrics_dtype", "m2_after_over_valid", "denominator_epsilon", "budget_scale",
                   "clip_bound_float32", "unconstrained_ratio_bound")
#: The deviations whose every failure is the rounding of a narrower dtype, and the option that accepts it.
PRECISION_OPTIONS = {"float32_selection": "--compute-dtype float32", "float32_metrics": "--compute-dtype float32"}
#: At most this many deviations in one explanation, and combinations kept per size (the
#: authors' release alone combines five: clip kind, floors, column 0's sign, epsilon, float32 bound).
MAX_COMPONENTS = 6
BEAM = 4
#: The naming rule. A set of deviations is named for a failing check only when it is
#: net-supported: it reproduces at least NAMED_SHARE of the check's failing examples (a
#: clear majority: then it is what the port does on most inputs and the rest is a residual)
#: AND it contradicts few examples, at most CONTRADICTION_BOUND per example it reproduces
#: (a contradiction: Algorithm 1 reproduces the port's field there and the deviation does
#: not, so the port plainly does not do what the deviation predicts). A coincidence of shapes
#: reproduces some failing examples while breaking about as many: two thirds and one in ten
#: leave a real deviation with a few quirks named and such a coincidence unexplained. Each
#: named component is necessary: without it fewer failing examples are reproduced.
NAMED_SHARE = 2 / 3
CONTRADICTION_BOUND = 0.1
#: Residual examples described by their features, and features listed per residual.
RESIDUAL_FEATURES_SHOWN = 4


#: The result field a value check judges (None: a behavioural or step check).
field_of = result_field


@dataclass(frozen=True)
class Observation:
    """One call's evidence: the batch as the implementation received it, its result, and
    the checks that failed on it."""

    batch: Batch
    result: M2POResult
    failed: frozenset[str] = frozenset()
    padding_probes: tuple[PaddingProbe, ...] = ()  # the probes whose result differed
    example: Any = None  # the runner's input that produced it (its replay command), when it is not the batch


def merge(names: Iterable[str]) -> Deviation | None:
    """The deviation of several variants at once (None: two set one knob differently)."""
    return _merged(frozenset(names))


@functools.lru_cache(maxsize=4096)
def _merged(names: frozenset[str]) -> Deviation | None:
    # Two names that set one knob (even to one value) answer the same question twice: an
    # explanation names each knob once, so the pair is no explanation.
    set_knobs = [_knobs_of(n) for n in names]
    if sum(len(k) for k in set_knobs) != len(frozenset().union(*set_knobs)):
        return None
    return combine(names)


@functools.lru_cache(maxsize=1024)
def _knobs_of(name: str) -> frozenset[str]:
    dev = variant(name).deviation
    return frozenset(f.name for f in fields(Deviation) if getattr(dev, f.name) != getattr(ALGORITHM_1, f.name))


_ORDER = {v.name: i for i, v in enumerate(VARIANTS)}


def _order(name: str) -> int:
    return _ORDER[variant(name).base]


class Judge:
    """Which fields of which observation a deviation reproduces (memoised)."""

    def __init__(self, observations: Sequence[Observation], *, dtype: str, compute_dtype: str | None, supplied: frozenset[str] | None,
                 sample: int | None = None) -> None:
        self.observations = list(observations)
        self.dtype, self.compute_dtype, self.supplied = dtype, compute_dtype or dtype, supplied
        self.fields = [self._fields(o.result, supplied) for o in self.observations]
        #: The search scores the first ``sample`` observations; shares count every one.
        self.sample = range(len(self.observations) if sample is None else min(sample, len(self.observations)))
        self.total = sum(len(self.fields[i]) for i in self.sample)
        self._differences: dict[tuple[Deviation, int], dict[str, str]] = {}
        self._keeps: dict[tuple[tuple, int], tuple[np.ndarray, np.ndarray]] = {}
        self._values: dict[tuple[tuple, int], dict[str, str]] = {}

    @staticmethod
    def _fields(result: M2POResult, supplied: frozenset[str] | None) -> frozenset[str]:
        present = {"keep", "loss"} | ({"grad"} if result.grad is not None else set())
        present |= {n for n in METRIC_FIELDS + COUNT_FIELDS if getattr(result, n) is not None}
        return frozenset(present if supplied is None else present & supplied)

    def differences(self, dev: Deviation, i: int) -> dict[str, str]:
        """Field -> what differs first, for the fields ``dev`` does not reproduce on observation ``i``."""
        key = (dev, i)
        if key not in self._differences:
            self._differences[key] = self._compute(dev, i)
        return self._differences[key]

    def score(self, dev: Deviation, at_least: int | None = None) -> int | None:
        """(observation, field) pairs of the sample that ``dev`` reproduces; None as soon as it
        is clear that they are fewer than ``at_least`` (most moves of a search fail fast)."""
        missing, allowed = 0, (self.total - at_least if at_least is not None else None)
        for i in self.sample:
            missing += len(self.differences(dev, i))
            if allowed is not None and missing > allowed:
                return None
        return self.total - missing

    def score_all(self, dev: Deviation, at_least: int | None = None) -> int | None:
        """(observation, field) pairs of every observation that ``dev`` reproduces (None: fewer than ``at_least``)."""
        every = sum(len(f) for f in self.fields)
        missing, allowed = 0, (every - at_least if at_least is not None else None)
        for i in range(len(self.observations)):
            missing += len(self.differences(dev, i))
            if allowed is not None and missing > allowed:
                return None
        return every - missing

    def reproduces(self, dev: Deviation, field_name: str, indices: Iterable[int] | None = None) -> bool:
        indices = range(len(self.observations)) if indices is None else indices
        return all(field_name not in self.differences(dev, i) for i in indices if field_name in self.fields[i])

    def reproduced(self, dev: Deviation, field_name: str, indices: Iterable[int]) -> list[int]:
        """Of ``indices``, the observations whose ``field_name`` ``dev`` reproduces."""
        return [i for i in indices if field_name in self.fields[i] and field_name not in self.differences(dev, i)]

    def _compute(self, dev: Deviation, i: int) -> dict[str, str]:
        observation, judged = self.observations[i], self.fields[i]
        batch, actual = observation.batch, observation.result
        found: dict[str, str] = {}
        if "keep" in judged:
            difference = self._keep_difference(dev, i)
            if difference:
                found["keep"] = difference
        # Loss, gradient and metrics depend on the objective's knobs only: many combinations share them.
        value_key = (tuple(getattr(dev, k) for k in OBJECTIVE_KNOBS) + ((dev.candidates,) if dev.selection_kind != "mask" else ()), i)
        if value_key not in self._values:
            expected = variants.evaluate_with_mask(batch, actual.keep, dev)
            values: dict[str, str] = {}
            for mismatch in compare_fields(batch, actual, expected, self.dtype, self.compute_dtype, metrics_dtype=dev.metrics_dtype):
                name = field_of(mismatch.check)
                if name in judged and name not in values:
                    at = f" at {mismatch.index}" if mismatch.index is not None else ""
                    values[name] = f"{name}{at}: variant {_plain(mismatch.expected)}, implementation {_plain(mismatch.actual)}"
            self._values[value_key] = values
        return {**self._values[value_key], **found}

    def _keep_difference(self, dev: Deviation, i: int) -> str | None:
        batch, actual = self.observations[i].batch, self.observations[i].result
        if dev.selection_kind == "mask" and all(getattr(dev, k) == getattr(ALGORITHM_1, k) for k in SELECTION_KNOBS if k != "selection_dtype"):
            # Algorithm 1's own selection: any admissible outcome (ties, rounding near tau) reproduces it.
            wrong = check_selection(batch, actual.keep, coarser(self.compute_dtype, dev.selection_dtype))
            return f"keep: {wrong[0].summary}" if wrong else None
        selection_key = (tuple(getattr(dev, k) for k in SELECTION_KNOBS), i)
        if selection_key not in self._keeps:  # the mask and its M2 levels depend on the selection's knobs only
            d = variants.selection_log_ratio(variants.log_ratio(batch, dev), dev)
            self._keeps[selection_key] = (variants.select(batch, dev), np.where(batch.valid, variants._selection_m2(d, dev), np.nan))
        keep, levels = self._keeps[selection_key]
        if same_up_to_ties(keep, actual.keep, levels):
            return None
        index = tuple(int(j) for j in np.argwhere(keep != actual.keep)[0])
        return f"keep differs at {index}: variant {'keeps' if keep[index] else 'removes'} it, implementation {'keeps' if actual.keep[index] else 'removes'} it"


def _plain(value: object) -> str:
    if isinstance(value, float):
        return repr(0.0 if value == 0 else value)  # never "-0.0"
    return repr(value)


@dataclass
class Explanation:
    components: tuple[str, ...]
    score: int
    total: int
    alternatives: list[tuple[str, ...]] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.score == self.total


def _preference(names: frozenset[str] | tuple[str, ...]) -> tuple:
    return _preference_of(frozenset(names))


@functools.lru_cache(maxsize=4096)
def _preference_of(names: frozenset[str]) -> tuple:
    knob_count = sum(1 for f in fields(Deviation) if getattr(merge(names) or ALGORITHM_1, f.name) != getattr(ALGORITHM_1, f.name))
    return (len(names), knob_count, sorted(_order(n) for n in names))


def _moves(candidates: Sequence[str]) -> list[frozenset[str]]:
    """What one search step may add: a known deviation, or a group whose members only act
    together (a clip kind with its floors; strict stop with keep-one)."""
    allowed = set(candidates)
    moves = [frozenset({n}) for n in candidates]
    for name in candidates:
        moves += [frozenset({name, partner}) for partner in variant(name).acts_with if partner in allowed]
    moves += [frozenset(group) for group in JOINT_MOVES if set(group) <= allowed]
    return list(dict.fromkeys(moves))


def search(judge: Judge, candidates: Sequence[str]) -> Explanation:
    """The smallest combination of ``candidates`` reproducing every judged pair of the
    sample, else the one reproducing the most (fitted values carried in the names)."""
    base = judge.score(ALGORITHM_1)
    if base == judge.total:
        return Explanation((), base, judge.total)
    frontier: list[tuple[frozenset[str], int]] = [(frozenset(), base)]
    seen: set[frozenset[str]] = {frozenset()}
    best: tuple[frozenset[str], int] = (frozenset(), base)
    moves = _moves(candidates)
    for _ in range(MAX_COMPONENTS):
        grown: list[tuple[frozenset[str], int]] = []
        for state, state_score in frontier:
            state_dev = merge(state)
            for move in moves:
                combined = state | move
                if combined in seen or len(combined) > MAX_COMPONENTS:
                    continue
                seen.add(combined)
                if merge(combined) is None or merge(combined) == state_dev:
                    continue
                combined = _fit(judge, combined, fitted=move - state)
                dev = merge(combined)
                if dev is None:
                    continue
                combined_score = judge.score(dev, at_least=state_score + 1)
                if combined_score is not None:
                    grown.append((combined, combined_score))
        if not grown:
            break
        complete = sorted((s for s, sc in grown if sc == judge.total), key=_preference)
        if complete:
            chosen = _prune(judge, complete[0])
            improved = _improve(judge, chosen, candidates)
            if improved != chosen:  # complete on the sample, not beyond it: the sample's ties no longer tie
                return Explanation(tuple(sorted(improved, key=_order)), judge.score(merge(improved) or ALGORITHM_1), judge.total)
            alternatives = [tuple(sorted(s, key=_order)) for s in complete[1:4] if len(s) == len(chosen)]
            return Explanation(tuple(sorted(chosen, key=_order)), judge.total, judge.total, alternatives)
        grown.sort(key=lambda t: (-t[1], _preference(t[0])))
        frontier = grown[:BEAM]
        if frontier[0][1] > best[1]:
            best = frontier[0]
    chosen = _improve(judge, _refit(judge, _prune(judge, best[0])), candidates)
    return Explanation(tuple(sorted(chosen, key=_order)), judge.score(merge(chosen) or ALGORITHM_1), judge.total)


def _improve(judge: Judge, names: frozenset[str], candidates: Sequence[str]) -> frozenset[str]:
    """An incomplete explanation, improved on every observation (not only the sample): swap a
    component for a variant that sets the same knob (column 0's sign for the first token's),
    add one, or drop one, while that reproduces more pairs."""
    if len(judge.observations) == len(judge.sample):
        return names
    best = judge.score_all(merge(names) or ALGORITHM_1)
    if best == sum(len(f) for f in judge.fields):
        return names
    for _ in range(MAX_COMPONENTS):
        trials = [names - {n} for n in names]
        trials += [(names - {n}) | {other} for n in names for other in candidates if other not in names and merge((names - {n}) | {other}) is not None
                   and merge({n, other}) is None]  # conflicting: the same knob set another way
        trials += [names | {other} for other in candidates if other not in names and len(names) < MAX_COMPONENTS]
        scored = [(score, t) for t in trials if (dev := merge(t)) is not None and (score := judge.score_all(dev, at_least=best + 1)) is not None]
        if not scored:
            break
        best, names = max(scored, key=lambda st: (st[0], -_preference(st[1])[0]))
    return names


def _prune(judge: Judge, names: frozenset[str]) -> frozenset[str]:
    """Drop every deviation whose removal reproduces no fewer pairs."""
    score = judge.score(merge(names) or ALGORITHM_1)
    for name in sorted(names, key=lambda n: -_order(n)):
        smaller = names - {name}
        dev = merge(smaller)
        if dev is not None and judge.score(dev, at_least=score) is not None:
            names = smaller
    return names


# --- values a port picks itself, fitted from the data ------------------------------------

#: Values tried for a parameter no observation pins down directly (the default first).
PARAMETER_GRIDS: dict[str, tuple[float, ...]] = {
    "clamp_log_ratio": (20.0, 10.0, 5.0, 15.0, 30.0, 50.0, 1.0, 2.0),
    "candidate_margin": (1e-12, 1e-10, 1e-8, 1e-6, 1e-15),
    "noop_margin": (1e-12, 1e-10, 1e-8, 1e-6, 1e-15),
    "budget_scale": (0.5, 0.25, 2.0, 4.0),
    "unconstrained_ratio_bound": (1e5, 1e4, 1e6, 1e8),
}


def _fit(judge: Judge, names: frozenset[str], fitted: frozenset[str]) -> frozenset[str]:
    """``names`` with each of ``fitted`` that a port parameterises given the value the data
    pins down (a cheap fit only: floors and epsilon are read from the examples directly)."""
    for name in fitted:
        known = variant(name)
        fitter = _DIRECT_FITTERS.get(known.parameter or "")
        if fitter is None:
            continue
        rest = merge(names - {name})
        if rest is None:
            continue
        value = fitter(judge, merge(names) or ALGORITHM_1)
        if value is None or value == getattr(known.deviation, known.parameter):
            continue
        trial = (names - {name}) | {fitted_name(known.base, value)}
        if judge.score(merge(trial) or ALGORITHM_1) > judge.score(merge(names) or ALGORITHM_1):
            names = trial
    return names


def _refit(judge: Judge, names: frozenset[str]) -> frozenset[str]:
    """The final explanation with each parameter that no direct fit pins tried over its grid."""
    for name in sorted(names, key=_order):
        known = variant(name)
        grid = PARAMETER_GRIDS.get(known.parameter or "")
        if grid is None:
            continue
        rest = names - {name}
        scored = []
        for value in grid:
            trial = rest | {fitted_name(known.base, value) if value != getattr(variant(known.base).deviation, known.parameter) else known.base}
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
        scale = 10.0 ** decimals
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
        for side, beyond, gap in (("high", (a > 0) & (r > outcome.high), r - 1.0), ("low", (a < 0) & (r < outcome.low), 1.0 - r)):
            beyond &= batch.valid
            kept, clipped = gap[beyond & actual.keep], gap[beyond & ~actual.keep]
            if kept.size:
                bounds[side][0] = max(bounds[side][0], float(kept.max()))
            if clipped.size:
                bounds[side][1] = min(bounds[side][1], float(clipped.min()))
            evidence |= bool(kept.size or clipped.size)
    if not evidence:
        return None
    low = _simplest_in(*bounds["low"], default=dev.clip_floors[0])
    high = _simplest_in(*bounds["high"], default=dev.clip_floors[1])
    if low is None or high is None:
        return None
    # The selection bounds each floor to an interval; a clipped token's loss VALUE sits on the
    # floor itself, so the round value within the interval that reproduces the most decides.
    for side in (0, 1):
        candidates = _round_values_in(*bounds[("low", "high")[side]], default=dev.clip_floors[side])
        if len(candidates) > 1:
            pair = lambda v: (v, high) if side == 0 else (low, v)  # noqa: E731
            scored = [(judge.score(replace(dev, clip_floors=pair(v))), -k, v) for k, v in enumerate(candidates)]
            chosen = max(scored)[2]
            low, high = pair(chosen)
    return (low, high)


def _round_values_in(lower: float, upper: float, default: float, most: int = 12) -> list[float]:
    """The default (when inside), then the numbers of one, then two decimals in [lower, upper)."""
    found = [default] if lower <= default < upper else []
    for decimals in (1, 2):
        scale = 10 ** decimals
        start = math.ceil(lower * scale - 1e-9)
        stop = upper * scale if math.isfinite(upper) else start + most
        found += [round(k / scale, decimals) for k in range(start, int(math.ceil(stop - 1e-9))) if round(k / scale, decimals) not in found]
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


_DIRECT_FITTERS = {"clip_floors": _fit_floors, "denominator_epsilon": _fit_epsilon}


def diagnose(observations: Iterable[Observation], failed_checks: Iterable[str], *, dtype: str, divergent: bool,
             compute_dtype: str | None = None, supplied: frozenset[str] | None = None,
             step_explanations: dict[str, set[str]] | None = None, step_descriptions: dict[str, str] | None = None, step_source: str = "",
             findings: Sequence[dict[str, Any]] = (), prefer: frozenset[str] = frozenset(),
             beyond_sample: Iterable[Observation] = (), replay: Any = None, call_failure_taus: Sequence[float] = (),
             leaks_alone: Callable[[Batch], bool | None] | None = None) -> dict[str, Any]:
    """The diagnosis section of the report (schema in ``report``).

    The search runs on ``observations``; the shares count those and ``beyond_sample`` (the
    examples beyond the search's sample: the failing ones a name must reproduce, the passing
    ones it must not contradict). ``step_explanations`` maps a failing check
    to the step-level variants (distributed, trainer) that reproduce every failing step of
    it; they explain it ahead of a single-batch deviation. ``replay(example)`` gives the
    command that replays a residual's counterexample; ``leaks_alone`` (see :func:`padding_leak`)
    tells which input a padding leak comes through."""
    observations = list(observations)
    sample = len(observations)
    observations += list(beyond_sample)
    failed = list(dict.fromkeys(failed_checks))
    # examples_searched: the sample the search and the leads ran on; examples_compared: every
    # observation the shares count (the sample and the failing examples beyond it).
    empty = {"examples_compared": len(observations), "examples_searched": sample, "components": [], "by_check": {}, "shares": {}, "residuals": [], "unexplained": [],
             "matches": [], "alternatives": [], "closest": [], "findings": list(findings), "hints": [], "summary": "", "padding_leak": None}
    if not divergent:
        return {"status": "not_needed", **empty}
    judge = Judge(observations, dtype=dtype, compute_dtype=compute_dtype, supplied=supplied, sample=sample)
    output_variants = [v.name for v in VARIANTS if v.name != "algorithm_1" and not v.is_behavioural]
    explanation = search(judge, output_variants) if observations else Explanation((), 0, 0)
    if explanation.alternatives:
        # Of equally small explanations: one that also reproduces the port under the padding
        # probes (it reads padding, e.g. column 0's advantage) explains more than a leak; then
        # the one naming the deviations the project accepts (the examples cannot tell them apart).
        pads = "padding_immunity" in failed
        ranked = sorted([explanation.components, *explanation.alternatives],
                        key=lambda names: (pads and not _reads_padding(judge, names), -len({variant(n).base for n in names} & prefer)))
        explanation = replace(explanation, components=ranked[0], alternatives=ranked[1:])
    dev = merge(explanation.components) or ALGORITHM_1

    by_check: dict[str, list[str]] = {}
    shares: dict[str, dict[str, Any]] = {}
    unexplained: list[str] = []
    step_explanations = step_explanations or {}
    step_choice, step_alternatives = _cover(step_explanations, list(step_descriptions or {}))
    closest_by_check: dict[str, dict[str, Any]] = {}
    unexplained_sources: dict[str, dict[str, Any]] = {}
    leak: PaddingLeak | None = None
    for check in failed:
        if check in step_choice:
            by_check[check] = [step_choice[check]]
            continue
        behavioural = [v.name for v in VARIANTS if v.behaviour_check == check and v.behaviour_check != "call"]
        if check == "call" and call_failure_taus and all(t == 0 for t in call_failure_taus):
            behavioural = ["fails_at_zero_budget"]  # every call that raised had tau == 0, and only such calls raised
        name = field_of(check)
        if check == "padding_immunity":
            reading = _padding_reader(judge, explanation.components)
            if reading:  # the explanation reproduces the port under every padding it changed with
                by_check[check] = reading
                continue
            leak = padding_leak(judge.observations, leaks_alone)
            if leak is None:
                behavioural = []  # a NaN leak is named only where some padding made the result NaN/inf
        if behavioural:
            by_check[check] = behavioural
            continue
        # Without an explanation every failing example is the residual (Algorithm 1 reproduces none).
        share = _share(judge, dev, name, check) if name is not None else None
        if share is not None and net_supported(share):
            by_check[check] = _responsible(judge, explanation.components, name, share["reproduced"])
            shares[check] = {k: v for k, v in share.items() if k not in ("reproduced", "residual")} | {"components": by_check[check]}
            if share["residual"]:
                shares[check]["residual"] = share["residual"]
        else:
            unexplained.append(check)
            if share is not None and share["explained"]:
                closest_by_check[check] = {"components": list(explanation.components), "explained": share["explained"], "of": share["of"],
                                           "share": share["share"], "failing": share["failing"], "contradicted": share["contradicted"]}
            if share is not None and share["residual"]:  # what its failing examples share, though nothing known explains them
                unexplained_sources[check] = {"residual": share["residual"], "components": list(explanation.components)}

    residuals = _residuals(judge, shares, compute_dtype or dtype, replay) + _residuals(judge, unexplained_sources, compute_dtype or dtype, replay,
                                                                                       unexplained=True)
    for check in shares:
        shares[check].pop("residual", None)
    components = list(dict.fromkeys(n for names in by_check.values() for n in names))
    # An adapter that builds the loss and gradient itself leaves what a deviation does to
    # them unobserved: the evidence says so rather than let its description claim it.
    unseen_loss = supplied is not None and not ({"loss", "grad"} & supplied)
    matches = []
    for name in components:
        explained = [c for c, names in by_check.items() if name in names]
        known = _known(name)
        if known is not None:
            counted = [shares[c] for c in explained if c in shares]
            evidence = (f"every one of the {len(call_failure_taus)} calls that raised had tau == 0" if known.behaviour_check == "call" else
                        (leak.text() if leak is not None else "NaN/inf padding made the loss or gradient NaN/inf (check padding_immunity failed)")
                        if known.behaviour_check == "padding_immunity" else
                        f"check {known.behaviour_check} failed" if known.is_behavioural else
                        "reproduces " + "; ".join(f"{field_of(c) or c} on {_share_text(shares[c])}" for c in explained if c in shares)
                        if counted else f"reproduces the port under the padding probes ({', '.join(explained)})")
            unobserved = loss_effects(known.deviation) if unseen_loss and not known.is_behavioural else []
            if unobserved:
                evidence += f"; not observed: {', '.join(unobserved)} (the adapter builds the loss and gradient)"
            matches.append({"variant": name, "description": known.description, "source": known.source, "evidence": evidence, "checks": explained,
                            "unobserved": unobserved})
        else:
            matches.append({"variant": name, "description": (step_descriptions or {}).get(name, ""), "source": step_source,
                            "evidence": "reproduces every failing step", "checks": explained})
    partial = any(share["share"] < 1 for share in shares.values())
    status = ("no_known_variant" if not by_check else "partly_explained" if unexplained else "mostly_explained" if partial else "matched")
    return {
        **empty,
        "status": status,
        "components": components,
        "by_check": by_check,
        "shares": shares,
        "residuals": residuals,
        "unexplained": unexplained,
        "matches": matches,
        "alternatives": [list(a) for a in explanation.alternatives + step_alternatives],
        "alternatives_reason": _why_alike(explanation, unseen_loss),
        # Leads only where a check is unexplained: beside a full or majority explanation, single
        # variants that each reproduce a few examples only distract from it and its residual.
        "closest": _closest(judge, output_variants, set(components), closest_by_check) if unexplained else [],
        "hints": _hints(by_check),
        "summary": summary(status, by_check, unexplained, shares),
        "padding_leak": leak.to_json() if leak is not None and "nan_padding_leak" in components else None,
    }


#: Why equally small explanations stand side by side, unless something more precise holds.
ALIKE = "the examples do not tell them apart"


def _why_alike(explanation: Explanation, unseen_loss: bool) -> str:
    """Equally small explanations that differ only in what they do to a loss and gradient
    the adapter built cannot be told apart by any example: say so."""
    chosen = merge(explanation.components)
    if not unseen_loss or chosen is None or not explanation.alternatives:
        return ALIKE
    for alternative in explanation.alternatives:
        other = merge(alternative)
        if other is None:
            return ALIKE
        differing = {f.name for f in fields(Deviation) if getattr(chosen, f.name) != getattr(other, f.name)}
        if not differing <= set(LOSS_EFFECTS):
            return ALIKE
    return "they differ only in the loss and gradient, which the adapter builds"


def _known(name: str):
    try:
        return variant(name)
    except ValueError:  # a step-level variant (distributed, trainer)
        return None


def _share(judge: Judge, dev: Deviation, field_name: str, check: str) -> dict[str, Any]:
    """How much of ``check`` the explanation reproduces: its failing examples whose field it
    reproduces, and the examples it contradicts (Algorithm 1 reproduces the port's field
    there, the explanation does not), counted against it in ``share``."""
    judged = [i for i in range(len(judge.observations)) if field_name in judge.fields[i]]
    failing = [i for i in judged if check in judge.observations[i].failed]
    reproduced = judge.reproduced(dev, field_name, failing)
    contradicted = [i for i in judged if check not in judge.observations[i].failed and field_name in judge.differences(dev, i)
                    and field_name not in judge.differences(ALGORITHM_1, i)]
    of = len(failing) + len(contradicted)
    residual = sorted(set(failing) - set(reproduced)) + contradicted
    return {"explained": len(reproduced), "failing": len(failing), "contradicted": len(contradicted), "of": of,
            "share": len(reproduced) / of if of else 0.0, "reproduced": reproduced, "residual": residual}


def net_supported(share: dict[str, Any]) -> bool:
    """The naming rule (:data:`NAMED_SHARE`, :data:`CONTRADICTION_BOUND`) on a check's share."""
    explained, failing, contradicted = share["explained"], share["failing"], share["contradicted"]
    return explained > 0 and explained >= NAMED_SHARE * failing and contradicted <= CONTRADICTION_BOUND * explained


def _share_text(share: dict[str, Any]) -> str:
    text = f"{share['explained']} of {share['failing']} failing examples"
    if share.get("contradicted"):
        text += f" (and differs from the port on {share['contradicted']} where Algorithm 1 does not)"
    return text


def _residuals(judge: Judge, shares: dict[str, dict[str, Any]], compute_dtype: str, replay: Any, unexplained: bool = False) -> list[dict[str, Any]]:
    """The examples each check's explanation does not reproduce, grouped where several
    checks leave the same ones: how many, the features they share (against how often each
    holds where the explanation reproduces the check), and the smallest as a counterexample
    with its replay command. ``unexplained``: checks nothing names, whose failing examples
    are characterised all the same."""
    from m2po_oracle.judge import coverage

    groups: dict[tuple[int, ...], list[str]] = {}
    for check, share in shares.items():
        if share.get("residual"):
            groups.setdefault(tuple(share["residual"]), []).append(check)
    if not groups:
        return []
    cached: dict[int, frozenset[str]] = {}

    def features(i: int) -> frozenset[str]:
        if i not in cached:
            facts = coverage.facts(judge.observations[i].batch, compute_dtype)
            cached[i] = frozenset(name for name, rule in coverage.FEATURES.items() if name != "nan_padding" and rule.holds(facts))
        return cached[i]

    residuals = []
    for indices, checks in groups.items():
        field_names = {field_of(c) for c in checks}
        explained = [i for i, o in enumerate(judge.observations) if set(checks) & o.failed and i not in indices]
        counts = {name: sum(name in features(i) for i in indices) for name in coverage.FEATURES if name != "nan_padding"}
        elsewhere = {name: sum(name in features(i) for i in explained) for name in counts}
        shown = sorted((n for n in counts if counts[n]), key=lambda n: (-counts[n] / len(indices) + elsewhere[n] / max(len(explained), 1), n))
        smallest = min(indices, key=lambda i: (int(judge.observations[i].batch.valid.size), i))
        observation = judge.observations[smallest]
        example = observation.example if observation.example is not None else observation.batch
        dev = merge(shares[checks[0]]["components"]) or ALGORITHM_1
        first = next((text for f, text in judge.differences(dev, smallest).items() if f in field_names), "")
        residuals.append({
            "checks": checks,
            "unexplained": unexplained,
            "count": len(indices),
            "contradicted": sum(1 for i in indices if not set(checks) & judge.observations[i].failed),
            "features": [{"feature": n, "residual": counts[n], "of": len(indices), "explained": elsewhere[n], "explained_of": len(explained),
                          "description": coverage.FEATURES[n].when} for n in shown[:RESIDUAL_FEATURES_SHOWN]],
            "shared": [n for n in shown if counts[n] == len(indices)],
            "float32_fits": _float32_fits(judge, dev, indices, field_names),
            "explanation": list(shares[checks[0]]["components"]),  # what the residual is measured against ([]: Algorithm 1)
            "counterexample": {"batch": json.loads(observation.batch.to_json()), "difference": first,
                               "replay": replay(example) if replay is not None else None},
        })
    return residuals


def _float32_fits(judge: Judge, dev: Deviation, indices: Sequence[int], field_names: set[str | None]) -> int | None:
    """Of the residual's examples, those the explanation reproduces when judged at float32's
    tolerance: where that is most of them, the port computes these fields in float32 (a
    precision no knob of the vocabulary names for the loss and gradient). None where the run
    already judges at float32 or coarser: nothing was measured."""
    if judge.compute_dtype != "float64":
        return None
    observations = [judge.observations[i] for i in indices]
    loose = Judge(observations, dtype="float32", compute_dtype="float32", supplied=judge.supplied)
    return sum(1 for k in range(len(observations)) if not (set(loose.differences(dev, k)) & field_names))


def _cover(explanations: dict[str, set[str]], order: list[str]) -> tuple[dict[str, str], list[tuple[str, ...]]]:
    """Each step variant reproduces the failing steps of some checks by itself: the fewest
    of them that cover every check (greedily, most checks first, then the runner's order),
    each check -> its variant, and the variants that cover exactly as much as a chosen one."""
    rank = {name: i for i, name in enumerate(order)}
    remaining = {check: names for check, names in explanations.items() if names}
    everyone = sorted(set().union(*remaining.values()), key=lambda n: (rank.get(n, len(rank)), n)) if remaining else []
    covers = {name: {c for c, names in remaining.items() if name in names} for name in everyone}
    choice: dict[str, str] = {}
    chosen: list[str] = []
    while len(choice) < len(remaining):
        best = max(everyone, key=lambda n: (len(covers[n] - set(choice)), -everyone.index(n)))
        chosen.append(best)
        for check in covers[best] - set(choice):
            choice[check] = best
    alternatives = [(n,) for n in everyone if n not in chosen and any(covers[n] == {c for c, v in choice.items() if v == m} for m in chosen)]
    return choice, alternatives


def _padding_reader(judge: Judge, components: tuple[str, ...]) -> list[str]:
    """The deviations that reproduce the port under every padding probe it changed with: the
    explanation's own (column 0's advantage), else with a statistic over every position (a
    kernel handed no mask: finite padding competes in the selection); [] if neither does."""
    reading = _reads_padding(judge, components) if components else []
    if reading:
        return reading
    return _reads_padding(judge, (*components, "statistic_over_padding"))


@dataclass(frozen=True)
class PaddingLeak:
    """The evidence of a padding leak: padding alone made the loss, or the gradient at some
    position (a valid token or a padding position), NaN/inf, on a batch whose zero-padded
    result is finite. A NaN gradient at a padding position is a leak too: the log-probs are
    gathered from the model's log-softmax at every position, so it reaches every weight."""

    fill: str  # the padding probe that showed it first on the smallest such batch
    where: str  # "loss", "valid token" or "padding position"
    index: tuple[int, ...] | None
    value: float
    examples: int  # the observations on which some padding probe made the result NaN/inf
    inputs: tuple[str, ...] | None  # the inputs whose padding alone does it (None: not probed)

    def text(self) -> str:
        what = "the loss" if self.where == "loss" else f"the gradient at {self.where} {self.index}"
        padding = f"with {self.fill}" if " " in self.fill else f"with padding set to {self.fill}"
        text = (f"{padding}, {what} is {self.value!r} where the zero-padded run is finite "
                f"(on {self.examples} example(s))")
        if self.inputs is not None:
            text += "; " + (f"padding in {self.inputs[0]} alone does it" if len(self.inputs) == 1 else
                            f"padding in any one of {', '.join(self.inputs)} alone does it" if self.inputs else
                            "no one input's padding alone does it")
        return text

    def to_json(self) -> dict[str, Any]:
        return {"fill": self.fill, "where": self.where, "index": list(self.index) if self.index is not None else None,
                "value": repr(self.value), "examples": self.examples, "inputs": list(self.inputs) if self.inputs is not None else None,
                "text": self.text()}


def padding_leak(observations: Sequence[Observation], leaks_alone: Callable[[Batch], bool | None] | None = None) -> PaddingLeak | None:
    """The padding leak the observations show, or None. ``leaks_alone(batch)`` runs the port
    on a batch padded in one input only and says whether that padding makes its result
    NaN/inf (None: it could not tell); it attributes the leak to the inputs it comes through."""
    leaking: list[tuple[Observation, PaddingProbe, tuple[str, tuple[int, ...] | None, float]]] = []
    for o in observations:
        for probe in o.padding_probes:
            found = probe.non_finite()
            if found is not None:
                leaking.append((o, probe, found))
                break
    if not leaking:
        return None
    o, probe, (where, index, value) = min(leaking, key=lambda t: (int(t[0].batch.valid.size), t[0].batch.valid.sum()))
    inputs: tuple[str, ...] | None = None
    if leaks_alone is not None:
        # Only the inputs whose padding the probe set (NaN != 0 holds, so NaN padding counts).
        answers = {name: leaks_alone(probe.batch.padding_only_in(name)) for name in PADDED_INPUTS
                   if np.any(getattr(probe.batch, name)[~probe.batch.valid] != 0)}
        if None not in answers.values():
            inputs = tuple(name for name, leaks in answers.items() if leaks)
    return PaddingLeak(probe.fill, where, index, value, len(leaking), inputs)


def _reads_padding(judge: Judge, components: tuple[str, ...]) -> list[str]:
    """The deviations that read padding (e.g. the advantage of column 0), if together they
    reproduce every padding probe the port's result changed under; else [] (a leak)."""
    probes = [Observation(p.batch, p.result) for o in judge.observations if "padding_immunity" in o.failed for p in o.padding_probes]
    if not probes:
        return []
    probe_judge = Judge(probes, dtype=judge.dtype, compute_dtype=judge.compute_dtype, supplied=judge.supplied)
    dev = merge(components) or ALGORITHM_1
    if any(probe_judge.differences(dev, i) for i in range(len(probes))):
        return []
    return [n for n in components if any(probe_judge.differences(merge(c for c in components if c != n) or ALGORITHM_1, i) for i in range(len(probes)))]


def _responsible(judge: Judge, components: tuple[str, ...], field_name: str, reproduced: list[int]) -> list[str]:
    """The fewest of ``components`` that still reproduce the check's reproduced failing
    examples, each of them necessary (without it fewer are reproduced)."""
    needed = list(components)
    changed = True
    while changed:
        changed = False
        for name in sorted(needed, key=lambda n: -_order(n)):
            rest = [n for n in needed if n != name]
            dev = merge(rest) if rest else ALGORITHM_1
            if dev is not None and len(judge.reproduced(dev, field_name, reproduced)) == len(reproduced):
                needed, changed = rest, True
                break
    return needed or list(components)


def _closest(judge: Judge, names: Sequence[str], exclude: set[str], by_check: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Leads for what is unexplained: the explanation's share on each check below the
    threshold, then the single variants that agree on the most divergent examples."""
    rows = [{"variant": " + ".join(c["components"]), "description": f"reproduces {check} on {c['explained']} of {c['failing']} failing examples"
             + (f" and contradicts {c['contradicted']}" if c["contradicted"] else "") + f": short of the naming rule (at least {NAMED_SHARE:.0%} "
             f"of the failing examples, at most {CONTRADICTION_BOUND:g} contradicted per reproduced one)", "source": "",
             "agreed": c["explained"], "of": c["of"], "check": check, "first_difference": ""} for check, c in by_check.items()]
    divergent = [i for i in judge.sample if judge.differences(ALGORITHM_1, i)]
    singles = []
    for name in names:
        if name in exclude:
            continue
        known = variant(name)
        agreed = [i for i in divergent if not judge.differences(known.deviation, i)]
        if not agreed:
            continue
        first = next((judge.differences(known.deviation, i) for i in divergent if judge.differences(known.deviation, i)), {})
        singles.append({"variant": name, "description": known.description, "source": known.source, "agreed": len(agreed), "of": len(divergent),
                        "first_difference": next(iter(first.values()), "")})
    singles.sort(key=lambda r: -r["agreed"])
    return rows + singles[:3]


def _hints(by_check: dict[str, list[str]]) -> list[dict[str, Any]]:
    hints = []
    precision = [c for c, names in by_check.items() if names and set(names) <= set(PRECISION_OPTIONS)]
    if precision:
        hints.append({"checks": precision, "text": f"every failure of {', '.join(precision)} fits the rounding of float32 arithmetic",
                      "option": "--compute-dtype float32"})
    epsilon = [c for c, names in by_check.items() if names == ["denominator_epsilon"]]
    if epsilon:
        hints.append({"checks": epsilon, "text": f"every failure of {', '.join(epsilon)} fits an epsilon of 1e-8 in the denominator "
                      "(N + 1e-8: a relative change of 1e-8 / N, below float32's tolerance)", "option": "--dtype float32"})
    return hints


def summary(status: str, by_check: dict[str, list[str]], unexplained: list[str], shares: dict[str, dict[str, Any]] | None = None) -> str:
    """One line: "mostly explained: loss, gradient by clamped_log_ratio (281 of 300); metrics.m2_after unexplained"."""
    shares = shares or {}
    groups: dict[tuple[str, ...], list[str]] = {}
    for check, names in by_check.items():
        groups.setdefault(tuple(names), []).append(check)
    parts = []
    for names, checks in groups.items():
        partial = [c for c in checks if c in shares and shares[c]["share"] < 1]
        counts = [f"{shares[c]['explained']} of {shares[c]['of']}" + (f" for {c}" if len(checks) > 1 else "") for c in partial]
        parts.append(f"{', '.join(checks)} by {' + '.join(names)}" + (f" ({', '.join(counts)})" if counts else ""))
    if unexplained:
        parts.append(f"{', '.join(unexplained)} unexplained")
    lead = {"matched": "explained", "mostly_explained": "mostly explained", "partly_explained": "partly explained",
            "no_known_variant": "no known deviation explains it"}.get(status, status)
    return f"{lead}: {'; '.join(parts)}" if parts else lead
