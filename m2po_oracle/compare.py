"""Run the battery over many generated batches and shrink each failing check to a minimal batch."""

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
from hypothesis import strategies as st
from hypothesis.errors import NoSuchExample

from m2po_oracle import __version__, strategies
from m2po_oracle.batch import Batch
from m2po_oracle.battery import CHECKS, BatteryOutcome, replay_command, run_battery
from m2po_oracle.contract import Implementation, as_runner
from m2po_oracle.diagnosis import Observation, diagnose
from m2po_oracle.equivalence import Mismatch
from m2po_oracle.options import check_device
from m2po_oracle.record import M2POResult
from m2po_oracle.report import SCHEMA, counterexample_json, tolerances_json
from m2po_oracle.trainer_checks_names import TRAINER_CHECKS
from m2po_oracle.validation import PROBES, ProbeResult



@dataclass
class CheckTally:
    name: str
    failures: int = 0
    first_failure: Batch | None = None
    first_failure_at: int | None = None  # 1-based number of the first failing example


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
    strict_validation: bool = False
    topology: dict[str, Any] | None = None  # dp, cp, tp, backend of a distributed run
    adapter: dict[str, Any] | None = None  # name, signature and the fields the port supplies
    collectives: list[dict[str, Any]] = field(default_factory=list)  # per rank, for one step
    example_unit: str = "batches"  # what one example is: a batch, or a training step (the trainer)

    @property
    def validation_warnings(self) -> list[ProbeResult]:
        return [p for p in self.validation if not p.as_expected]

    @property
    def verdict(self) -> str:
        if self.examples and self.tallies["call"].failures == self.examples:
            return "unusable"
        if any(t.failures for t in self.tallies.values()) or (self.strict_validation and self.validation_warnings):
            return "divergent"
        return "equivalent"

    @property
    def exit_status(self) -> int:
        return {"equivalent": 0, "divergent": 1, "unusable": 2}[self.verdict]

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "verdict": self.verdict,
            "implementation": self.impl,
            "options": {"examples": self.examples, "seed": self.seed, "dtype": self.dtype, "compute_dtype": self.compute_dtype, "tau": self.tau,
                        "device": self.device, "strict_validation": self.strict_validation},
            "examples": self.examples,
            "example_unit": self.example_unit,
            "duration_s": round(self.duration_s, 3),
            "checks": [
                {"name": name, "description": CHECKS[name], "status": "fail" if t.failures else "pass", "failures": t.failures,
                 "first_failure_at": t.first_failure_at}
                for name, t in self.tallies.items()
            ],
            "counterexamples": [
                {**counterexample_json(c.check, c.batch, c.actual, c.mismatches, c.replay, self.compute_dtype), **({"ranks": list(c.ranks)} if c.ranks else {}),
                 **({"trainer_case": c.case} if c.case else {})}
                for c in self.counterexamples
            ],
            "diagnosis": self.diagnosis,
            "validation": {"strict": self.strict_validation, "probes": [p.to_json() for p in self.validation]},
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


class _StopExploring(BaseException):  # BaseException: Hypothesis must not shrink it
    pass


#: Checks about behaviour rather than the values computed; they do not make an
#: observation evidence for an output variant. A trainer's own checks are about the step
#: around the loss (which model, how accumulated); trainer variants explain those.
BEHAVIOURAL_CHECKS = frozenset({"call", "padding_immunity", "determinism", "inputs_not_mutated"}) | frozenset(TRAINER_CHECKS)
#: Observations kept for diagnosis: half from failing examples, half from passing ones.
DIAGNOSIS_EXAMPLES = 60


def _strategy(tau: float | None) -> st.SearchStrategy[Batch]:
    base = strategies.batches()
    if tau is None:
        return base
    return base.map(lambda b: Batch(b.logp, b.behavior_logp, b.advantages, b.valid, tau))


def _search_settings(examples: int) -> settings:
    return settings(max_examples=examples, database=None, deadline=None, suppress_health_check=list(HealthCheck))


