"""Run the battery over many generated examples and shrink each failing check to a minimal one.

:func:`run_compare` talks only to the :class:`~m2po_oracle.call.runner.Runner` interface: the
checks it tallies, the strategy it explores, how it replays are the runner's.
"""

from __future__ import annotations

import json
import platform
import random
import subprocess
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from hypothesis import HealthCheck, find, settings
from hypothesis.errors import NoSuchExample

from m2po_oracle import __version__
from m2po_oracle.oracle.batch import Batch
from m2po_oracle.judge.battery import DRAWN_PADDING, BatteryOutcome
from m2po_oracle.judge.checks import ALL_CHECKS, BEHAVIOURAL_CHECKS
from m2po_oracle.explain.deviations import Accepted
from m2po_oracle.judge.contract import Implementation
from m2po_oracle.judge.coverage import CoverageTally, failure_rate_upper
from m2po_oracle.explain.diagnosis import diagnose
from m2po_oracle.explain.evidence import Observation
from m2po_oracle.judge.equivalence import Mismatch
from m2po_oracle.oracle.record import COUNT_FIELDS, METRIC_FIELDS, M2POResult
from m2po_oracle.compare.record import SCHEMA, counterexample_json, tolerances_json
from m2po_oracle.call.runner import Runner, RunOptions
from m2po_oracle.judge.validation import ProbeResult


@dataclass
class CheckTally:
    name: str
    failures: int = 0
    ran: int = 0  # examples on which the check actually ran
    first_failure: Any = None
    first_failure_at: int | None = None  # 1-based number of the first failing example
    exercised: int = 0  # examples that could have failed it (m2po_oracle.judge.coverage.EXERCISED; a failing one always)

    @property
    def failure_rate_upper_95(self) -> float | None:
        """One-sided 95% Clopper-Pearson upper bound on the failure rate over the exercised examples."""
        return failure_rate_upper(self.failures, self.exercised)

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
    cause: str | None = None  # the explanation it demonstrates ("a + b"), None for an unexplained check
    checks: tuple[str, ...] = ()  # every failing check it demonstrates
    example: Any = None  # the example as generated (a batch with its drawn padding, or a trainer case)


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
    metric_sources: dict[str, str] = field(default_factory=dict)  # an adapted port's metrics: ours -> where in its return
    example_unit: str = "batches"  # what one example is: a batch, or a training step (the trainer)
    stopped_early: str | None = None  # why exploration ended before ``examples_requested``
    examples_requested: int = 0
    interrupted: bool = False
    load_error: str | None = None  # the implementation could not be loaded at all
    output: dict[str, Any] = field(default_factory=lambda: {"lines": 0, "first_lines": []})
    coverage: CoverageTally = field(default_factory=CoverageTally)  # families and features of the examples tried
    accepted: tuple[Accepted, ...] = ()  # deviations the project accepts ([tool.m2po-oracle] accept, --accept)
    strict_accept: bool = True  # an accepted deviation that no longer shows fails the run
    capture: dict[str, Any] | None = None  # --capture: {"directory", "steps"} the run recorded for `m2po-oracle audit`

    @property
    def validation_warnings(self) -> list[ProbeResult]:
        return [p for p in self.validation if p.ran and not p.as_expected]

    @property
    def usable(self) -> bool:
        """Whether any call returned a result: otherwise no check but ``call`` ran."""
        return self.load_error is None and any(t.ran for n, t in self.tallies.items() if n != "call")

    @property
    def failing_checks(self) -> list[str]:
        return [n for n, t in self.tallies.items() if t.failures]

    @property
    def accepted_shown(self) -> dict[str, list[str]]:
        """Each accepted deviation -> the failing checks it explains ([]: it did not show)."""
        by_check = self.diagnosis.get("by_check", {})
        return {a.deviation: [c for c, names in by_check.items() if any(_accepts(a.deviation, n) for n in names)] for a in self.accepted}

    @property
    def fixed_accepted(self) -> list[str]:
        return [name for name, checks in self.accepted_shown.items() if not checks]

    def _explained_by_accepted(self, failing: list[str]) -> bool:
        """Every failing check is explained, on every failing example (no residual), by accepted deviations only."""
        by_check, accepted = self.diagnosis.get("by_check", {}), [a.deviation for a in self.accepted]
        shares = self.diagnosis.get("shares", {})
        return bool(accepted) and all(by_check.get(c) and all(any(_accepts(a, n) for a in accepted) for n in by_check[c])
                                      and shares.get(c, {}).get("share", 1.0) == 1.0 for c in failing)

    @property
    def verdict(self) -> str:
        if self.interrupted:
            return "interrupted"
        if self.load_error is not None or (self.examples and not self.usable):
            return "unusable"
        failing = self.failing_checks
        if (self.strict_validation and self.validation_warnings) or (failing and not self._explained_by_accepted(failing)):
            return "divergent"
        if self.strict_accept and self.fixed_accepted:
            return "accepted-deviation-fixed"
        return "equivalent-with-accepted" if failing else "equivalent"

    @property
    def exit_status(self) -> int:
        return {"equivalent": 0, "equivalent-with-accepted": 0, "divergent": 1, "accepted-deviation-fixed": 1, "unusable": 2,
                "interrupted": 130}[self.verdict]

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
                 "first_failure_at": t.first_failure_at, "exercised": t.exercised, "failure_rate_upper_95": t.failure_rate_upper_95}
                for name, t in self.tallies.items()
            ],
            "coverage": self.coverage.to_json(self.tallies),
            "counterexamples": [
                {**counterexample_json(c.check, c.batch, c.actual, c.mismatches, c.replay, self.compute_dtype), "cause": c.cause,
                 "checks": list(c.checks or (c.check,)), **({"ranks": list(c.ranks)} if c.ranks else {}),
                 **({"trainer_case": c.case} if c.case else {})}
                for c in self.counterexamples
            ],
            "diagnosis": self.diagnosis,
            "accepted": [{**a.to_json(), "shown": bool(self.accepted_shown[a.deviation]), "checks": self.accepted_shown[a.deviation]}
                         for a in self.accepted],
            "strict_accept": self.strict_accept,
            "validation": {"strict": self.strict_validation, "not_run": self.validation_not_run, "probes": [p.to_json() for p in self.validation]},
            "implementation_output": self.output,
            **({"topology": self.topology, "collectives_per_step": self.collectives} if self.topology else {}),
            **({"adapter": self._adapter_json()} if self.adapter else {}),
            **({"capture": self.capture} if self.capture else {}),
            "tolerances": tolerances_json(),
            "environment": environment(),
        }


    def _adapter_json(self) -> dict[str, Any]:
        """The adapter as described, with what this run observed: ``metrics_read`` (each
        metric of ours the port returned, and where), and ``supplies`` narrowed to the
        metrics it returned (the family may return more than this port does)."""
        adapter = dict(self.adapter or {})
        if "supplies" in adapter:
            metrics = set(METRIC_FIELDS + COUNT_FIELDS)
            adapter["supplies"] = [f for f in adapter["supplies"] if f not in metrics or f in self.metric_sources]
        adapter["metrics_read"] = dict(sorted(self.metric_sources.items()))
        return adapter


