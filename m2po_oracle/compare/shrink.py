"""From a failing example to a minimal counterexample: the same search replayed with "this
check fails" (and, for a cause, "it shows alone") as the goal, which Hypothesis shrinks."""

from __future__ import annotations

import random
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
from hypothesis.errors import Flaky, NoSuchExample, Unsatisfiable

from m2po_oracle.adapters import ADAPTERS
from m2po_oracle.call.runner import Runner
from m2po_oracle.compare.database import search_settings, seeded_find
from m2po_oracle.compare.report import CompareReport, Counterexample
from m2po_oracle.explain.deviations import VARIANTS
from m2po_oracle.explain.evidence import Judge, Observation, merge
from m2po_oracle.judge.battery import BatteryOutcome
from m2po_oracle.oracle.batch import Batch


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
        example, outcome, stopped = shrink_to_minimal(runner, set(checks), first.first_failure, strategy, shows, checks_run)
        shrunk_outcomes.append((example, outcome))
        check = next((c for c in checks if c in outcome.failed_checks), first.name)
        found.append(replace(counterexample_of(runner, check, example, outcome, cause, checks), shrink_stopped=stopped))
    return found


def keep_inferred(runner: Runner) -> bool:
    """Whether the runner's adapter reads the port's mask from its zero gradients."""
    adapter = runner.describe().adapter
    return adapter is not None and adapter.name in ADAPTERS and ADAPTERS[adapter.name].keep_inferred


def shows_alone(
    report: CompareReport, names: tuple[str, ...], checks: tuple[str, ...], supplied: frozenset[str] | None, keep_inferred: bool = False
) -> Callable[[BatteryOutcome], bool]:
    """Whether an outcome fails one of ``checks`` and these deviations alone reproduce it."""
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
) -> tuple[Any, BatteryOutcome, str | None]:
    """Replay the same search with "one of these checks fails" (and, given ``shows``, "the
    cause shows alone") as the goal; Hypothesis shrinks it, and a batch is then reduced
    (:func:`reduce_batch`). The example, its outcome, and why the reduction stopped early (None: it did not)."""

    def search(goal: Callable[[BatteryOutcome], bool]) -> Any:
        options = runner.options
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return seeded_find(
                strategy,
                lambda example: goal(battery_of(runner, example, checks_run)),
                search_settings(options.examples),
                random.Random(options.seed),
            )

    example, stopped = fallback, None
    for goal in ([shows] if shows is not None else []) + [lambda outcome: bool(checks & set(outcome.failed_checks))]:
        try:
            example = search(goal)
        except (NoSuchExample, Unsatisfiable, Flaky):  # no example shows it alone, or a flaky check did not fail again
            continue
        if isinstance(example, Batch):
            # Hypothesis shrinks the draws, not the batch: a 4x2 draw may be its simplest
            # while one row of two tokens shows the same failure.
            example, stopped = reduce_batch(example, _holding(goal, runner, checks_run))
        break
    return example, battery_of(runner, example, checks_run), stopped


def _holding(goal: Callable[[BatteryOutcome], bool], runner: Runner, checks_run: tuple[str, ...] | None) -> Callable[[Batch], bool]:
    """Whether a batch still reaches ``goal`` under the runner's battery."""
    return lambda batch: goal(battery_of(runner, batch, checks_run))


#: The calls a reduction of one counterexample may spend, and its time, before it stops and says so.
REDUCTION_CALLS = 400
REDUCTION_SECONDS = 60.0