def run_compare(
    fn: Implementation,
    impl: str,
    *,
    examples: int = 500,
    seed: int = 0,
    dtype: str = "float64",
    compute_dtype: str | None = None,
    tau: float | None = None,
    device: str = "cpu",
    strict_validation: bool = False,
    shrink: bool = True,
    on_example: Callable[[BatteryOutcome], None] | None = None,
) -> CompareReport:
    """Try ``examples`` generated batches; for each failing check, shrink a minimal batch.

    ``fn`` is an implementation callable or a runner (``isolation.Isolated``). With
    ``shrink=False`` each counterexample is the first failing batch, as generated."""
    compute_dtype = compute_dtype or dtype
    check_device(device)
    if dtype not in getattr(fn, "dtypes", (dtype,)):
        raise ValueError(f"dtype: {impl!r} runs in one of {list(fn.dtypes)}, got {dtype!r}")
    started = time.perf_counter()
    # A step runner (distributed world, trainer) says which checks it runs and what it explores.
    tallies = {name: CheckTally(name) for name in getattr(fn, "checks", CHECKS)}
    strategy = fn.strategy(tau) if hasattr(fn, "strategy") else _strategy(tau)
    tried = 0
    failing_observations: list[Observation] = []
    collectives: list[dict[str, Any]] = []
    step_matches: set[str] | None = None  # variants reproducing every failing step so far
    failing_steps = 0
    evidenced: set[str] = set()  # variants that differ from Algorithm 1 on some failing step they reproduce
    passing_observations: list[Observation] = []

    def explore(batch: Batch) -> bool:
        nonlocal tried
        tried += 1
        outcome = run_battery(fn, batch, dtype=dtype, compute_dtype=compute_dtype, device=device)
        for name in outcome.failed_checks:
            tally = tallies[name]
            tally.failures += 1
            if tally.first_failure is None:
                tally.first_failure, tally.first_failure_at = batch, tried
        result = outcome.measurement.result
        if result is not None:
            values_diverge = any(name not in BEHAVIOURAL_CHECKS for name in outcome.failed_checks)
            kept = failing_observations if values_diverge else passing_observations
            if len(kept) < DIAGNOSIS_EXAMPLES // 2:
                kept.append(Observation(outcome.batch, result))
        nonlocal step_matches, failing_steps
        if outcome.explained_by is not None:
            failing_steps += 1
            found = set(outcome.explained_by)
            step_matches = found if step_matches is None else step_matches & found
            evidenced.update(found if outcome.evidenced is None else outcome.evidenced)
        if outcome.ranks and not collectives:
            collectives.extend({"rank": r["rank"], "coords": r["coords"], "collectives": r["collectives"]} for r in outcome.ranks)
        if on_example is not None:
            on_example(outcome)
        if getattr(fn, "timeouts", 0) >= MAX_TIMEOUTS:
            raise _StopExploring  # every further call would likely wait out the timeout too
        return False

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            find(strategy, explore, settings=_search_settings(examples), random=random.Random(seed))
        except (NoSuchExample, _StopExploring):
            pass

    counterexamples = []
    # A step runner's step costs a model or a world: a minimal input already found for one
    # check also serves every other check it fails, instead of a new search per check.
    reuse = hasattr(fn, "step_battery")
    shrunk_outcomes: list[tuple[Any, BatteryOutcome]] = []
    for name, tally in tallies.items():
        if tally.first_failure is None:
            continue
        if not shrink or getattr(fn, "timeouts", 0):  # shrinking would wait out the timeout on every try
            counterexamples.append(_unshrunk(fn, impl, name, tally.first_failure, dtype, compute_dtype, device))
            continue
        prior = next(((found, outcome) for found, outcome in shrunk_outcomes if name in outcome.failed_checks), None) if reuse else None
        if prior is not None:
            counterexamples.append(_counterexample(fn, impl, name, prior[0], prior[1], dtype, compute_dtype))
            continue
        found, outcome = _shrink(fn, name, tally.first_failure, strategy, examples, seed, dtype, compute_dtype, device)
        shrunk_outcomes.append((found, outcome))
        counterexamples.append(_counterexample(fn, impl, name, found, outcome, dtype, compute_dtype))
    distributed = hasattr(fn, "topology")
    # Invalid-input probes are single-process calls of a loss function; a step runner has its
    # own (the trainer's fail-closed rules) or none (a distributed world).
    if hasattr(fn, "validation_probes"):
        probes = fn.validation_probes(dtype=dtype, device=device)
    else:
        probes = [] if hasattr(fn, "step_battery") else [as_runner(fn).probe(p.name, dtype=dtype, device=device) for p in PROBES]
    report = CompareReport(impl, dtype, compute_dtype, seed, tried, tallies, counterexamples, tau=tau, device=device,
                           example_unit=getattr(fn, "example_unit", "batches"),
                           validation=probes, strict_validation=strict_validation, collectives=collectives,
                           topology={"dp": fn.topology.dp, "cp": fn.topology.cp, "tp": fn.topology.tp, "backend": fn.world.backend} if distributed else None)
    shrunk = [Observation(c.batch, c.actual) for c in counterexamples if c.actual is not None and c.check not in BEHAVIOURAL_CHECKS]
    divergent_values = shrunk + failing_observations
    report.diagnosis = diagnose(divergent_values + passing_observations if divergent_values else [], [n for n, t in tallies.items() if t.failures],
                                dtype=dtype, divergent=report.verdict == "divergent")
    # A variant that coincides with Algorithm 1 on every failing step reproduces them trivially.
    step_matches = (step_matches or set()) & evidenced
    if step_matches:
        from m2po_oracle.distributed_diagnosis import DESCRIPTIONS

        descriptions = getattr(fn, "variant_descriptions", DESCRIPTIONS)
        source = getattr(fn, "variant_source", "spec section 3 / production PR (distributed scope)")
        report.diagnosis["matches"] = [
            {"variant": name, "description": descriptions[name], "source": source,
             "evidence": f"reproduces all {failing_steps} failing steps"} for name in sorted(step_matches)] + report.diagnosis["matches"]
        report.diagnosis["status"] = "matched"
    report.duration_s = time.perf_counter() - started
    return report