def _accepts(accepted: str, name: str) -> bool:
    """An accepted deviation covers its name; without a value, every fitted value of it too."""
    return name == accepted or ("(" not in accepted and name.split("(", 1)[0] == accepted)


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
#: Observations kept for diagnosis: half from failing examples, half from passing ones,
#: and beyond that the first few of every failing check, so each is represented.
DIAGNOSIS_EXAMPLES = 60
OBSERVATIONS_PER_CHECK = 3
#: Failing examples beyond the search's sample kept to count each check's share.
SHARE_EXAMPLES = 2000


class _StopExploring(BaseException):  # BaseException: Hypothesis must not shrink it
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _search_settings(examples: int) -> settings:
    # derandomize off whatever the loaded profile says: the run's --seed decides the batches.
    return settings(max_examples=examples, database=None, deadline=None, derandomize=False, suppress_health_check=list(HealthCheck))


def in_process_runner(fn: Implementation, impl: str, **option_values: Any) -> Runner:
    """A runner calling the loss function ``fn`` in this process (tests, notebooks)."""
    from m2po_oracle.call.isolation import InProcess
    from m2po_oracle.call.loss_function import LossFunctionRunner

    options = RunOptions.from_values({k: v for k, v in option_values.items() if v is not None})
    return LossFunctionRunner(impl, InProcess(fn, capture=not options.show_output, rejecting=options.rejecting), options.but(in_process=True, given=options.given | {"in_process"}))


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


