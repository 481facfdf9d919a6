"""Run the battery over many generated examples and shrink each failing check to a minimal one.

:func:`run_compare` talks only to the :class:`~m2po_oracle.call.runner.Runner` interface: the
checks it tallies, the strategy it explores, how it replays are the runner's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, cast

from m2po_oracle.call.isolation import InProcess
from m2po_oracle.call.loss_function import LossFunctionRunner
from m2po_oracle.call.runner import Runner, RunOptions
from m2po_oracle.compare.explore import Exploration, explore_and_judge
from m2po_oracle.compare.report import CheckTally, CompareReport
from m2po_oracle.errors import UsageError
from m2po_oracle.judge.battery import BatteryOutcome
from m2po_oracle.judge.contract import Implementation
from m2po_oracle.oracle.encoding import to_builtins


def in_process_runner(fn: Implementation, impl: str, **option_values: Any) -> Runner:
    """A runner calling the loss function ``fn`` in this process (tests, notebooks)."""
    options = RunOptions.from_values({k: v for k, v in option_values.items() if v is not None})
    return LossFunctionRunner(
        impl,
        InProcess(fn, capture=not options.show_output, rejecting=options.rejecting),
        options.but(in_process=True, given=options.given | {"in_process"}),
    )


def select_checks(available: tuple[str, ...] | list[str], patterns: str | None) -> tuple[str, ...] | None:
    """The checks matching comma-separated glob ``patterns`` ("selection.*,loss"); a pattern
    matching none of them is a usage error naming what there is."""
    import fnmatch

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


def run_compare(
    target: Runner | Implementation,
    impl: str | None = None,
    *,
    shrink: bool = True,
    on_example: Callable[[BatteryOutcome], None] | None = None,
    until_first_failure: bool = False,
    exploration: Exploration | None = None,
    started: float | None = None,
    **option_values: Any,
) -> CompareReport:
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
        runner = in_process_runner(
            target, cast(str, impl or getattr(target, "__name__", "implementation")), **option_values
        )  # impl, or the callable's name
    options = runner.options
    started = time.perf_counter() if started is None else started
    selected = exploration.checks or tuple(runner.checks)
    report = CompareReport(
        runner.spec,
        options.dtype,
        options.effective_compute_dtype,
        options.seed,
        0,
        {n: CheckTally(n) for n in selected},
        tau=options.tau,
        device=options.device,
        strict_validation=options.strict_validation,
        example_unit=runner.example_unit,
        examples_requested=options.examples,
        accepted=exploration.accept,
        strict_accept=exploration.strict_accept,
        **_describe(runner),
    )
    try:
        explore_and_judge(runner, report, exploration, on_example, until_first_failure)
    except KeyboardInterrupt:
        report.interrupted = True
        report.validation_not_run = report.validation_not_run or "the run was interrupted"
    report.output = to_builtins(runner.output)
    if options.capture:  # after every step the run took: exploration, shrinking, the counterexamples' replays
        report.capture = runner.describe().capture
    report.duration_s = time.perf_counter() - started
    return report


def _describe(runner: Runner) -> dict[str, Any]:
    described = runner.describe()
    return {"topology": described.topology, "adapter": described.adapter}
