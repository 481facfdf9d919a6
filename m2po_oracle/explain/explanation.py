"""The search for the smallest set of known deviations that reproduces the failing examples:
a beam over the deviations' knobs, grown one component at a time, then pruned."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from m2po_oracle.explain.deviations import (
    ALGORITHM_1,
    JOINT_MOVES,
    Deviation,
    fitted_name,
    variant,
)
from m2po_oracle.explain.evidence import Judge, in_order, merge
from m2po_oracle.explain.fitting import PARAMETERS, acts, fit_direct, refit_on_grids

#: At most this many deviations in one explanation, and combinations kept per size (the
#: authors' release alone combines five: clip kind, floors, column 0's sign, epsilon, float32 bound).
MAX_COMPONENTS = 6


BEAM = 4


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
    return (len(names), knob_count, sorted(in_order(n) for n in names))


def margin(size: int) -> int:
    """The (observation, field) pairs a combination of ``size`` deviations must reproduce
    beyond the smaller one it grew from: each added knob is a free choice that fits some
    pairs by chance, and the more knobs, the more it can fit, so the bar rises with the size
    (1 for the first four, then one more per knob: a rare effect seen twice still earns a
    third name, which the held-out examples then judge)."""
    return max(1, size - 3)


def moves_of(candidates: Sequence[str]) -> list[frozenset[str]]:
    """What one search step may add: a known deviation (a parametric one at each value of
    its grid, so that a port's own value is found during the search, not only refit at the
    end), or a group whose members only act together (a clip kind with its floors; strict
    stop with keep-one)."""
    allowed = set(candidates)
    moves = [frozenset({n}) for n in candidates]
    for name in candidates:
        known = variant(name)
        parameter = PARAMETERS.get(known.parameter or "")
        if parameter is not None and known.name == known.base:
            default = getattr(known.deviation, known.parameter or "")
            moves += [frozenset({fitted_name(known.base, v)}) for v in parameter.grid if v != default]
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
    moves = moves_of(candidates)
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
                combined = fit_direct(judge, combined, fitted=move - state)
                dev = merge(combined)
                if dev is None:
                    continue
                if not acts(judge, dev):
                    continue
                combined_score = judge.score(dev, at_least=state_score + margin(len(combined)))
                if combined_score is not None:
                    grown.append((combined, combined_score))
        if not grown:
            break
        complete = sorted((s for s, sc in grown if sc == judge.total), key=_preference)
        if complete:
            chosen = pruned(judge, complete[0])
            alternatives = [tuple(sorted(s, key=in_order)) for s in complete[1:4] if len(s) == len(chosen)]
            return Explanation(tuple(sorted(chosen, key=in_order)), judge.total, judge.total, alternatives)
        grown.sort(key=lambda t: (-t[1], _preference(t[0])))
        frontier = grown[:BEAM]
        if frontier[0][1] > best[1]:
            best = frontier[0]
    chosen = refit_on_grids(judge, pruned(judge, best[0]))
    return Explanation(tuple(sorted(chosen, key=in_order)), judge.score(merge(chosen) or ALGORITHM_1), judge.total)


def pruned(judge: Judge, names: frozenset[str]) -> frozenset[str]:
    """Drop every deviation whose removal reproduces no fewer pairs."""
    score = judge.score(merge(names) or ALGORITHM_1)
    for name in sorted(names, key=lambda n: -in_order(n)):
        smaller = names - {name}
        dev = merge(smaller)
        if dev is not None and judge.score(dev, at_least=score) is not None:
            names = smaller
    return names