def select_checks(available: tuple[str, ...] | list[str], patterns: str | None) -> tuple[str, ...] | None:
    """The checks matching comma-separated glob ``patterns`` ("selection.*,loss"); a pattern
    matching none of them is a usage error naming what there is."""
    import fnmatch

    from m2po_oracle.errors import UsageError

    if not patterns:
        return None
    chosen: list[str] = []
    for pattern in (p.strip() for p in patterns.split(",") if p.strip()):
        matched = [c for c in available if fnmatch.fnmatchcase(c, pattern)]
        if not matched:
            raise UsageError(f"checks: {pattern!r} matches none of this run's checks: {', '.join(available)}")
        chosen += [c for c in matched if c not in chosen]
    # "call" always runs: nothing else can run without a result.
    return tuple(c for c in available if c in chosen or c == "call")


def run_compare(target: Runner | Implementation, impl: str | None = None, *, shrink: bool = True,
                on_example: Callable[[BatteryOutcome], None] | None = None, until_first_failure: bool = False,
                exploration: Exploration | None = None, started: float | None = None, **option_values: Any) -> CompareReport:
    """Try the runner's examples; for each failing check, shrink a minimal one.

    ``target`` is a :class:`Runner` (from ``launch.open_runner``) or a plain loss-function
    callable, called in this process. ``option_values`` (examples, seed, dtype, ...) override
    the runner's options. With ``shrink=False`` each counterexample is the first failing
    example, as generated. ``exploration`` adds -x, --checks, --skip-validation, the example
    database and the accepted deviations; ``started`` (a ``time.perf_counter()``) makes the
    reported duration cover the caller's start-up too. Ctrl-C ends the run with a partial
    report (verdict "interrupted")."""
    exploration = exploration or Exploration(shrink=shrink, max_failures=1 if until_first_failure else None)
    if isinstance(target, Runner):
        runner = target
        if option_values:
            runner.options = runner.options.but(**option_values)
    else:
        runner = in_process_runner(target, impl or getattr(target, "__name__", "implementation"), **option_values)
    options = runner.options
    started = time.perf_counter() if started is None else started
    selected = exploration.checks or tuple(runner.checks)
    report = CompareReport(runner.spec, options.dtype, options.effective_compute_dtype, options.seed, 0, {n: CheckTally(n) for n in selected},
                           tau=options.tau, device=options.device, strict_validation=options.strict_validation, example_unit=runner.example_unit,
                           examples_requested=options.examples, accepted=exploration.accept, strict_accept=exploration.strict_accept, **_describe(runner))
    try:
        _explore_and_judge(runner, report, exploration, on_example, until_first_failure)
    except KeyboardInterrupt:
        report.interrupted = True
        report.validation_not_run = report.validation_not_run or "the run was interrupted"
        report.diagnosis = report.diagnosis or {"status": "not_run", "examples_compared": 0, "matches": [], "closest": []}
    report.output = runner.output.to_json()
    if options.capture:  # after every step the run took: exploration, shrinking, the counterexamples' replays
        report.capture = runner.describe().get("capture")
    report.duration_s = time.perf_counter() - started
    return report


def _describe(runner: Runner) -> dict[str, Any]:
    described = runner.describe()
    return {"topology": described.get("topology"), "adapter": described.get("adapter")}


