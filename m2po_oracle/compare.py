"""Run the battery over many generated examples and shrink each failing check to a minimal one.

:func:`run_compare` talks only to the :class:`~m2po_oracle.runner.Runner` interface: the
checks it tallies, the strategy it explores, how it replays are the runner's.
"""

from __future__ import annotations

import platform
import random
import subprocess
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hypothesis import HealthCheck, find, settings
from hypothesis.errors import NoSuchExample

from m2po_oracle import __version__
from m2po_oracle.batch import Batch
from m2po_oracle.battery import BatteryOutcome
from m2po_oracle.checks import ALL_CHECKS, BEHAVIOURAL_CHECKS
from m2po_oracle.contract import Implementation
from m2po_oracle.diagnosis import Observation, diagnose
from m2po_oracle.equivalence import Mismatch
from m2po_oracle.record import M2POResult
from m2po_oracle.report.json_record import SCHEMA, counterexample_json, tolerances_json
from m2po_oracle.runner import Runner, RunOptions
from m2po_oracle.validation import ProbeResult


@dataclass
class CheckTally:
    name: str
    failures: int = 0
    ran: int = 0  # examples on which the check actually ran
    first_failure: Any = None
    first_failure_at: int | None = None  # 1-based number of the first failing example

    @property
    def status(self) -> str:
        """fail, pass, or "not run": a check that never ran claims nothing."""
        if self.failures:
            return "fail"
        return "pass" if self.ran else "not run"


@dataclass
class Counterexample:
    check: str
    batch: Batch  # as the implementation received it
    mismatches: tuple[Mismatch, ...]
    replay: str
    actual: M2POResult | None = None
    ranks: tuple[dict, ...] = ()
    case: dict | None = None  # a trainer case: the step's input (the batch is what the trainer produced)


@dataclass
class CompareReport:
    impl: str
    dtype: str
    compute_dtype: str
    seed: int
    examples: int
    tallies: dict[str, CheckTally]
    counterexamples: list[Counterexample] = field(default_factory=list)
    duration_s: float = 0.0
    tau: float | None = None
    device: str = "cpu"
    diagnosis: dict[str, Any] = field(default_factory=dict)
    validation: list[ProbeResult] = field(default_factory=list)
    validation_not_run: str | None = None  # why the probes were skipped
    strict_validation: bool = False
    topology: dict[str, Any] | None = None  # dp, cp, tp, backend of a distributed run
    adapter: dict[str, Any] | None = None  # name, signature and the fields the port supplies
    collectives: list[dict[str, Any]] = field(default_factory=list)  # per rank, for one step
    example_unit: str = "batches"  # what one example is: a batch, or a training step (the trainer)
    stopped_early: str | None = None  # why exploration ended before ``examples_requested``
    examples_requested: int = 0
    interrupted: bool = False
    load_error: str | None = None  # the implementation could not be loaded at all
    output: dict[str, Any] = field(default_factory=lambda: {"lines": 0, "first_lines": []})

    @property
    def validation_warnings(self) -> list[ProbeResult]:
        return [p for p in self.validation if not p.as_expected]

    @property
    def usable(self) -> bool:
        """Whether any call returned a result: otherwise no check but ``call`` ran."""
        return self.load_error is None and any(t.ran for n, t in self.tallies.items() if n != "call")

    @property
    def verdict(self) -> str:
        if self.interrupted:
            return "interrupted"
        if self.load_error is not None or (self.examples and not self.usable):
            return "unusable"
        if any(t.failures for t in self.tallies.values()) or (self.strict_validation and self.validation_warnings):
            return "divergent"
        return "equivalent"

    @property
    def exit_status(self) -> int:
        return {"equivalent": 0, "divergent": 1, "unusable": 2, "interrupted": 130}[self.verdict]

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "verdict": self.verdict,
            "implementation": self.impl,
            "options": {"examples": self.examples_requested or self.examples, "seed": self.seed, "dtype": self.dtype, "compute_dtype": self.compute_dtype,
                        "tau": self.tau, "device": self.device, "strict_validation": self.strict_validation},
            "examples": self.examples,
            "example_unit": self.example_unit,
            "duration_s": round(self.duration_s, 3),
            "stopped_early": self.stopped_early,
            "load_error": self.load_error,
            "checks": [
                {"name": name, "description": ALL_CHECKS[name], "status": t.status, "failures": t.failures, "ran": t.ran,
                 "first_failure_at": t.first_failure_at}
                for name, t in self.tallies.items()
            ],
            "counterexamples": [
                {**counterexample_json(c.check, c.batch, c.actual, c.mismatches, c.replay, self.compute_dtype), **({"ranks": list(c.ranks)} if c.ranks else {}),
                 **({"trainer_case": c.case} if c.case else {})}
                for c in self.counterexamples
            ],
            "diagnosis": self.diagnosis,
            "validation": {"strict": self.strict_validation, "not_run": self.validation_not_run, "probes": [p.to_json() for p in self.validation]},
            "implementation_output": self.output,
            **({"topology": self.topology, "collectives_per_step": self.collectives} if self.topology else {}),
            **({"adapter": self.adapter} if self.adapter else {}),
            "tolerances": tolerances_json(),
            "environment": environment(),
        }


