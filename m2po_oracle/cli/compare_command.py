"""``m2po-oracle compare`` and ``replay``: open the runner for ``--impl``, run, report; load
errors and Ctrl-C still report."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console

from m2po_oracle.call.runner import CaptureFailed
from m2po_oracle.cli import options
from m2po_oracle.cli.config import exploration_from, load_config
from m2po_oracle.cli.console import print_quiet, print_report, say_error
from m2po_oracle.cli.launch import open_runner, run_options
from m2po_oracle.compare.report import load_error_report
from m2po_oracle.compare.search import run_compare
from m2po_oracle.distributed.world import WorldError
from m2po_oracle.errors import (
    EXIT_DIVERGENT,
    EXIT_EQUIVALENT,
    EXIT_INTERRUPTED,
    EXIT_UNUSABLE,
    LoadError,
    UsageError,
)
from m2po_oracle.judge.equivalence import format_mismatches
from m2po_oracle.oracle.encoding import write_json
from m2po_oracle.report.html import write_html


def run_or_replay(args: argparse.Namespace, console: Console) -> int:
    """compare or replay: open the runner, run, report; load errors and Ctrl-C still report."""
    try:
        project = load_config()
        given = {o.name: getattr(args, o.name, None) for o in options.COMPARE_OPTIONS + options.RUN_SETTINGS if hasattr(args, o.name)}
        if getattr(args, "exitfirst", False):
            given["max_failures"] = 1
        args.values = project.merged(given)
        args.project = project
        for kind, path in project.reports.items():  # --json / --html override the file's
            if getattr(args, kind, None) is None and args.command == "compare":
                setattr(args, kind, path)
        args.impl = args.impl or project.impl
        if args.impl is None:
            raise UsageError('--impl: required (or impl = "module:function" under [tool.m2po-oracle] in pyproject.toml)')
        if args.command != "compare":  # capture = DIR in pyproject.toml is for compare: a replay must not refuse or add to it
            args.values.pop("capture", None)
        runner_options = run_options({k: v for k, v in args.values.items() if k in {o.name for o in options.COMPARE_OPTIONS}})
        with console.status(f"loading {args.impl}"):  # shown from the start: imports and world start-up can take seconds
            runner = open_runner(args.impl, runner_options)
    except UsageError as error:
        say_error(str(error))
        return EXIT_UNUSABLE
    except LoadError as error:
        return _load_failed(args, error, runner_options, console)
    except ValueError as error:  # e.g. an unusable --device
        say_error(str(error))
        return EXIT_UNUSABLE
    try:
        with runner:
            try:
                with console.status(f"starting {args.impl}"):
                    runner.start()
            except LoadError as error:  # raised where the worker loads the implementation
                return _load_failed(args, error, runner_options, console)
            return _compare(args, runner, console) if args.command == "compare" else _replay(args, runner, console)
    except WorldError as error:
        say_error(f"the world of {args.topology} could not run: {error}")
        return EXIT_UNUSABLE
    except CaptureFailed as error:  # the run cannot go on without losing steps from the capture
        say_error(str(error))
        return EXIT_UNUSABLE
    except KeyboardInterrupt:  # outside a compare (which reports its own interruption)
        Console(stderr=True).print("interrupted", highlight=False)
        return EXIT_INTERRUPTED


def _load_failed(args: argparse.Namespace, error: Exception, runner_options, console: Console) -> int:
    """A load error: said on stderr, and written as an unusable report when asked."""
    say_error(str(error))
    if args.command == "compare":
        _write_reports(args, load_error_report(args.impl, str(error), runner_options).to_json(), console)
    return EXIT_UNUSABLE


def _compare(args: argparse.Namespace, runner, console: Console) -> int:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    try:
        exploration = exploration_from(args.values, args.project, tuple(runner.checks))
    except UsageError as error:
        say_error(str(error))
        return EXIT_UNUSABLE
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=True
    ) as progress:
        task = progress.add_task(f"checking {args.impl}", total=runner.options.examples)
        report = run_compare(runner, on_example=lambda _: progress.advance(task), exploration=exploration, started=args.started)
    chosen = runner.describe().dtype  # a trainer computing in one dtype, run without --dtype
    report.dtype_why = chosen.why if chosen is not None else None
    record = report.to_json()
    if args.verbosity < 0:
        return _quiet_summary(args, report, record, console)
    if report.interrupted:
        _write_reports(args, record, console, quiet=True)
        written = " ".join(str(p) for p in (args.json, args.html) if p is not None)
        Console(stderr=True).print(
            f"interrupted after {report.examples} {report.example_unit} ({report.duration_s:.1f} s)"
            + (f"; partial report: {written}" if written else ""),
            highlight=False,
            soft_wrap=True,
        )
        return EXIT_INTERRUPTED
    print_report(console, record, args.impl, every_line=args.verbosity > 0)
    _write_reports(args, record, console)
    return report.exit_status


def _quiet_summary(args: argparse.Namespace, report, record: dict, console: Console) -> int:
    """-q: the verdict, each failing check with its explanation, the accepted deviations."""
    print_quiet(console, record)
    _write_reports(args, record, console, quiet=True)
    return report.exit_status


def _write_reports(args: argparse.Namespace, record: dict, console: Console, quiet: bool = False) -> None:
    if getattr(args, "json", None) is not None:
        write_json(record, args.json)
        if not quiet:
            console.print(f"JSON report: {args.json}")
    if getattr(args, "html", None) is not None:
        write_html(record, args.html)
        if not quiet:
            console.print(f"HTML report: {args.html}")


def _replay(args: argparse.Namespace, runner, console: Console) -> int:
    text = args.source if args.source is not None else args.batch
    if text is None or (args.source is not None and args.batch is not None):
        say_error("replay: give exactly one of SOURCE or --batch")
        return EXIT_UNUSABLE
    path = Path(text)
    what = "SOURCE" if args.source is not None else "--batch"
    if not text.lstrip().startswith("{") and not path.is_file():
        # Not JSON, so a path: say it is missing rather than fail to parse the name as JSON.
        found = "is a folder, not a file" if path.is_dir() else "no such file"
        say_error(f"{what}: {text}: {found} (expected a compare report's JSON, a batch's JSON, or the path to one)")
        return EXIT_UNUSABLE
    try:
        if not text.lstrip().startswith("{"):
            text = path.read_text()
        data = json.loads(text)
        # A step runner whose input is not a batch (the trainer) replays its own input records.
        key = runner.example_key()
        if "counterexamples" in data:  # a compare report: replay each of its counterexamples
            examples = [runner.parse_example(c[key]) for c in data["counterexamples"]]
        else:
            examples = [runner.parse_example(data)]
    except (OSError, ValueError, KeyError, TypeError) as error:
        say_error(f"batch: expected JSON of a batch or a compare report, or a path to one: {error}")
        return EXIT_UNUSABLE
    status = EXIT_EQUIVALENT
    for example in examples:
        outcome = runner.run_battery(example)
        if outcome.mismatches:
            status = EXIT_DIVERGENT
            console.print(
                format_mismatches(list(outcome.mismatches), batch=outcome.batch, where=f"for {args.impl!r}"),
                highlight=False,
                markup=False,
                soft_wrap=True,
            )
            if outcome.explained_by:
                console.print(f"explained by: {', '.join(outcome.explained_by)}", highlight=False)
        else:
            console.print(f"all checks pass on the batch of shape {outcome.batch.shape} (tau {outcome.batch.tau})")
    return status