@dataclass
class _Evidence:
    """What exploration keeps for the diagnosis."""

    failing: list[Observation] = field(default_factory=list)
    passing: list[Observation] = field(default_factory=list)
    more_failing: list[Observation] = field(default_factory=list)  # beyond the search's sample: counted in the shares
    more_passing: list[Observation] = field(default_factory=list)  # likewise: where a name's contradictions are counted
    call_failure_taus: list[float] = field(default_factory=list)  # the budget of each call that raised or returned no result
    per_check: dict[str, int] = field(default_factory=dict)
    step_by_check: dict[str, set[str]] = field(default_factory=dict)  # check -> step variants reproducing each of its failing steps
    non_finite: int = 0  # examples whose loss or gradient is not finite on valid, finite inputs
    non_finite_checks: set[str] = field(default_factory=set)

    def keep(self, outcome: BatteryOutcome, example: Any = None) -> None:
        result = outcome.measurement.result
        if result is None:
            if "call" in outcome.failed_checks and isinstance(outcome.batch, Batch):
                self.call_failure_taus.append(float(outcome.batch.tau))
            return
        value_failures = frozenset(n for n in outcome.failed_checks if n not in BEHAVIOURAL_CHECKS)
        observation = Observation(outcome.batch, result, frozenset(outcome.failed_checks), outcome.padding_probes, example)
        # A behavioural failure (a padding probe) needs observations too: the diagnosis
        # replays the probes to tell a deviation that reads padding from a leak.
        underrepresented = any(self.per_check.get(n, 0) < OBSERVATIONS_PER_CHECK for n in outcome.failed_checks)
        bucket = self.failing if value_failures else self.passing
        if len(bucket) < DIAGNOSIS_EXAMPLES // 2 or underrepresented:
            bucket.append(observation)
            for n in outcome.failed_checks:
                self.per_check[n] = self.per_check.get(n, 0) + 1
        elif value_failures and len(self.more_failing) < SHARE_EXAMPLES:
            self.more_failing.append(observation)
        elif not value_failures and len(self.more_passing) < SHARE_EXAMPLES:
            self.more_passing.append(observation)
        if not _finite_on_valid(outcome.batch, result):
            self.non_finite += 1
            self.non_finite_checks.update(n for n in outcome.failed_checks if n in ("loss", "gradient"))

    def keep_step(self, outcome: BatteryOutcome) -> None:
        found = set(outcome.explained_by or ()) & set(outcome.explained_by if outcome.evidenced is None else outcome.evidenced)
        for check in outcome.failed_checks:
            self.step_by_check[check] = found if check not in self.step_by_check else self.step_by_check[check] & found

    def findings(self) -> list[dict[str, Any]]:
        if not self.non_finite:
            return []
        return [{"kind": "non_finite_result", "checks": sorted(self.non_finite_checks),
                 "summary": f"the loss or gradient is NaN or infinite on {self.non_finite} example(s) whose inputs are finite on every valid "
                            "token: a finding of its own (not a padding leak: padding is probed apart)"}]


def _finite_on_valid(batch: Batch, result: M2POResult) -> bool:
    """False where the port's loss or gradient is NaN/inf although Algorithm 1's, on the
    port's own mask, is finite (an overflow of exp(d) is not the port's fault)."""
    grad_finite = result.grad is None or bool(np.all(np.isfinite(result.grad[batch.valid])))
    if np.isfinite(result.loss) and grad_finite:
        return True
    from m2po_oracle import oracle

    expected = oracle.evaluate_with_mask(batch, result.keep)
    if not np.isfinite(result.loss) and np.isfinite(expected.loss):
        return False
    return grad_finite or not bool(np.all(np.isfinite(expected.grad[batch.valid])))


def _battery(runner: Runner, example: Any, checks: tuple[str, ...] | None) -> BatteryOutcome:
    """The runner's battery on one example, reduced to the selected checks (--checks)."""
    outcome = runner.run_battery(example)
    if checks is None:
        return outcome
    return replace(outcome, mismatches=tuple(m for m in outcome.mismatches if m.check in checks), checked=tuple(c for c in outcome.checked if c in checks))


def _explore_and_judge(runner: Runner, report: CompareReport, exploration: Exploration, on_example: Callable[[BatteryOutcome], None] | None,
                       until_first_failure: bool = False) -> None:
    options = runner.options
    strategy = runner.strategy()
    tallies = report.tallies
    evidence = _Evidence()
    checks = exploration.checks
    failing_examples = 0
    database = _ExampleDatabase(exploration.database, runner) if exploration.database else None

    def explore(example: Any) -> bool:
        nonlocal failing_examples
        report.examples += 1
        outcome = _battery(runner, example, checks)
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
            raise _StopExploring(f"first failure at example {report.examples} (measuring how soon it is caught)")
        if exploration.max_failures and failing_examples >= exploration.max_failures:
            raise _StopExploring(f"stopped after {failing_examples} failing example(s) (--max-failures {exploration.max_failures})")
        health = runner.health
        if health.timeouts >= MAX_TIMEOUTS:
            raise _StopExploring(f"{health.timeouts} calls timed out (--timeout {options.timeout:g} s): every further call would likely wait it out too")
        if report.examples >= MAX_DEAD_CALLS and health.crashes >= report.examples:
            raise _StopExploring(f"the implementation's process died on each of the first {health.crashes} calls")
        return False

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            for saved in database.saved() if database else ():  # last run's failing examples first, as Hypothesis does
                explore(saved)
            remaining = options.examples - report.examples
            if remaining > 0:
                find(strategy, explore, settings=_search_settings(remaining), random=random.Random(options.seed))
        except NoSuchExample:
            pass
        except _StopExploring as stop:
            report.stopped_early = stop.reason

    hung = runner.health.timeouts >= MAX_TIMEOUTS
    supplied = _supplied(runner)
    _diagnose(runner, report, evidence, supplied)
    report.counterexamples = _counterexamples(runner, report, strategy, exploration.shrink and not runner.health.timeouts, supplied, checks)
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