def environment() -> dict[str, Any]:
    import hypothesis
    import torch

    try:
        revision = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        revision = None
    return {"m2po_oracle": __version__, "python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
            "hypothesis": hypothesis.__version__, "platform": platform.platform(), "git_revision": revision}


#: Exploration stops after this many timed-out calls.
MAX_TIMEOUTS = 2
#: ... and when the implementation's process died on each of this many first calls.
MAX_DEAD_CALLS = 5
#: Observations kept for diagnosis: half from failing examples, half from passing ones.
DIAGNOSIS_EXAMPLES = 60


class _StopExploring(BaseException):  # BaseException: Hypothesis must not shrink it
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _search_settings(examples: int) -> settings:
    # derandomize off whatever the loaded profile says: the run's --seed decides the batches.
    return settings(max_examples=examples, database=None, deadline=None, derandomize=False, suppress_health_check=list(HealthCheck))


def in_process_runner(fn: Implementation, impl: str, **option_values: Any) -> Runner:
    """A runner calling the loss function ``fn`` in this process (tests, notebooks)."""
    from m2po_oracle.isolation import InProcess
    from m2po_oracle.loss_function import LossFunctionRunner

    options = RunOptions.from_values({k: v for k, v in option_values.items() if v is not None})
    return LossFunctionRunner(impl, InProcess(fn, capture=not options.show_output, rejecting=options.rejecting), options.but(in_process=True, given=options.given | {"in_process"}))


def run_compare(target: Runner | Implementation, impl: str | None = None, *, shrink: bool = True,
                on_example: Callable[[BatteryOutcome], None] | None = None, until_first_failure: bool = False, **option_values: Any) -> CompareReport:
    """Try the runner's examples; for each failing check, shrink a minimal one.

    ``target`` is a :class:`Runner` (from ``launch.open_runner``) or a plain loss-function
    callable, called in this process. ``option_values`` (examples, seed, dtype, ...) override
    the runner's options. With ``shrink=False`` each counterexample is the first failing
    example, as generated. Ctrl-C ends the run with a partial report (verdict "interrupted")."""
    if isinstance(target, Runner):
        runner = target
        if option_values:
            runner.options = runner.options.but(**option_values)
    else:
        runner = in_process_runner(target, impl or getattr(target, "__name__", "implementation"), **option_values)
    options = runner.options
    started = time.perf_counter()
    report = CompareReport(runner.spec, options.dtype, options.effective_compute_dtype, options.seed, 0, {n: CheckTally(n) for n in runner.checks},
                           tau=options.tau, device=options.device, strict_validation=options.strict_validation, example_unit=runner.example_unit,
                           examples_requested=options.examples, **_describe(runner))
    try:
        _explore_and_judge(runner, report, shrink, on_example, until_first_failure)
    except KeyboardInterrupt:
        report.interrupted = True
        report.validation_not_run = report.validation_not_run or "the run was interrupted"
        report.diagnosis = report.diagnosis or {"status": "not_run", "examples_compared": 0, "matches": [], "closest": []}
    report.output = runner.output.to_json()
    report.duration_s = time.perf_counter() - started
    return report


