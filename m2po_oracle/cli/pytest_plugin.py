"""pytest plugin: ``pytest --m2po-impl SPEC`` runs the compare battery in your own CI.

Adds one test item per check the runner runs (``m2po[SPEC]::selection.minimal``, ...) and
one for input validation. The battery runs once per implementation, on first use; under
pytest-xdist the first worker to need it runs it and the others read its outcome. Each
item fails with the check's minimal counterexample and its replay command; a check that
never ran is skipped, saying why. Options are the CLI's, as ``--m2po-NAME``, honoured or
refused exactly as by the CLI. Disable with ``-p no:m2po_oracle``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from m2po_oracle.cli import options
from m2po_oracle.cli.config import ProjectConfig, exploration_from, load_config
from m2po_oracle.errors import LoadError, UsageError
from m2po_oracle.judge.checks import CHECKS
from m2po_oracle.judge.equivalence import format_mismatches
from m2po_oracle.oracle.encoding import to_builtins, write_json

if TYPE_CHECKING:
    from _pytest._code.code import TerminalRepr  # what Item.repr_failure returns; pytest does not export it


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("m2po-oracle", "check an M2PO implementation against Algorithm 1")
    group.addoption(
        "--m2po-impl",
        dest="m2po_impl",
        default=None,
        metavar="SPEC",
        help="implementation to check: built-in name, module:function or file.py:function",
    )
    options.add_to_pytest(group)
    options.add_to_pytest(group, options.RUN_SETTINGS)
    group.addoption("--m2po-json", dest="m2po_json", default=None, metavar="PATH", help="write the JSON report of the battery here")
    group.addoption(
        "--m2po-html", dest="m2po_html", default=None, metavar="PATH", help="write the HTML report of the battery here (a CI artifact)"
    )


def _project(config: pytest.Config) -> Any:
    """``[tool.m2po-oracle]`` of the project pytest runs in (its rootdir's pyproject.toml)."""
    try:
        return load_config(Path(config.rootpath))
    except UsageError as error:
        raise pytest.UsageError(f"m2po-oracle: {error}") from None


def _option_values(config: pytest.Config, project: Any) -> dict[str, Any]:
    given = {o.name: config.getoption(f"m2po_{o.name}") for o in options.COMPARE_OPTIONS + options.RUN_SETTINGS}
    return project.merged(given)


def item_outcomes(spec: str, values: dict[str, Any], project: Any = None, reports: dict[str, Path] | None = None) -> dict[str, Any]:
    """Run the battery once and reduce it to what each item reports: JSON-ready, so that
    xdist workers can share it. ``{"error": str}`` when the run could not start."""
    from m2po_oracle.cli.launch import open_runner, run_options
    from m2po_oracle.compare.search import run_compare

    project = project or ProjectConfig()
    try:
        runner = open_runner(spec, run_options({k: v for k, v in values.items() if k in {o.name for o in options.COMPARE_OPTIONS}}))
        with runner:
            runner.start()
            report = run_compare(runner, exploration=exploration_from(values, project, tuple(runner.checks)))
    except UsageError as error:
        return {"error": f"usage error: {error}"}
    except (LoadError, ValueError) as error:
        return {"error": f"the implementation could not be loaded: {error}"}
    _write_reports(report, reports or {})
    items: dict[str, Any] = {}
    by_check = report.diagnosis.by_check
    accepted = {a.deviation: a for a in report.accepted}
    adapter = report.adapter
    beyond_adapter = adapter.not_run if adapter is not None else {}  # checks on what the adapter, not the port, decides
    for name, tally in report.tallies.items():
        if tally.status == "not run":
            why = (
                "no call returned a result"
                if name != "call" and not report.usable
                else f"adapter {adapter.name}: {beyond_adapter[name]}"
                if adapter is not None and name in beyond_adapter
                else "no generated example exercised it"
            )
            items[name] = {"status": "skip", "message": f"not run on {report.examples} {report.example_unit}: {why}"}
            continue
        if not tally.failures:
            items[name] = {"status": "pass", "message": ""}
            continue
        message = f"failed on {tally.failures} of {report.examples} {report.example_unit}"
        explained = by_check.get(name, ())
        if explained and set(explained) <= set(accepted):  # a strict xfail: the project accepts this deviation
            reasons = "; ".join(
                f"{n}: {accepted[n].reason or 'accepted'}" + (f" ({accepted[n].link})" if accepted[n].link else "") for n in explained
            )
            items[name] = {"status": "xfail", "message": f"{message}, explained by accepted deviation(s) {reasons}"}
            continue
        if explained:
            message += f" (explained by {' + '.join(explained)})"
        for counterexample in report.counterexamples:
            if name in (counterexample.checks or (counterexample.check,)):
                message += "\n" + format_mismatches(
                    list(counterexample.mismatches),
                    batch=counterexample.batch,
                    where=f"(minimal batch for {name})",
                    replay=counterexample.replay,
                )
                break
        items[name] = {"status": "fail", "message": message}
    for name, a in accepted.items():
        shows = report.accepted_shown[name]
        if shows:
            items[f"accept:{name}"] = {
                "status": "xfail",
                "message": f"accepted deviation {name} ({a.reason or 'accepted'}) explains {', '.join(shows)}",
            }
        else:
            fixed = f"accepted deviation {name} no longer shows on {report.examples} {report.example_unit}"
            items[f"accept:{name}"] = (
                {"status": "fail", "message": f"{fixed}: fixed? remove it from accept (or set strict = false)"}
                if report.strict_accept
                else {"status": "pass", "message": "", "warnings": [f"{fixed} (strict = false)"]}
            )
    if report.validation_not_run:
        items["validation"] = {"status": "skip", "message": f"validation not run: {report.validation_not_run}"}
    elif report.validation and not any(p.ran for p in report.validation):
        # A check that did not run is never a pass.
        reasons = "; ".join(f"{p.probe}: {p.message}" for p in report.validation)
        items["validation"] = {"status": "skip", "message": f"validation not run: no invalid-input probe could run ({reasons})"}
    else:
        problems = [f"- {p.probe} ({p.description}): {p.status}: {p.message}" for p in report.validation_warnings]
        failing = bool(problems) and report.strict_validation
        items["validation"] = {
            "status": "fail" if failing else "pass",
            "message": "invalid input not rejected:\n" + "\n".join(problems) if failing else "",
            "warnings": problems,
        }
    return {"checks": list(report.tallies) + [f"accept:{n}" for n in accepted], "items": items, "verdict": report.verdict}


def _write_reports(report: Any, reports: dict[str, Path]) -> None:
    record = report.to_json()
    if "json" in reports:
        write_json(record, reports["json"])
    if "html" in reports:
        from m2po_oracle.report.html import write_html

        write_html(record, reports["html"])


class _SharedRun:
    """The one compare run all items of a session read from, shared across xdist workers
    through a file keyed by the implementation and its options."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.project = _project(config)
        self.spec = config.getoption("m2po_impl") or self.project.impl
        self.values = _option_values(config, self.project)
        given = {kind: config.getoption(f"m2po_{kind}") for kind in ("json", "html")}
        self.reports = {**self.project.reports, **{kind: Path(path) for kind, path in given.items() if path}}
        self._outcomes: dict[str, Any] | None = None

    def get(self) -> dict[str, Any]:
        if self._outcomes is None:
            self._outcomes = (
                self._shared() if hasattr(self.config, "workerinput") else item_outcomes(self.spec, self.values, self.project, self.reports)
            )
        return self._outcomes

    def _shared(self) -> dict[str, Any]:
        run_id = self.config.workerinput.get("testrunuid", "run")  # type: ignore[attr-defined]  # pytest-xdist sets it on a worker's config; pytest's Config does not declare it
        accept = [to_builtins(a) for a in self.project.accept] + [self.project.strict]
        key = hashlib.sha256(
            json.dumps([self.spec, {k: str(v) for k, v in self.values.items()}, accept], sort_keys=True).encode()
        ).hexdigest()[:16]
        path = Path(tempfile.gettempdir()) / f"m2po-oracle-{run_id}-{key}.json"
        with open(f"{path}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the first worker runs the battery; the rest wait for its file
            if path.exists():
                return json.loads(path.read_text())
            outcomes = item_outcomes(self.spec, self.values, self.project, self.reports)
            scratch = path.with_suffix(f".{os.getpid()}.tmp")
            scratch.write_text(json.dumps(outcomes))
            scratch.replace(path)
            return outcomes


class M2POCheckItem(pytest.Item):
    def __init__(self, *, check: str, shared: _SharedRun, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.check = check
        self.shared = shared

    def runtest(self) -> None:
        outcomes = self.shared.get()
        if "error" in outcomes:
            raise M2POCheckFailed(outcomes["error"])
        item = outcomes["items"].get(self.check)
        if item is None:
            pytest.skip(f"{self.check} is not a check of this runner")
        for warning in item.get("warnings", ()):
            self.warn(pytest.PytestWarning(f"m2po validation: {warning}"))
        if item["status"] == "skip":
            pytest.skip(item["message"])
        if item["status"] == "xfail":
            pytest.xfail(item["message"])
        if item["status"] == "fail":
            raise M2POCheckFailed(item["message"])

    def repr_failure(self, excinfo: Any, style: Any = None) -> str | TerminalRepr:
        if isinstance(excinfo.value, M2POCheckFailed):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple[Any, int, str]:
        return self.path, 0, f"m2po[{self.shared.spec}]::{self.check}"


class M2POCheckFailed(AssertionError):
    pass


def _declared_checks(spec: str, values: dict[str, Any], project: Any) -> tuple[str, ...]:
    """The checks the runner for ``spec`` declares, narrowed by --checks, and one item per
    accepted deviation (the single-process battery's if it cannot be opened: every item then
    reports why)."""
    from m2po_oracle.cli.launch import open_runner, run_options
    from m2po_oracle.compare.search import select_checks

    accepted = tuple(f"accept:{a.deviation}" for a in project.accept) + tuple(
        f"accept:{n}" for n in values.get("accept") or () if n not in {a.deviation for a in project.accept}
    )
    try:
        declared = tuple(
            open_runner(spec, run_options({k: v for k, v in values.items() if k in {o.name for o in options.COMPARE_OPTIONS}})).checks
        )
    except Exception:  # reported by every item when the run cannot start
        return tuple(CHECKS) + accepted
    try:
        return (select_checks(declared, values.get("checks")) or declared) + accepted
    except Exception:  # a --checks pattern matching nothing: every item reports the usage error
        return declared + accepted


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    shared = _SharedRun(config)
    spec = shared.spec
    if not spec:
        return
    for check in (*_declared_checks(spec, shared.values, shared.project), "validation"):
        items.append(M2POCheckItem.from_parent(session, name=f"m2po[{spec}]::{check}", check=check, shared=shared))
