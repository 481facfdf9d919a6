"""Diagnosis: the smallest set of known deviations that explains what a port computed.

Each known deviation (:data:`~m2po_oracle.deviations.VARIANTS`) is a set of knobs; any
set of them composes into one deviating M2PO (:mod:`~m2po_oracle.variants`), which
computes its own mask, loss, gradient and metrics from the batch alone; it is never
fitted to the port's output. A combination *reproduces* a field of an observation when
its mask equals the port's up to a choice among equal M2 values (the mask of a port
whose selection is Algorithm 1's may be any admissible outcome), or when its objective
evaluated on the port's own mask matches the port's loss, gradient or metric within the
tolerance policy. Only the fields the port itself supplied are compared (an adapter may
build the rest).

The search adds one deviation at a time, keeping the few combinations that reproduce the
most (observation, field) pairs, until one reproduces every pair; deviations whose
removal loses nothing are dropped. For every failing check the report names the
deviations of that explanation without which the check's field is no longer reproduced,
and lists the checks nothing explains. Behavioural deviations (input mutation,
nondeterminism, padding leaks) are recognised by the check that shows them alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np

from m2po_oracle import variants
from m2po_oracle.batch import Batch
from m2po_oracle.checks import result_field
from m2po_oracle.deviations import ALGORITHM_1, VARIANTS, Deviation, Variant, combine
from m2po_oracle.equivalence import check_selection, coarser, compare_fields, same_up_to_ties
from m2po_oracle.record import COUNT_FIELDS, METRIC_FIELDS, M2POResult

#: The knobs that shape the mask; the rest shape only loss, gradient and metrics.
SELECTION_KNOBS = ("candidates", "strict_stop", "mean_over_valid", "scope_rows", "extra_removed", "min_kept", "clamp_log_ratio",
                   "ratio_inverted", "selection_kind", "clip_floors", "selection_dtype")
#: The knobs that shape loss, gradient and metrics on a given mask.
OBJECTIVE_KNOBS = ("denominator", "ppo_clip", "ratio_inverted", "apply_mask", "masked_keep_value", "clamp_log_ratio", "hard_clamp",
                   "selection_kind", "clip_floors", "metrics_dtype", "m2_after_over_valid")
#: The deviations whose every failure is the rounding of a narrower dtype, and the option that accepts it.
PRECISION_OPTIONS = {"float32_selection": "--compute-dtype float32", "float32_metrics": "--compute-dtype float32"}
#: At most this many deviations in one explanation, and combinations kept per size.
MAX_COMPONENTS = 4
BEAM = 4


#: The result field a value check judges (None: a behavioural or step check).
field_of = result_field


@dataclass(frozen=True)
class Observation:
    """One call's evidence: the batch as the implementation received it, its result, and
    the checks that failed on it."""

    batch: Batch
    result: M2POResult
    failed: frozenset[str] = frozenset()
    padding_probes: tuple[tuple[Batch, M2POResult], ...] = ()  # the probes whose result differed


def merge(names: Iterable[str]) -> Deviation | None:
    """The deviation of several variants at once (None: two set one knob differently)."""
    return combine(names)


_VARIANTS: dict[str, Variant] = {v.name: v for v in VARIANTS}
_ORDER = {v.name: i for i, v in enumerate(VARIANTS)}


class Judge:
    """Which fields of which observation a deviation reproduces (memoised)."""

    def __init__(self, observations: Sequence[Observation], *, dtype: str, compute_dtype: str | None, supplied: frozenset[str] | None) -> None:
        self.observations = list(observations)
        self.dtype, self.compute_dtype, self.supplied = dtype, compute_dtype or dtype, supplied
        self.fields = [self._fields(o.result, supplied) for o in self.observations]
        self.total = sum(len(f) for f in self.fields)
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

    def score(self, dev: Deviation) -> int:
        return self.total - sum(len(self.differences(dev, i)) for i in range(len(self.observations)))

    def reproduces(self, dev: Deviation, field_name: str, indices: Iterable[int] | None = None) -> bool:
        indices = range(len(self.observations)) if indices is None else indices
        return all(field_name not in self.differences(dev, i) for i in indices if field_name in self.fields[i])

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
    knob_count = sum(1 for f in fields(Deviation) if getattr(merge(names) or ALGORITHM_1, f.name) != getattr(ALGORITHM_1, f.name))
    return (len(names), knob_count, sorted(_ORDER[n] for n in names))


def search(judge: Judge, candidates: Sequence[str]) -> Explanation:
    """The smallest combination of ``candidates`` reproducing every judged pair, else the best found."""
    base = judge.score(ALGORITHM_1)
    if base == judge.total:
        return Explanation((), base, judge.total)
    frontier: list[tuple[frozenset[str], int]] = [(frozenset(), base)]
    seen: set[frozenset[str]] = {frozenset()}
    best: tuple[frozenset[str], int] = (frozenset(), base)
    for _ in range(MAX_COMPONENTS):
        grown: list[tuple[frozenset[str], int]] = []
        for state, state_score in frontier:
            for name in candidates:
                combined = state | {name}
                if combined in seen:
                    continue
                seen.add(combined)
                dev = merge(combined)
                if dev is None or dev == merge(state):
                    continue
                combined_score = judge.score(dev)
                if combined_score > state_score:
                    grown.append((combined, combined_score))
        if not grown:
            break
        complete = sorted((s for s, sc in grown if sc == judge.total), key=_preference)
        if complete:
            chosen = _prune(judge, complete[0])
            alternatives = [tuple(sorted(s, key=_ORDER.get)) for s in complete[1:4] if len(s) == len(chosen)]
            return Explanation(tuple(sorted(chosen, key=_ORDER.get)), judge.total, judge.total, alternatives)
        grown.sort(key=lambda t: (-t[1], _preference(t[0])))
        frontier = grown[:BEAM]
        if frontier[0][1] > best[1]:
            best = frontier[0]
    chosen = _prune(judge, best[0])
    return Explanation(tuple(sorted(chosen, key=_ORDER.get)), judge.score(merge(chosen) or ALGORITHM_1), judge.total)


def _prune(judge: Judge, names: frozenset[str]) -> frozenset[str]:
    """Drop every deviation whose removal reproduces no fewer pairs."""
    score = judge.score(merge(names) or ALGORITHM_1)
    for name in sorted(names, key=lambda n: -_ORDER[n]):
        smaller = names - {name}
        dev = merge(smaller)
        if dev is not None and judge.score(dev) >= score:
            names = smaller
    return names


def diagnose(observations: Iterable[Observation], failed_checks: Iterable[str], *, dtype: str, divergent: bool,
             compute_dtype: str | None = None, supplied: frozenset[str] | None = None,
             step_explanations: dict[str, set[str]] | None = None, step_descriptions: dict[str, str] | None = None, step_source: str = "",
             findings: Sequence[dict[str, Any]] = (), prefer: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The diagnosis section of the report (schema in ``report``).

    ``step_explanations`` maps a failing check to the step-level variants (distributed,
    trainer) that reproduce every failing step of it; they explain it ahead of a
    single-batch deviation."""
    observations = list(observations)
    failed = list(dict.fromkeys(failed_checks))
    empty = {"examples_compared": len(observations), "components": [], "by_check": {}, "unexplained": [], "matches": [], "alternatives": [],
             "closest": [], "findings": list(findings), "hints": [], "summary": ""}
    if not divergent:
        return {"status": "not_needed", **empty}
    judge = Judge(observations, dtype=dtype, compute_dtype=compute_dtype, supplied=supplied)
    output_variants = [v.name for v in VARIANTS if v.name != "algorithm_1" and not v.is_behavioural]
    explanation = search(judge, output_variants) if observations else Explanation((), 0, 0)
    if explanation.alternatives:
        # Of equally small explanations: one that also reproduces the port under the padding
        # probes (it reads padding, e.g. column 0's advantage) explains more than a leak; then
        # the one naming the deviations the project accepts (the examples cannot tell them apart).
        pads = "padding_immunity" in failed
        ranked = sorted([explanation.components, *explanation.alternatives],
                        key=lambda names: (pads and not _reads_padding(judge, names), -len(set(names) & prefer)))
        explanation = replace(explanation, components=ranked[0], alternatives=ranked[1:])
    dev = merge(explanation.components) or ALGORITHM_1

    by_check: dict[str, list[str]] = {}
    unexplained: list[str] = []
    step_explanations = step_explanations or {}
    step_choice, step_alternatives = _cover(step_explanations, list(step_descriptions or {}))
    for check in failed:
        if check in step_choice:
            by_check[check] = [step_choice[check]]
            continue
        behavioural = [v.name for v in VARIANTS if v.behaviour_check == check]
        name = field_of(check)
        if check == "padding_immunity" and explanation.components:
            reading = _reads_padding(judge, explanation.components)
            if reading:  # the explanation reproduces the port under every padding it changed with
                by_check[check] = reading
                continue
        if behavioural:
            by_check[check] = behavioural
        elif name is not None and explanation.components and _explained(judge, dev, name, check):
            by_check[check] = _responsible(judge, explanation.components, name, check)
        else:
            unexplained.append(check)

    components = list(dict.fromkeys(n for names in by_check.values() for n in names))
    matches = []
    for name in components:
        explained = [c for c, names in by_check.items() if name in names]
        if name in _VARIANTS:
            v = _VARIANTS[name]
            evidence = (f"check {v.behaviour_check} failed" if v.is_behavioural else
                        f"reproduces {', '.join(sorted({field_of(c) or c for c in explained}))} on all {len(observations)} examples")
            matches.append({"variant": name, "description": v.description, "source": v.source, "evidence": evidence, "checks": explained})
        else:
            matches.append({"variant": name, "description": (step_descriptions or {}).get(name, ""), "source": step_source,
                            "evidence": "reproduces every failing step", "checks": explained})
    status = "no_known_variant" if not by_check else ("matched" if not unexplained else "partly_explained")
    return {
        **empty,
        "status": status,
        "components": components,
        "by_check": by_check,
        "unexplained": unexplained,
        "matches": matches,
        "alternatives": [list(a) for a in explanation.alternatives + step_alternatives],
        "closest": _closest(judge, output_variants, set(components)) if status != "matched" else [],
        "hints": _hints(by_check),
        "summary": summary(status, by_check, unexplained),
    }


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