def _describe(runner: Runner) -> dict[str, Any]:
    described = runner.describe()
    return {"topology": described.get("topology"), "adapter": described.get("adapter")}


def _explore_and_judge(runner: Runner, report: CompareReport, shrink: bool, on_example: Callable[[BatteryOutcome], None] | None,
                       until_first_failure: bool = False) -> None:
    options = runner.options
    strategy = runner.strategy()
    tallies = report.tallies
    failing_observations: list[Observation] = []
    passing_observations: list[Observation] = []
    step_matches: set[str] | None = None  # step-level variants reproducing every failing step so far
    failing_steps = 0
    evidenced: set[str] = set()  # variants that differ from Algorithm 1 on some failing step they reproduce

    def explore(example: Any) -> bool:
        nonlocal step_matches, failing_steps
        report.examples += 1
        outcome = runner.run_battery(example)
        for name in outcome.checked:
            if name in tallies:
                tallies[name].ran += 1
        for name in outcome.failed_checks:
            tally = tallies[name]
            tally.failures += 1
            if tally.first_failure is None:
                tally.first_failure, tally.first_failure_at = example, report.examples
        result = outcome.measurement.result
        if result is not None:
            values_diverge = any(name not in BEHAVIOURAL_CHECKS for name in outcome.failed_checks)
            kept = failing_observations if values_diverge else passing_observations
            if len(kept) < DIAGNOSIS_EXAMPLES // 2:
                kept.append(Observation(outcome.batch, result))
        if outcome.explained_by is not None:
            failing_steps += 1
            found = set(outcome.explained_by)
            step_matches = found if step_matches is None else step_matches & found
            evidenced.update(found if outcome.evidenced is None else outcome.evidenced)
        if outcome.ranks and not report.collectives:
            report.collectives.extend({"rank": r["rank"], "coords": r["coords"], "collectives": r["collectives"]} for r in outcome.ranks)
        if on_example is not None:
            on_example(outcome)
        if until_first_failure and outcome.failed_checks:
            raise _StopExploring(f"first failure at example {report.examples} (measuring how soon it is caught)")
        health = runner.health
        if health.timeouts >= MAX_TIMEOUTS:
            raise _StopExploring(f"{health.timeouts} calls timed out (--timeout {options.timeout:g} s): every further call would likely wait it out too")
        if report.examples >= MAX_DEAD_CALLS and health.crashes >= report.examples:
            raise _StopExploring(f"the implementation's process died on each of the first {health.crashes} calls")
        return False

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            find(strategy, explore, settings=_search_settings(options.examples), random=random.Random(options.seed))
        except NoSuchExample:
            pass
        except _StopExploring as stop:
            report.stopped_early = stop.reason

    hung = runner.health.timeouts >= MAX_TIMEOUTS
    report.counterexamples = _counterexamples(runner, report, strategy, shrink and not runner.health.timeouts)
    if hung:  # each probe would wait out the timeout too
        report.validation_not_run = f"the implementation hangs ({runner.health.timeouts} calls timed out)"
    elif not report.usable:
        report.validation_not_run = "no call returned a result, so a refusal of invalid input cannot be told from any other failure"
    else:
        report.validation = runner.validation()
    _diagnose(runner, report, failing_observations, passing_observations, step_matches, evidenced, failing_steps)


