"""The exploration: generated examples through the runner's battery, each check tallied, the
evidence kept for the diagnosis, stopped early on dead or hanging calls; then the
counterexamples shrunk and the failures diagnosed."""

from __future__ import annotations

import itertools
import random
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from hypothesis.errors import NoSuchExample, Unsatisfiable

from m2po_oracle import oracle, strategies
from m2po_oracle.call.loss_function import batch_strategy
from m2po_oracle.call.runner import Runner
from m2po_oracle.compare.database import ExampleDatabase, search_settings, seeded_find
from m2po_oracle.compare.report import CompareReport
from m2po_oracle.compare.shrink import battery_of, counterexamples_of, keep_inferred
from m2po_oracle.explain.deviations import Accepted
from m2po_oracle.explain.diagnosis import diagnose
from m2po_oracle.explain.evidence import Examples, Observation, Reading, RunnerFacts
from m2po_oracle.explain.record import Diagnosis, Finding
from m2po_oracle.judge.battery import DRAWN_PADDING, BatteryOutcome
from m2po_oracle.judge.checks import BEHAVIOURAL_CHECKS
from m2po_oracle.judge.metric_averaging import NAME as METRIC_AVERAGING
from m2po_oracle.judge.metric_averaging import UnweightedMean
from m2po_oracle.oracle.batch import Batch
from m2po_oracle.oracle.record import M2POResult

#: Exploration stops after this many timed-out calls.
MAX_TIMEOUTS = 2


#: ... and when the implementation's process died on each of this many first calls.
MAX_DEAD_CALLS = 5


#: The search's sample: half from failing examples, half from passing ones, and beyond that
#: the first few of every failing check, so each is represented.
DIAGNOSIS_EXAMPLES = 120


OBSERVATIONS_PER_CHECK = 3


#: Examples beyond the search's sample, held out: a name must reproduce them too (the
#: search never chose on them), and the shares count them.
SHARE_EXAMPLES = 2000


#: Examples per family at the start of every run of batches, in rotation (``stratified_start``).
STRATIFIED_PER_FAMILY = 7


def stratified_start(tau: float | None, seed: int, most: int) -> list[Batch]:
    """The first examples of a run of batches: each family of ``strategies.FAMILIES`` drawn
    (every budget set to ``tau`` if given), seeded by the run's seed, then interleaved, so
    that whatever the seed the first examples rotate through every family (a seed whose free
    search draws no split-scope batch in its first 50 would pass a scope bug). At most ``most``."""
    per_family: list[list[Batch]] = []
    for k, family in enumerate(strategies.FAMILIES):
        drawn: list[Batch] = []

        def record(example: Batch, drawn: list[Batch] = drawn) -> bool:
            drawn.append(example)
            return False

        of_family = batch_strategy(tau, strategies.family(family))
        try:
            seeded_find(of_family, record, search_settings(STRATIFIED_PER_FAMILY + 1, generate_only=True), random.Random(f"{seed}:{k}"))
        except (NoSuchExample, Unsatisfiable):
            pass
        # Hypothesis draws the family's simplest example first; the free search draws simple
        # examples anyway, and a random one exercises more of the battery.
        per_family.append(drawn[1:])
    rotation = [e for round_ in itertools.zip_longest(*per_family) for e in round_ if e is not None]
    return rotation[: max(most, 0)]


class StopExploring(BaseException):  # BaseException: Hypothesis must not shrink it
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Exploration:
    """How a compare run explores and reports, beyond what the runner is told."""

    shrink: bool = True
    max_failures: int | None = None  # stop after this many failing examples (-x: 1)
    checks: tuple[str, ...] | None = None  # run only these checks (None: every check of the runner)
    skip_validation: bool = False
    database: str | None = None  # a Hypothesis example database folder: failing examples replay first
    accept: tuple[Accepted, ...] = ()
    strict_accept: bool = True