def _reads_padding(judge: Judge, components: tuple[str, ...]) -> list[str]:
    """The deviations that read padding (e.g. the advantage of column 0), if together they
    reproduce every padding probe the port's result changed under; else [] (a leak)."""
    probes = [Observation(b, r) for o in judge.observations if "padding_immunity" in o.failed for b, r in o.padding_probes]
    if not probes:
        return []
    probe_judge = Judge(probes, dtype=judge.dtype, compute_dtype=judge.compute_dtype, supplied=judge.supplied)
    dev = merge(components) or ALGORITHM_1
    if any(probe_judge.differences(dev, i) for i in range(len(probes))):
        return []
    return [n for n in components if any(probe_judge.differences(merge(c for c in components if c != n) or ALGORITHM_1, i) for i in range(len(probes)))]


def _explained(judge: Judge, dev: Deviation, field_name: str, check: str) -> bool:
    failing = [i for i, o in enumerate(judge.observations) if check in o.failed]
    return bool(failing) and judge.reproduces(dev, field_name)


def _responsible(judge: Judge, components: tuple[str, ...], field_name: str, check: str) -> list[str]:
    """The deviations without which ``check``'s field is no longer reproduced where it failed."""
    failing = [i for i, o in enumerate(judge.observations) if check in o.failed]
    needed = []
    for name in components:
        rest = merge(n for n in components if n != name) or ALGORITHM_1
        if not judge.reproduces(rest, field_name, failing):
            needed.append(name)
    return needed or list(components)