class _ExampleDatabase:
    """Failing examples kept between runs in a Hypothesis example database folder, under a
    key of the implementation and the options that shape a call."""

    def __init__(self, folder: str, runner: Runner) -> None:
        import hashlib

        from hypothesis.database import DirectoryBasedExampleDatabase

        self.db = DirectoryBasedExampleDatabase(folder)
        self.runner = runner
        o = runner.options
        shape = [runner.spec, o.dtype, o.compute_dtype, o.adapter, list(o.bind), str(o.topology), o.tau, runner.example_key()]
        self.key = b"m2po-oracle:" + hashlib.sha256(json.dumps(shape, default=str).encode()).hexdigest().encode()

    def saved(self) -> list[Any]:
        found = []
        for value in sorted(self.db.fetch(self.key)):
            try:
                found.append(self.runner.parse_example(json.loads(value)))
            except (ValueError, KeyError, TypeError):  # written by another version: forget it
                self.db.delete(self.key, value)
        return found

    def save(self, examples: Any) -> None:
        for example in examples:
            if example is None:
                continue
            text = example.to_json() if isinstance(example, Batch) else json.dumps(example.to_dict())
            self.db.save(self.key, text.encode())


def _supplied(runner: Runner) -> frozenset[str] | None:
    """The result fields the port itself computes (None: every field it returns)."""
    adapter = runner.describe().get("adapter") or {}
    return frozenset(adapter["supplies"]) if "supplies" in adapter else None


def _diagnose(runner: Runner, report: CompareReport, evidence: _Evidence, supplied: frozenset[str] | None) -> None:
    if not report.usable:
        report.diagnosis = {"status": "not_run", "examples_compared": 0, "matches": [], "closest": []}
        return
    # A padding failure alone is diagnosed on its probes (what read the padding), which the
    # observations carry; other behavioural failures need no observation.
    padding = "padding_immunity" in report.failing_checks
    observations = evidence.failing + evidence.passing if evidence.failing or padding else []
    report.diagnosis = diagnose(observations, report.failing_checks, dtype=report.dtype, divergent=bool(report.failing_checks),
                                compute_dtype=report.compute_dtype, supplied=supplied, prefer=frozenset(a.deviation for a in report.accepted),
                                step_explanations={c: names for c, names in evidence.step_by_check.items() if names},
                                step_descriptions=runner.variant_descriptions, step_source=runner.variant_source, findings=evidence.findings(),
                                beyond_sample=(evidence.more_failing + evidence.more_passing) if evidence.failing else (),
                                replay=runner.replay_command,
                                call_failure_taus=evidence.call_failure_taus, leaks_alone=_leak_probe(runner) if padding else None)


def _leak_probe(runner: Runner) -> Callable[[Batch], bool | None] | None:
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


def _causes(report: CompareReport, value_variants: set[str]) -> list[tuple[str | None, tuple[str, ...], tuple[str, ...]]]:
    """(cause, its deviations to reproduce alone or (), the failing checks it shows), one per distinct cause."""
    by_check = report.diagnosis.get("by_check", {})
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


