"""From a failing example to a minimal counterexample: the same search replayed with "this
check fails" (and, for a cause, "it shows alone") as the goal, which Hypothesis shrinks."""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from hypothesis import find
from hypothesis.errors import Flaky, NoSuchExample, Unsatisfiable

from m2po_oracle.call.runner import Runner
from m2po_oracle.compare.database import search_settings
from m2po_oracle.compare.report import CompareReport, Counterexample
from m2po_oracle.explain.evidence import Observation
from m2po_oracle.judge.battery import BatteryOutcome


def battery_of(runner: Runner, example: Any, checks: tuple[str, ...] | None) -> BatteryOutcome:
    """The runner's battery on one example, reduced to the selected checks (--checks)."""
    outcome = runner.run_battery(example)
    if checks is None:
        return outcome
    return replace(
        outcome,
        mismatches=tuple(m for m in outcome.mismatches if m.check in checks),
        checked=tuple(c for c in outcome.checked if c in checks),
    )


def causes_of(report: CompareReport, value_variants: set[str]) -> list[tuple[str | None, tuple[str, ...], tuple[str, ...]]]:
    """(cause, its deviations to reproduce alone or (), the failing checks it shows), one per distinct cause."""
    by_check = report.diagnosis.by_check
    groups: dict[str, tuple[tuple[str, ...], list[str]]] = {}
    plan: list[tuple[str | None, tuple[str, ...], tuple[str, ...]]] = []
    for name, tally in report.tallies.items():
        if tally.first_failure is None:
            continue
        names = tuple(by_check.get(name, ()))
        if names and set(names) <= value_variants:
            groups.setdefault(" + ".join(names), (names, []))[1].append(name)
        else:
            plan.append((names[0] if len(names) == 1 else (" + ".join(names) or None), (), (name,)))
    return [(cause, names, tuple(checks)) for cause, (names, checks) in groups.items()] + plan


def counterexamples_of(
    runner: Runner,
    report: CompareReport,
    strategy: Any,
    shrink: bool,
    supplied: frozenset[str] | None,
    checks_run: tuple[str, ...] | None = None,
) -> list[Counterexample]:
    """One counterexample per distinct cause: each explained group of checks is shrunk on
    examples where its deviations alone reproduce the port (when any does), every other
    failing check on its own."""
    from m2po_oracle.explain.deviations import VARIANTS

    value_variants = {v.name for v in VARIANTS if not v.is_behavioural} | {
        n for names in report.diagnosis.by_check.values() for n in names if "(" in n
    }  # fitted values of known ones
    found: list[Counterexample] = []
    # A step runner's example costs a model or a world: a minimal input already found for one
    # check also serves every other check it fails, instead of a new search per check.
    shrunk_outcomes: list[tuple[Any, BatteryOutcome]] = []
    for cause, alone, checks in causes_of(report, value_variants):
        tallies = [report.tallies[c] for c in checks]
        first = min(tallies, key=lambda t: t.first_failure_at or 0)
        if not shrink:  # shrinking a hanging implementation would wait out the timeout on every try
            outcome = battery_of(runner, first.first_failure, checks_run)
            found.append(counterexample_of(runner, first.name, first.first_failure, outcome, cause, checks))
            continue
        prior = next(((e, o) for e, o in shrunk_outcomes if set(checks) & set(o.failed_checks)), None) if runner.costly_examples else None
        if prior is not None:
            found.append(counterexample_of(runner, first.name, *prior, cause, checks))
            continue
        shows = shows_alone(report, alone, checks, supplied, keep_inferred(runner)) if alone else None
        example, outcome = shrink_to_minimal(runner, set(checks), first.first_failure, strategy, shows, checks_run)
        shrunk_outcomes.append((example, outcome))
        check = next((c for c in checks if c in outcome.failed_checks), first.name)
        found.append(counterexample_of(runner, check, example, outcome, cause, checks))
    return found


def keep_inferred(runner: Runner) -> bool:
    """Whether the runner's adapter reads the port's mask from its zero gradients."""
    from m2po_oracle.adapters import ADAPTERS

    adapter = runner.describe().adapter
    return adapter is not None and adapter.name in ADAPTERS and ADAPTERS[adapter.name].keep_inferred


def shows_alone(
    report: CompareReport, names: tuple[str, ...], checks: tuple[str, ...], supplied: frozenset[str] | None, keep_inferred: bool = False
) -> Callable[[BatteryOutcome], bool]:
    """Whether an outcome fails one of ``checks`` and these deviations alone reproduce it."""
    from m2po_oracle.explain.evidence import Judge, merge

    dev = merge(names)

    def shows(outcome: BatteryOutcome) -> bool:
        result = outcome.measurement.result
        if result is None or dev is None or not set(checks) & set(outcome.failed_checks):
            return False
        judge = Judge(
            [Observation(outcome.batch, result)],
            dtype=report.dtype,
            compute_dtype=report.compute_dtype,
            supplied=supplied,
            keep_inferred=keep_inferred,
        )
        return not judge.differences(dev, 0)

    return shows


def counterexample_of(
    runner: Runner, check: str, example: Any, outcome: BatteryOutcome, cause: str | None = None, checks: tuple[str, ...] = ()
) -> Counterexample:
    shown = set(checks or (check,))
    mismatches = tuple(m for m in outcome.mismatches if m.check in shown) or outcome.mismatches
    return Counterexample(
        check,
        outcome.batch,
        mismatches,
        runner.replay_command(example),
        outcome.measurement.result,
        outcome.ranks,
        outcome.case,
        cause,
        tuple(c for c in (checks or (check,)) if c in outcome.failed_checks) or (check,),
        example,
    )


def shrink_to_minimal(
    runner: Runner,
    checks: set[str],
    fallback: Any,
    strategy: Any,
    shows: Callable[[BatteryOutcome], bool] | None = None,
    checks_run: tuple[str, ...] | None = None,
) -> tuple[Any, BatteryOutcome]:
    """Replay the same search with "one of these checks fails" (and, given ``shows``, "the
    cause shows alone") as the goal; Hypothesis shrinks it."""

    def search(goal: Callable[[BatteryOutcome], bool]) -> Any:
        options = runner.options
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return find(
                strategy,
                lambda example: goal(battery_of(runner, example, checks_run)),
                settings=search_settings(options.examples),
                random=random.Random(options.seed),
            )

    example = fallback
    for goal in ([shows] if shows is not None else []) + [lambda outcome: bool(checks & set(outcome.failed_checks))]:
        try:
            example = search(goal)
            break
        except (NoSuchExample, Unsatisfiable, Flaky):  # no example shows it alone, or a flaky check did not fail again
            continue
    return example, battery_of(runner, example, checks_run)