def _counterexamples(runner: Runner, report: CompareReport, strategy: Any, shrink: bool) -> list[Counterexample]:
    found: list[Counterexample] = []
    # A step runner's example costs a model or a world: a minimal input already found for one
    # check also serves every other check it fails, instead of a new search per check.
    shrunk_outcomes: list[tuple[Any, BatteryOutcome]] = []
    for name, tally in report.tallies.items():
        if tally.first_failure is None:
            continue
        if not shrink:  # shrinking a hanging implementation would wait out the timeout on every try
            found.append(_counterexample(runner, name, tally.first_failure, runner.run_battery(tally.first_failure)))
            continue
        prior = next(((example, outcome) for example, outcome in shrunk_outcomes if name in outcome.failed_checks), None) if runner.costly_examples else None
        if prior is not None:
            found.append(_counterexample(runner, name, *prior))
            continue
        example, outcome = _shrink(runner, name, tally.first_failure, strategy)
        shrunk_outcomes.append((example, outcome))
        found.append(_counterexample(runner, name, example, outcome))
    return found


def _diagnose(runner: Runner, report: CompareReport, failing: list[Observation], passing: list[Observation], step_matches: set[str] | None,
              evidenced: set[str], failing_steps: int) -> None:
    if not report.usable:
        report.diagnosis = {"status": "not_run", "examples_compared": 0, "matches": [], "closest": []}
        return
    shrunk = [Observation(c.batch, c.actual) for c in report.counterexamples if c.actual is not None and c.check not in BEHAVIOURAL_CHECKS]
    divergent_values = shrunk + failing
    report.diagnosis = diagnose(divergent_values + passing if divergent_values else [], [n for n, t in report.tallies.items() if t.failures],
                                dtype=report.dtype, divergent=report.verdict == "divergent")
    # A variant that coincides with Algorithm 1 on every failing step reproduces them trivially.
    step_matches = (step_matches or set()) & evidenced
    if step_matches:
        # A step-level variant may share its name with a single-process one (the same
        # deviation seen from the whole step): it is named once, with the step's evidence.
        others = [m for m in report.diagnosis["matches"] if m["variant"] not in step_matches]
        report.diagnosis["matches"] = [
            {"variant": name, "description": runner.variant_descriptions[name], "source": runner.variant_source,
             "evidence": f"reproduces all {failing_steps} failing steps"} for name in sorted(step_matches)] + others
        report.diagnosis["status"] = "matched"


def _counterexample(runner: Runner, check: str, example: Any, outcome: BatteryOutcome) -> Counterexample:
    mismatches = tuple(m for m in outcome.mismatches if m.check == check) or outcome.mismatches
    return Counterexample(check, outcome.batch, mismatches, runner.replay_command(example), outcome.measurement.result, outcome.ranks, outcome.case)


def _shrink(runner: Runner, check: str, fallback: Any, strategy: Any) -> tuple[Any, BatteryOutcome]:
    """Replay the same search with "this check fails" as the goal; Hypothesis shrinks it."""

    def fails(example: Any) -> bool:
        return check in runner.run_battery(example).failed_checks

    options = runner.options
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            example = find(strategy, fails, settings=_search_settings(options.examples), random=random.Random(options.seed))
        except (NoSuchExample, Exception):  # a flaky check may not fail again: keep the first failing example
            example = fallback
    return example, runner.run_battery(example)


def load_error_report(spec: str, error: str, options: RunOptions) -> CompareReport:
    """The report of a run whose implementation could not be loaded (verdict unusable)."""
    report = CompareReport(spec, options.dtype, options.effective_compute_dtype, options.seed, 0, {}, tau=options.tau, device=options.device,
                           strict_validation=options.strict_validation, examples_requested=options.examples, load_error=error,
                           validation_not_run="the implementation could not be loaded")
    report.diagnosis = {"status": "not_run", "examples_compared": 0, "matches": [], "closest": []}
    return report