def _counterexample(fn, impl, check, found, outcome: BatteryOutcome, dtype, compute_dtype) -> Counterexample:
    mismatches = tuple(m for m in outcome.mismatches if m.check == check) or outcome.mismatches
    return Counterexample(check, outcome.batch, mismatches, _replay(fn, impl, found, dtype, compute_dtype), outcome.measurement.result, outcome.ranks,
                          outcome.case)


def _unshrunk(fn, impl, check, found, dtype, compute_dtype, device) -> Counterexample:
    outcome = run_battery(fn, found, dtype=dtype, compute_dtype=compute_dtype, device=device)
    return _counterexample(fn, impl, check, found, outcome, dtype, compute_dtype)


def _replay(fn, impl, batch, dtype, compute_dtype) -> str:
    if hasattr(fn, "replay_command"):  # a step runner whose input is not a batch
        return fn.replay_command(batch, dtype=dtype, compute_dtype=compute_dtype)
    command = replay_command(impl, batch, dtype=dtype, compute_dtype=compute_dtype)
    adapter = getattr(fn, "adapter", None)
    if isinstance(adapter, str):
        command = command.replace(" --dtype ", f" --adapter {adapter} --dtype ", 1)
    if hasattr(fn, "topology"):
        command = command.replace(" --dtype ", f" --topology {fn.topology} --dtype ", 1)
    return command


def _shrink(fn, check, fallback, strategy, examples, seed, dtype, compute_dtype, device) -> tuple[Any, BatteryOutcome]:
    """Replay the same search with "this check fails" as the goal; Hypothesis shrinks it."""

    def fails(batch: Batch) -> bool:
        return check in run_battery(fn, batch, dtype=dtype, compute_dtype=compute_dtype, device=device).failed_checks

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            batch = find(strategy, fails, settings=_search_settings(examples), random=random.Random(seed))
        except (NoSuchExample, Exception):  # a flaky check may not fail again: keep the first failing batch
            batch = fallback
    return batch, run_battery(fn, batch, dtype=dtype, compute_dtype=compute_dtype, device=device)
