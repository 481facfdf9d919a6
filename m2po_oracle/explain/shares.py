"""How much of a failing check a name explains: the share of failing examples it reproduces,
the passing ones it contradicts, and the residual it leaves (with its float32 rounding)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from m2po_oracle.explain.deviations import (
    ALGORITHM_1,
    Deviation,
)
from m2po_oracle.explain.evidence import Judge, merge
from m2po_oracle.explain.record import Feature, HeldOut, Residual, ResidualExample, Share
from m2po_oracle.judge import coverage
from m2po_oracle.judge.checks import result_field

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


@dataclass(frozen=True)
class Measured:
    """A check's failing examples the explanation reproduces, and the examples it contradicts
    (Algorithm 1 reproduces the port's field there, the explanation does not)."""

    field_name: str
    reproduced: list[int]
    failing: int
    contradicted: int
    residual: list[int]  # the failing examples not reproduced, then the contradicted ones
    held_out: HeldOut | None = None  # the counts on the examples beyond the search's sample (None: none held out)

    @property
    def explained(self) -> int:
        return len(self.reproduced)

    @property
    def of(self) -> int:
        return self.failing + self.contradicted

    def share(self, components: tuple[str, ...]) -> Share:
        """The share as the report states it, explained by ``components``."""
        return Share(
            self.explained,
            self.failing,
            self.contradicted,
            self.of,
            self.explained / self.of if self.of else 0.0,
            tuple(components),
            self.held_out,
        )


@dataclass(frozen=True)
class Left:
    """What a check's explanation leaves: the residual's examples, and the explanation they are measured against."""

    residual: list[int]
    components: tuple[str, ...]


def share_of(judge: Judge, dev: Deviation, field_name: str, check: str) -> Measured:
    """How much of ``check`` the explanation reproduces: its failing examples whose field it
    reproduces, and the examples it contradicts (Algorithm 1 reproduces the port's field
    there, the explanation does not), counted against it in the share."""
    judged = [i for i in range(len(judge.observations)) if field_name in judge.fields[i]]
    failing = [i for i in judged if check in judge.observations[i].failed]
    reproduced = judge.reproduced(dev, field_name, failing)
    contradicted = [
        i
        for i in judged
        if check not in judge.observations[i].failed
        and field_name in judge.differences(dev, i)
        and field_name not in judge.differences(ALGORITHM_1, i)
    ]
    residual = sorted(set(failing) - set(reproduced)) + contradicted
    held_failing = [i for i in failing if judge.held_out(i)]
    held_out = (
        HeldOut(sum(1 for i in reproduced if judge.held_out(i)), len(held_failing), sum(1 for i in contradicted if judge.held_out(i)))
        if held_failing
        else None
    )
    return Measured(field_name, reproduced, len(failing), len(contradicted), residual, held_out)


def net_supported(share: Measured | Share | HeldOut) -> bool:
    """The naming rule (:data:`NAMED_SHARE`, :data:`CONTRADICTION_BOUND`) on a check's share."""
    explained, failing, contradicted = share.explained, share.failing, share.contradicted
    return explained > 0 and explained >= NAMED_SHARE * failing and contradicted <= CONTRADICTION_BOUND * explained


def named(share: Measured | Share) -> bool:
    """The naming rule on every example and on the held-out ones alone: a name the search
    chose on its sample must hold beyond it. A check with no failing example held out (it
    failed once) has nothing to judge a name on: it stays unexplained, with its lead."""
    return net_supported(share) and share.held_out is not None and net_supported(share.held_out)


def share_text(share: Share) -> str:
    text = f"{share.explained} of {share.failing} failing examples"
    if share.contradicted:
        text += f" (and differs from the port on {share.contradicted} where Algorithm 1 does not)"
    return text + f" ({held_out_text(share.held_out)})"


def held_out_text(held: HeldOut | None) -> str:
    """The held-out figures as the report says them."""
    if held is None:
        return "none of its failing examples held out"
    text = f"held out: {held.explained} of {held.failing}"
    return text + (f", {held.contradicted} contradicted" if held.contradicted else "")


def residuals_of(judge: Judge, left: dict[str, Left], compute_dtype: str, replay: Any, unexplained: bool = False) -> list[Residual]:
    """The examples each check's explanation does not reproduce, grouped where several
    checks leave the same ones: how many, the features they share (against how often each
    holds where the explanation reproduces the check), and the smallest as a counterexample
    with its replay command. ``unexplained``: checks nothing names, whose failing examples
    are characterised all the same."""
    groups: dict[tuple[int, ...], list[str]] = {}
    for check, what in left.items():
        if what.residual:
            groups.setdefault(tuple(what.residual), []).append(check)
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
        field_names = {result_field(c) for c in checks}
        explained = [i for i, o in enumerate(judge.observations) if set(checks) & o.failed and i not in indices]
        counts = {name: sum(name in features(i) for i in indices) for name in coverage.FEATURES if name != "nan_padding"}
        elsewhere = {name: sum(name in features(i) for i in explained) for name in counts}
        shown = sorted(
            (n for n in counts if counts[n]), key=lambda n: (-counts[n] / len(indices) + elsewhere[n] / max(len(explained), 1), n)
        )
        smallest = min(indices, key=lambda i: (int(judge.observations[i].batch.valid.size), i))
        observation = judge.observations[smallest]
        example = observation.example if observation.example is not None else observation.batch
        against = left[checks[0]].components
        dev = merge(against) or ALGORITHM_1
        first = next((text for f, text in judge.differences(dev, smallest).items() if f in field_names), "")
        residuals.append(
            Residual(
                checks=tuple(checks),
                unexplained=unexplained,
                count=len(indices),
                contradicted=sum(1 for i in indices if not set(checks) & judge.observations[i].failed),
                features=tuple(
                    Feature(n, counts[n], len(indices), elsewhere[n], len(explained), coverage.FEATURES[n].when)
                    for n in shown[:RESIDUAL_FEATURES_SHOWN]
                ),
                shared=tuple(n for n in shown if counts[n] == len(indices)),
                float32_fits=_float32_fits(judge, dev, indices, field_names),
                explanation=tuple(against),  # what the residual is measured against ((): Algorithm 1)
                counterexample=ResidualExample(observation.batch, first, replay(example) if replay is not None else None),
            )
        )
    return residuals


def _float32_fits(judge: Judge, dev: Deviation, indices: Sequence[int], field_names: set[str | None]) -> int | None:
    """Of the residual's examples, those the explanation reproduces when judged at float32's
    tolerance: where that is most of them, the port computes these fields in float32 (a
    precision no knob of the vocabulary names for the loss and gradient). None where the run
    already judges at float32 or coarser: nothing was measured."""
    if judge.compute_dtype != "float64":
        return None
    observations = [judge.observations[i] for i in indices]
    loose = Judge(observations, dtype="float32", compute_dtype="float32", supplied=judge.supplied, keep_inferred=judge.keep_inferred)
    return sum(1 for k in range(len(observations)) if not (set(loose.differences(dev, k)) & field_names))