def reduce_batch(
    batch: Batch, holds: Callable[[Batch], bool], calls: int = REDUCTION_CALLS, seconds: float = REDUCTION_SECONDS
) -> tuple[Batch, str | None]:
    """The smallest batch found from ``batch`` on which ``holds`` still does: fewest rows,
    then fewest tokens, then the simplest values (a small integer, then one, two or three
    binary digits) and the simplest tau. None, or why it stopped before it could try
    every step (its budget of calls or time)."""
    started, spent = time.perf_counter(), 0

    def still(candidate: Batch) -> bool:
        nonlocal spent
        if spent >= calls or time.perf_counter() - started > seconds:
            raise _Spent
        spent += 1
        # A port's failure on a candidate is a finding in its outcome; an error here is the
        # toolkit's own, and is not swallowed (as in the search).
        return bool(holds(candidate))

    try:
        # Simpler values can free a row or a token that was needed before: again until a
        # whole pass changes nothing.
        changed = True
        while changed:
            before = batch
            if batch.shape[0] > 1:  # Algorithm 1 selects over the whole batch: one row may hold every token
                row = lambda a: a.reshape(1, -1)  # noqa: E731
                flat = Batch(row(batch.logp), row(batch.behavior_logp), row(batch.advantages), row(batch.valid), batch.tau)
                if still(flat):
                    batch = flat
            for axis in (0, 1):  # rows, then tokens
                if axis == 1:
                    # A token made padding, then each row's valid tokens moved to its front:
                    # the columns left empty go with the next step.
                    for index in zip(*np.nonzero(batch.valid)):
                        valid = batch.valid.copy()
                        valid[index] = False
                        if valid.any() and still(candidate := replace(batch, valid=valid)):
                            batch = candidate
                    packed = _packed(batch)
                    if packed is not None and still(packed):
                        batch = packed
                position = batch.shape[axis] - 1
                while position >= 0 and batch.shape[axis] > 1:
                    smaller = _without(batch, axis, position)
                    if smaller.valid.any() and still(smaller):
                        batch = smaller
                    position = min(position - 1, batch.shape[axis] - 1)
            for name in ("advantages", "logp", "behavior_logp"):
                for index in zip(*np.nonzero(np.ones(batch.shape, dtype=bool))):
                    for value in _simpler(float(getattr(batch, name)[index])):
                        array = getattr(batch, name).copy()
                        array[index] = value
                        candidate = replace(batch, **{name: array})
                        if still(candidate):
                            batch = candidate
                            break
            for tau in _simpler(batch.tau, nonnegative=True):
                candidate = replace(batch, tau=tau)
                if still(candidate):
                    batch = candidate
                    break
            changed = batch is not before
    except _Spent:
        return batch, f"the reduction stopped after {spent} calls ({time.perf_counter() - started:.0f} s): a smaller batch may show it too"
    return batch, None


class _Spent(Exception):
    """The reduction's budget is spent."""


def _packed(batch: Batch) -> Batch | None:
    """Each row's valid tokens first, in their order, its padding after (None: already so)."""
    order = np.argsort(~batch.valid, axis=1, kind="stable")
    if np.array_equal(order, np.broadcast_to(np.arange(batch.shape[1]), batch.shape)):
        return None
    take = lambda a: np.take_along_axis(a, order, axis=1)  # noqa: E731
    return Batch(take(batch.logp), take(batch.behavior_logp), take(batch.advantages), take(batch.valid), batch.tau)


def _without(batch: Batch, axis: int, position: int) -> Batch:
    keep = [k for k in range(batch.shape[axis]) if k != position]
    take = (lambda a: a[keep, :]) if axis == 0 else (lambda a: a[:, keep])
    return Batch(take(batch.logp), take(batch.behavior_logp), take(batch.advantages), take(batch.valid), batch.tau)


def _simpler(value: float, nonnegative: bool = False) -> list[float]:
    """Values simpler than ``value`` (fewer digits), simplest first, each closer than the
    last; none when ``value`` is already among them. NaN and inf stay what they are."""
    if not np.isfinite(value):
        return []
    found: list[float] = []
    for step in (1.0, 0.5, 0.25, 0.125):
        candidates = [0.0, float(np.round(value / step) * step)] if step == 1.0 else [float(np.round(value / step) * step)]
        for candidate in candidates:
            if candidate == value:
                return found
            if candidate not in found and not (nonnegative and candidate < 0):
                found.append(candidate)
    return found