def _counterexamples(runner: Runner, report: CompareReport, strategy: Any, shrink: bool, supplied: frozenset[str] | None,
                     checks_run: tuple[str, ...] | None = None) -> list[Counterexample]:
    """One counterexample per distinct cause: each explained group of checks is shrunk on
    examples where its deviations alone reproduce the port (when any does), every other
    failing check on its own."""
    from m2po_oracle.explain.deviations import VARIANTS

    value_variants = {v.name for v in VARIANTS if not v.is_behavioural} | {n for names in report.diagnosis.get("by_check", {}).values()
                                                                          for n in names if "(" in n}  # fitted values of known ones
    found: list[Counterexample] = []
    # A step runner's example costs a model or a world: a minimal input already found for one
    # check also serves every other check it fails, instead of a new search per check.
    shrunk_outcomes: list[tuple[Any, BatteryOutcome]] = []
    for cause, alone, checks in _causes(report, value_variants):
        tallies = [report.tallies[c] for c in checks]
        first = min(tallies, key=lambda t: t.first_failure_at or 0)
        if not shrink:  # shrinking a hanging implementation would wait out the timeout on every try
            outcome = _battery(runner, first.first_failure, checks_run)
            found.append(_counterexample(runner, first.name, first.first_failure, outcome, cause, checks))
            continue
        prior = next(((e, o) for e, o in shrunk_outcomes if set(checks) & set(o.failed_checks)), None) if runner.costly_examples else None
        if prior is not None:
            found.append(_counterexample(runner, first.name, *prior, cause, checks))
            continue
        shows = _shows_alone(report, alone, checks, supplied) if alone else None
        example, outcome = _shrink(runner, set(checks), first.first_failure, strategy, shows, checks_run)
        shrunk_outcomes.append((example, outcome))
        check = next((c for c in checks if c in outcome.failed_checks), first.name)
        found.append(_counterexample(runner, check, example, outcome, cause, checks))
    return found


def _shows_alone(report: CompareReport, names: tuple[str, ...], checks: tuple[str, ...], supplied: frozenset[str] | None) -> Callable[[BatteryOutcome], bool]:
    """Whether an outcome fails one of ``checks`` and these deviations alone reproduce it."""
    from m2po_oracle.explain.evidence import Judge, merge

    dev = merge(names)

    def shows(outcome: BatteryOutcome) -> bool:
        result = outcome.measurement.result
        if result is None or dev is None or not set(checks) & set(outcome.failed_checks):
            return False
        judge = Judge([Observation(outcome.batch, result)], dtype=report.dtype, compute_dtype=report.compute_dtype, supplied=supplied)
        return not judge.differences(dev, 0)
    return shows


def _counterexample(runner: Runner, check: str, example: Any, outcome: BatteryOutcome, cause: str | None = None,
                    checks: tuple[str, ...] = ()) -> Counterexample:
    shown = set(checks or (check,))
    mismatches = tuple(m for m in outcome.mismatches if m.check in shown) or outcome.mismatches
    return Counterexample(check, outcome.batch, mismatches, runner.replay_command(example), outcome.measurement.result, outcome.ranks, outcome.case,
                          cause, tuple(c for c in (checks or (check,)) if c in outcome.failed_checks) or (check,), example)


def _shrink(runner: Runner, checks: set[str], fallback: Any, strategy: Any,
            shows: Callable[[BatteryOutcome], bool] | None = None, checks_run: tuple[str, ...] | None = None) -> tuple[Any, BatteryOutcome]:
    """Replay the same search with "one of these checks fails" (and, given ``shows``, "the
    cause shows alone") as the goal; Hypothesis shrinks it."""

    def search(goal: Callable[[BatteryOutcome], bool]) -> Any:
        options = runner.options
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return find(strategy, lambda example: goal(_battery(runner, example, checks_run)), settings=_search_settings(options.examples),
                        random=random.Random(options.seed))

    example = fallback
    for goal in ([shows] if shows is not None else []) + [lambda outcome: bool(checks & set(outcome.failed_checks))]:
        try:
            example = search(goal)
            break
        except (NoSuchExample, Exception):  # no example shows it alone, or a flaky check did not fail again
            continue
    return example, _battery(runner, example, checks_run)


def load_error_report(spec: str, error: str, options: RunOptions) -> CompareReport:
    """The report of a run whose implementation could not be loaded (verdict unusable)."""
    report = CompareReport(spec, options.dtype, options.effective_compute_dtype, options.seed, 0, {}, tau=options.tau, device=options.device,
                           strict_validation=options.strict_validation, examples_requested=options.examples, load_error=error,
                           validation_not_run="the implementation could not be loaded")
    report.diagnosis = {"status": "not_run", "examples_compared": 0, "matches": [], "closest": []}
    return report
