"""pytest plugin: ``pytest --m2po-impl SPEC`` runs the compare battery in your own CI.

Adds one test item per check (``m2po[SPEC]::selection.minimal``, ...) and one for input
validation. The battery runs once, on first use; each item fails with the check's minimal
counterexample and its replay command. Options are the CLI's, as ``--m2po-NAME``.
Disable with ``-p no:m2po_oracle``.
"""

from __future__ import annotations

from typing import Any

import pytest

from m2po_oracle import options


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("m2po-oracle", "check an M2PO implementation against Algorithm 1")
    group.addoption("--m2po-impl", dest="m2po_impl", default=None, metavar="SPEC",
                    help="implementation to check: built-in name, module:function or file.py:function")
    options.add_to_pytest(group)


class _SharedRun:
    """The one compare run all items of a session read from."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.report: Any = None
        self.error: str | None = None

    def get(self) -> Any:
        if self.report is None and self.error is None:
            self._run()
        return self.report

    def _run(self) -> None:
        from m2po_oracle.compare import run_compare
        from m2po_oracle.contract import load_implementation
        from m2po_oracle.isolation import ImplementationLoadError, Isolated

        opt = {o.name: self.config.getoption(f"m2po_{o.name}") for o in options.COMPARE_OPTIONS}
        spec = self.config.getoption("m2po_impl")
        settings = dict(examples=opt["examples"], seed=opt["seed"], dtype=opt["dtype"], compute_dtype=opt["compute_dtype"], tau=opt["tau"],
                        device=opt["device"], strict_validation=opt["strict_validation"])
        try:
            fn = load_implementation(spec)
            if opt["in_process"] or hasattr(fn, "step_battery"):  # a step runner (the trainer) runs its own step
                self.report = run_compare(fn, spec, **settings)
            else:
                with Isolated(spec, timeout_s=opt["timeout"]) as runner:
                    self.report = run_compare(runner, spec, **settings)
        except (ValueError, ImplementationLoadError) as error:
            self.error = str(error)


class M2POCheckItem(pytest.Item):
    def __init__(self, *, check: str, shared: _SharedRun, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.check = check
        self.shared = shared

    def runtest(self) -> None:
        from m2po_oracle.equivalence import format_mismatches

        report = self.shared.get()
        if report is None:
            raise M2POCheckFailed(f"the implementation could not be loaded: {self.shared.error}")
        if self.check == "validation":
            problems = report.validation_warnings
            if problems and report.strict_validation:
                raise M2POCheckFailed("invalid input not rejected:\n" + "\n".join(f"- {p.probe}: {p.status}: {p.message}" for p in problems))
            for p in problems:
                self.warn(pytest.PytestWarning(f"m2po validation: {p.probe} ({p.description}) was {p.status}"))
            return
        tally = report.tallies[self.check]
        if not tally.failures:
            return
        for counterexample in report.counterexamples:
            if counterexample.check == self.check:
                raise M2POCheckFailed(f"failed on {tally.failures} of {report.examples} examples\n" + format_mismatches(
                    list(counterexample.mismatches), batch=counterexample.batch, where=f"(minimal batch for {self.check})", replay=counterexample.replay))
        raise M2POCheckFailed(f"failed on {tally.failures} of {report.examples} examples")

    def repr_failure(self, excinfo: Any, style: Any = None) -> str:
        if isinstance(excinfo.value, M2POCheckFailed):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple[Any, int, str]:
        return self.path, 0, f"m2po[{self.shared.config.getoption('m2po_impl')}]::{self.check}"


class M2POCheckFailed(AssertionError):
    pass


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    spec = config.getoption("m2po_impl")
    if not spec:
        return
    from m2po_oracle.battery import CHECKS
    from m2po_oracle.contract import load_implementation

    try:  # a step runner (the trainer) runs a subset of the checks, and its own
        checks = getattr(load_implementation(spec), "checks", CHECKS)
    except Exception:  # reported by every item when the run cannot load it
        checks = CHECKS
    shared = _SharedRun(config)
    for check in (*checks, "validation"):
        items.append(M2POCheckItem.from_parent(session, name=f"m2po[{spec}]::{check}", check=check, shared=shared))