def _closest(judge: Judge, names: Sequence[str], exclude: set[str]) -> list[dict[str, Any]]:
    divergent = [i for i in range(len(judge.observations)) if judge.differences(ALGORITHM_1, i)]
    rows = []
    for name in names:
        if name in exclude:
            continue
        dev = _VARIANTS[name].deviation
        agreed = [i for i in divergent if not judge.differences(dev, i)]
        if not agreed:
            continue
        first = next((judge.differences(dev, i) for i in divergent if judge.differences(dev, i)), {})
        v = _VARIANTS[name]
        rows.append({"variant": name, "description": v.description, "source": v.source, "agreed": len(agreed), "of": len(divergent),
                     "first_difference": next(iter(first.values()), "")})
    rows.sort(key=lambda r: -r["agreed"])
    return rows[:3]


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


def summary(status: str, by_check: dict[str, list[str]], unexplained: list[str]) -> str:
    """One line: "partly explained: loss, gradient by clamped_log_ratio; metrics.m2_after unexplained"."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for check, names in by_check.items():
        groups.setdefault(tuple(names), []).append(check)
    parts = [f"{', '.join(checks)} by {' + '.join(names)}" for names, checks in groups.items()]
    if unexplained:
        parts.append(f"{', '.join(unexplained)} unexplained")
    lead = {"matched": "explained", "partly_explained": "partly explained", "no_known_variant": "no known deviation explains it"}.get(status, status)
    return f"{lead}: {'; '.join(parts)}" if parts else lead