@dataclass
class Evidence:
    """What exploration keeps for the diagnosis."""

    failing: list[Observation] = field(default_factory=list)
    passing: list[Observation] = field(default_factory=list)
    more_failing: list[Observation] = field(default_factory=list)  # beyond the search's sample: counted in the shares
    more_passing: list[Observation] = field(default_factory=list)  # likewise: where a name's contradictions are counted
    call_failure_taus: list[float] = field(default_factory=list)  # the budget of each call that raised or returned no result
    per_check: dict[str, int] = field(default_factory=dict)  # check -> its failing examples in the search's sample
    seen: dict[str, int] = field(default_factory=dict)  # check -> its failing examples so far ("": passing ones)
    step_by_check: dict[str, set[str]] = field(default_factory=dict)  # check -> step variants reproducing each of its failing steps
    non_finite: int = 0  # examples whose loss or gradient is not finite on valid, finite inputs
    non_finite_checks: set[str] = field(default_factory=set)
    non_finite_empty: int = 0  # of those, batches without a valid token (the loss's N is 0)
    # Steps whose logged metrics are their micro-batches' own values averaged unweighted, with the checks they failed.
    averaged: list[tuple[UnweightedMean, tuple[str, ...]]] = field(default_factory=list)

    def keep(self, outcome: BatteryOutcome, example: Any = None) -> None:
        if outcome.metric_averaging is not None:
            checks = tuple(n for n in outcome.failed_checks if n.startswith("metrics."))
            self.averaged.append((outcome.metric_averaging, checks))
        result = outcome.measurement.result
        if result is None:
            if "call" in outcome.failed_checks and isinstance(outcome.batch, Batch):
                self.call_failure_taus.append(float(outcome.batch.tau))
            return
        value_failures = frozenset(n for n in outcome.failed_checks if n not in BEHAVIOURAL_CHECKS)
        observation = Observation(outcome.batch, result, frozenset(outcome.failed_checks), outcome.padding_probes, example)
        # A behavioural failure (a padding probe) needs observations too: the diagnosis
        # replays the probes to tell a deviation that reads padding from a leak.
        bucket = self.failing if value_failures else self.passing
        # Alternate between the search's sample and the held-out examples, by the rarest
        # failing check's count so far: each check with two failing examples or more has some
        # held out, on which a name chosen on the sample is judged.
        rarest = min((self.seen.get(n, 0) for n in outcome.failed_checks), default=self.seen.get("", 0))
        for n in outcome.failed_checks or ("",):
            self.seen[n] = self.seen.get(n, 0) + 1
        underrepresented = any(self.per_check.get(n, 0) < OBSERVATIONS_PER_CHECK for n in outcome.failed_checks)
        to_sample = rarest % 2 == 0 and (len(bucket) < DIAGNOSIS_EXAMPLES // 2 or underrepresented)
        if to_sample:
            bucket.append(observation)
            for n in outcome.failed_checks:
                self.per_check[n] = self.per_check.get(n, 0) + 1
        elif value_failures and len(self.more_failing) < SHARE_EXAMPLES:
            self.more_failing.append(observation)
        elif not value_failures and len(self.more_passing) < SHARE_EXAMPLES:
            self.more_passing.append(observation)
        if not _finite_on_valid(outcome.batch, result):
            self.non_finite += 1
            self.non_finite_empty += not outcome.batch.valid.any()
            self.non_finite_checks.update(n for n in outcome.failed_checks if n in ("loss", "gradient"))

    def keep_step(self, outcome: BatteryOutcome) -> None:
        assert outcome.explained_by is not None  # called for an outcome with step-level variants only
        found = set(outcome.explained_by or ()) & set(outcome.explained_by if outcome.evidenced is None else outcome.evidenced)
        for check in outcome.failed_checks:
            self.step_by_check[check] = found if check not in self.step_by_check else self.step_by_check[check] & found

    def _empty(self) -> str:
        # "Finite on every valid token" holds vacuously where there is none: say how many of
        # them that is, since there the port's NaN is a 0/0 where Algorithm 1's loss is 0.
        if not self.non_finite_empty:
            return ""
        every = "every one of them" if self.non_finite_empty == self.non_finite else f"{self.non_finite_empty} of them"
        return f"; {every} has no valid token at all (N = 0, where Algorithm 1's loss is 0)"

    def findings(self) -> list[Finding]:
        found = []
        if self.non_finite:
            found.append(
                Finding(
                    "non_finite_result",
                    tuple(sorted(self.non_finite_checks)),
                    f"the loss or gradient is NaN or infinite on {self.non_finite} example(s) whose inputs are finite on every "
                    "valid token: a finding of its own (not a padding leak: padding is probed apart)" + self._empty(),
                )
            )
        if self.averaged:
            first, _ = self.averaged[0]
            checks = sorted({c for _, cs in self.averaged for c in cs})
            found.append(
                Finding(
                    METRIC_AVERAGING,
                    tuple(checks),
                    f"on {len(self.averaged)} step(s) the logged metrics are the micro-batches' own values averaged with equal "
                    f"weight, not Algorithm 1's token-weighted ones; the first: {first.summary()}",
                )
            )
        return found


def _finite_on_valid(batch: Batch, result: M2POResult) -> bool:
    """False where the port's loss or gradient is NaN/inf although Algorithm 1's, on the
    port's own mask, is finite (an overflow of exp(d) is not the port's fault)."""
    grad_finite = result.grad is None or bool(np.all(np.isfinite(result.grad[batch.valid])))
    if np.isfinite(result.loss) and grad_finite:
        return True

    expected = oracle.evaluate_with_mask(batch, result.keep)
    assert expected.grad is not None  # the oracle's result always has its gradient
    if not np.isfinite(result.loss) and np.isfinite(expected.loss):
        return False
    return grad_finite or not bool(np.all(np.isfinite(expected.grad[batch.valid])))


def explore_and_judge(
    runner: Runner,
    report: CompareReport,
    exploration: Exploration,
    on_example: Callable[[BatteryOutcome], None] | None,
    until_first_failure: bool = False,
) -> None:
    options = runner.options
    strategy = runner.strategy()
    tallies = report.tallies
    evidence = Evidence()
    checks = exploration.checks
    failing_examples = 0
    database = ExampleDatabase(exploration.database, runner) if exploration.database else None

    def explore(example: Any) -> bool:
        nonlocal failing_examples
        report.examples += 1
        outcome = battery_of(runner, example, checks)
        for name in outcome.checked:
            if name in tallies:
                tallies[name].ran += 1
        for name in report.coverage.add(example, outcome, options.effective_compute_dtype):
            if name in tallies:
                tallies[name].exercised += 1
        for name in outcome.failed_checks:
            tally = tallies[name]
            tally.failures += 1
            if tally.first_failure is None:
                tally.first_failure, tally.first_failure_at = example, report.examples
        evidence.keep(outcome, example)
        if outcome.measurement.result is not None:
            for ours, where in outcome.measurement.result.metric_sources:
                report.metric_sources.setdefault(ours, where)
        if outcome.explained_by is not None:
            evidence.keep_step(outcome)
        if outcome.ranks and not report.collectives:
            report.collectives.extend({"rank": r["rank"], "coords": r["coords"], "collectives": r["collectives"]} for r in outcome.ranks)
        if on_example is not None:
            on_example(outcome)
        failing_examples += bool(outcome.failed_checks)
        if until_first_failure and outcome.failed_checks:
            raise StopExploring(f"first failure at example {report.examples} (measuring how soon it is caught)")
        if exploration.max_failures and failing_examples >= exploration.max_failures:
            raise StopExploring(f"stopped after {failing_examples} failing example(s) (--max-failures {exploration.max_failures})")
        health = runner.health
        if health.timeouts >= MAX_TIMEOUTS:
            raise StopExploring(
                f"{health.timeouts} calls timed out (--timeout {options.timeout:g} s): every further call would likely wait it out too"
            )
        if report.examples >= MAX_DEAD_CALLS and died_on_every_call(runner, report):
            raise StopExploring(f"the implementation's process died on each of the first {health.crashes} calls")
        return False

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            for saved in database.saved() if database else ():  # last run's failing examples first, as Hypothesis does
                explore(saved)
            # A distributed world draws split-scope batches first already (its strategy), and
            # its audit's step-by-step agreement with compare holds on that order only.
            if runner.example_key() == "batch" and runner.options.topology is None:
                for example in stratified_start(options.tau, options.seed, options.examples - report.examples):
                    explore(example)
            remaining = options.examples - report.examples
            if remaining > 0:
                seeded_find(strategy, explore, search_settings(remaining), random.Random(options.seed))
        except NoSuchExample:
            pass
        except StopExploring as stop:
            report.stopped_early = stop.reason

    hung = runner.health.timeouts >= MAX_TIMEOUTS
    supplied = supplied_fields(runner)
    diagnose_failures(runner, report, evidence, supplied)
    # Shrinking waits out every timeout again, and where the process died on every call each
    # smaller batch only dies too, in a fresh process each: the first failing example stands.
    dead = died_on_every_call(runner, report)
    report.counterexamples = counterexamples_of(
        runner, report, strategy, exploration.shrink and not runner.health.timeouts and not dead, supplied, checks
    )
    if dead and exploration.shrink:
        why = "not shrunk: the implementation's process died on every call, so every smaller batch would only die too"
        report.counterexamples = [replace(c, shrink_stopped=why) for c in report.counterexamples]
    if database:
        database.save(c.example for c in report.counterexamples)
    if exploration.skip_validation:
        report.validation_not_run = "skipped (--skip-validation)"
    elif hung:  # each probe would wait out the timeout too
        report.validation_not_run = f"the implementation hangs ({runner.health.timeouts} calls timed out)"
    elif not report.usable:
        report.validation_not_run = "no call returned a result, so a refusal of invalid input cannot be told from any other failure"
    else:
        report.validation = runner.validation()


def died_on_every_call(runner: Runner, report: CompareReport) -> bool:
    """Whether the implementation's process died on each call of the run (and it had some)."""
    return bool(report.examples) and runner.health.crashes >= report.examples


def supplied_fields(runner: Runner) -> frozenset[str] | None:
    """The result fields the port itself computes (None: every field it returns)."""
    adapter = runner.describe().adapter
    return frozenset(adapter.supplies) if adapter is not None else None


def diagnose_failures(runner: Runner, report: CompareReport, evidence: Evidence, supplied: frozenset[str] | None) -> None:
    if not report.usable:
        report.diagnosis = Diagnosis.not_run()
        return
    # A padding failure alone is diagnosed on its probes (what read the padding), which the
    # observations carry; other behavioural failures need no observation.
    padding = "padding_immunity" in report.failing_checks
    observations = evidence.failing + evidence.passing if evidence.failing or padding else []
    report.diagnosis = diagnose(
        Examples(
            tuple(observations),
            tuple(report.failing_checks),
            held_out=tuple(evidence.more_failing + evidence.more_passing) if evidence.failing else (),
            call_failure_taus=tuple(evidence.call_failure_taus),
        ),
        Reading(report.dtype, report.compute_dtype, supplied, keep_inferred(runner)),
        divergent=bool(report.failing_checks),
        runner=RunnerFacts(
            {c: names for c, names in evidence.step_by_check.items() if names},
            dict(runner.variant_descriptions or {}),
            runner.variant_source,
            runner.replay_command,
            leak_probe(runner) if padding else None,
        ),
        findings=evidence.findings(),
        prefer=frozenset(a.deviation for a in report.accepted),
    )


def leak_probe(runner: Runner) -> Callable[[Batch], bool | None] | None:
    """Whether the runner's port, on a batch padded in one input only, makes a NaN/inf result
    under that padding (the battery's probe of the drawn padding); None for a runner whose
    examples are not batches."""
    if runner.example_key() != "batch":
        return None

    def leaks(batch: Batch) -> bool | None:
        outcome = runner.run_battery(batch)
        if outcome.measurement.result is None:
            return None  # the zero-padded call itself failed: nothing to attribute
        return any(p.fill == DRAWN_PADDING and p.non_finite() is not None for p in outcome.padding_probes)

    return leaks
