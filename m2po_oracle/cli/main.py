"""``m2po-oracle``: check an M2PO implementation against Algorithm 1.

Exit status: 0 no divergence found; 1 divergence found; 2 the implementation could not be
loaded or called at all, or a usage error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from m2po_oracle.cli import options
from m2po_oracle.explain.diagnosis import ALIKE

EXIT_EQUIVALENT, EXIT_DIVERGENT, EXIT_UNUSABLE = 0, 1, 2
#: Ctrl-C: the partial report is written, as the shell's convention for SIGINT.
EXIT_INTERRUPTED = 130


#: The compare options replay takes: how to call, not what to explore.
REPLAY_OPTIONS = ("dtype", "compute_dtype", "device", "timeout", "in_process", "topology", "backend", "adapter", "bind", "validation_errors", "show_output")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # usage errors exit 2, as documented
        self.print_usage(sys.stderr)
        self.exit(EXIT_UNUSABLE, f"{self.prog}: error: {message}\n")


COMPARE_EPILOG = """\
Options not given on the command line are read from [tool.m2po-oracle] in the nearest
pyproject.toml (impl, adapter, bind, examples, seed, dtype, compute-dtype, topology,
backend, accept, strict, ...); a flag overrides the file.

exit status:
  0    equivalent (or equivalent-with-accepted: every failure is an accepted deviation)
  1    divergent, or an accepted deviation no longer shows (accepted-deviation-fixed)
  2    unusable (the implementation could not be loaded or never returned a result) or a usage error
  130  interrupted (Ctrl-C); the partial JSON/HTML report is written

example:
  m2po-oracle compare --impl my_framework.losses:m2po_loss --examples 500 --html reports/mine.html
  m2po-oracle compare --impl port.py:compute_policy_loss --adapter policy_loss --accept clamped_log_ratio -x
"""


def build_parser() -> argparse.ArgumentParser:
    from m2po_oracle import __version__

    parser = _Parser(prog="m2po-oracle", description="Check an M2PO implementation against the Algorithm 1 oracle.")
    parser.add_argument("--version", action="version", version=f"m2po-oracle {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    compare = commands.add_parser("compare", help="run the check battery on generated batches", epilog=COMPARE_EPILOG,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    compare.add_argument("--impl", default=None, help="built-in name (core, control:NAME), package.module:function or path/file.py:function "
                         "(default: impl in [tool.m2po-oracle])")
    options.add_to_argparse(compare)
    options.add_to_argparse(compare, options.RUN_SETTINGS)
    compare.add_argument("-x", "--exitfirst", dest="exitfirst", action="store_true", help="stop exploring at the first failing example (--max-failures 1)")
    verbosity = compare.add_mutually_exclusive_group()
    verbosity.add_argument("-q", "--quiet", dest="verbosity", action="store_const", const=-1, default=0,
                           help="print only the verdict, the failing checks and the explanation")
    verbosity.add_argument("-v", "--verbose", dest="verbosity", action="store_const", const=1,
                           help="also print every counterexample's full batch and the implementation's captured output")
    compare.add_argument("--json", type=Path, default=None, help="write the JSON report here")
    compare.add_argument("--html", type=Path, default=None, help="write the self-contained HTML report (rendered from the JSON) here")

    replay = commands.add_parser("replay", help="run the battery on one saved batch")
    replay.add_argument("--impl", default=None, help="as for compare")
    replay.add_argument("source", nargs="?", default=None, help="a compare JSON report or a batch JSON file (or JSON text)")
    replay.add_argument("--batch", default=None, help="the batch as JSON text or a file path (alternative to SOURCE)")
    options.add_to_argparse(replay, tuple(o for o in options.COMPARE_OPTIONS if o.name in REPLAY_OPTIONS))

    selftest = commands.add_parser("selftest", help="run the battery against every shipped negative control")
    selftest.add_argument("--only", default=None, help="comma-separated control names, trainer:NAME for a trainer control (default: all)")
    selftest.add_argument("--trainer", action="store_true", help="also the trainer-level controls (needs the trainer extra)")
    selftest.add_argument("--distributed", action="store_true", help="also the distributed controls, each on a gloo world of the topology it shows on")
    selftest.add_argument("--quick", action="store_true",
                          help="each control at the examples that catch and name it on seeds 0-9 (its own number), unshrunk: the CI run")
    selftest.add_argument("--seeds", type=options.positive_int, default=1,
                          help="also run each control on this many seeds until its first failing example; shows min / median / max (default 1)")
    options.add_to_argparse(selftest, tuple(o for o in options.COMPARE_OPTIONS if o.name in ("examples", "seed")))
    selftest.add_argument("--jobs", type=options.positive_int, default=1,
                          help="run the controls in this many processes at once (default %(default)s; distributed controls run one at a time)")

    bench = commands.add_parser("bench", help="time the exact selection and the core forward against sorting and a streaming pass, side by side")
    bench.add_argument("--sizes", default="20,22,24", help="comma-separated log2 token counts (default 20,22,24: 1M, 4M and 16M)")
    bench.add_argument("--scaling", action="store_true", help="the scaling series 2^12 .. 2^24 instead of --sizes")
    bench.add_argument("--repeats", type=options.positive_int, default=7, help="interleaved repeats per size (medians and bests reported)")
    bench.add_argument("--device", default="cpu", help="cpu or cuda")
    bench.add_argument("--threads", type=options.positive_int, default=None, help="torch CPU threads (default: torch's)")
    bench.add_argument("--ranks", type=options.positive_int, default=None,
                       help="also compare distributed selection on a gloo world of this many ranks (tokens per rank: the largest --sizes)")
    bench.add_argument("--json", type=Path, default=None)
    bench.add_argument("--html", type=Path, default=None)
    bench.add_argument("--audit", action="store_true",
                       help="instead: time the offline audit (audit_capture) of one synthetic dp=4 x 2 micro-batch step, correct and with a planted bug")
    bench.add_argument("--tokens", type=options.positive_int, default=1 << 24, help="with --audit: tokens of that step (default 16,777,216)")

    audit = commands.add_parser("audit", help="audit a capture of a training run (m2po_oracle.capture.recorder) against Algorithm 1, step by step")
    audit.add_argument("directory", type=Path, help="the capture directory (manifest.rank-*.json)")
    audit.add_argument("--json", type=Path, default=None, help="write the JSON report (schema m2po-oracle/audit/1) here")
    audit.add_argument("--html", type=Path, default=None, help="write the HTML report (a timeline of every step, the worst step first) here")
    audit.add_argument("--step", type=int, action="append", default=None, metavar="N", help="audit only this optimizer step (repeatable)")
    audit.add_argument("--rollout-atol", type=options.nonnegative_seconds, default=None, metavar="X",
                       help="let the behaviour log-probs differ from the sampler's rollout_logp by up to X per token (a recomputation "
                            "under the sampler's weights with other kernels); default: equal at float32 precision")
    audit.add_argument("--policy-atol", type=options.nonnegative_seconds, default=None, metavar="X",
                       help="let the loss pass's log-probs differ from the selection's prepass (selection_logp) by up to X per token "
                            "(nondeterministic kernels); default: equal at the capture dtype's precision")

    commands.add_parser("checks", help="list the checks of the battery")
    commands.add_parser("adapters", help="list the adapters (--adapter): each family's signature, what it reads back, which checks it can run")
    return parser


def main(argv: list[str] | None = None) -> int:
    import time

    started = time.perf_counter()  # the reported duration covers start-up (imports, the world) too
    args = build_parser().parse_args(argv)
    args.started = started
    # Off a terminal (CI logs, pipes) rich would wrap at 80 columns: tables and messages keep their lines.
    console = Console(stderr=False, width=None if sys.stdout.isatty() else 200)
    if args.command == "checks":
        from m2po_oracle.judge.checks import ALL_CHECKS, CHECKS, DISTRIBUTED_CHECKS

        table = Table("check", "runs for", "asserts")
        for name, description in ALL_CHECKS.items():
            runs_for = "every run" if name == "call" else "a loss function" if name in CHECKS else "--topology" if name in DISTRIBUTED_CHECKS else "--impl trainer"
            table.add_row(name, runs_for, description)
        console.print(table)
        return EXIT_EQUIVALENT
    if args.command == "adapters":
        return _adapters(console)
    if args.command == "selftest":
        return _selftest(args, console)
    if args.command == "bench":
        return _bench(args, console)
    if args.command == "audit":
        return _audit(args, console)
    return _run(args, console)


def _metric_sources_text(sources: dict[str, str]) -> str:
    """``m2_before <- [1]['m2']``: each metric judged, and the port's value it was read from;
    those the port logs under our own names in one place are listed once."""
    plain: dict[str, list[str]] = {}
    renamed = []
    for ours, where in sorted(sources.items()):
        suffix = f"[{ours!r}]"
        if where.endswith(suffix):
            plain.setdefault(where[: -len(suffix)] or "the return", []).append(ours)
        else:
            renamed.append(f"{ours} <- {where}")
    return "; ".join([*(f"{', '.join(names)} under our names at {at}" for at, names in plain.items()), *renamed])


def _adapters(console: Console) -> int:
    """Every adapter (``--adapter NAME``): the port's signature, the roles ``--bind`` moves,
    what is read back, which checks it can run and which it cannot (with why)."""
    from m2po_oracle.adapters import ADAPTERS
    from m2po_oracle.adapters.binding import METRIC_ALIASES, METRIC_PREFIXES
    from m2po_oracle.judge.checks import CHECKS

    say = lambda text="": console.print(text, highlight=False, markup=False, soft_wrap=True)  # noqa: E731
    selection = [c for c in CHECKS if c.startswith("selection.")]
    say("adapters: m2po-oracle compare --impl SPEC --adapter NAME [--bind KEY=VALUE ...]")
    for adapter in ADAPTERS.values():
        runs = adapter.runs()
        shown = [c for c in runs if not c.startswith(("selection.", "metrics."))]
        if set(selection) <= set(runs):
            shown.insert(1, "selection.*")
        else:
            shown[1:1] = [c for c in runs if c.startswith("selection.")]
        if any(c.startswith("metrics.") for c in runs):
            shown.append("metrics.* the port returns")
        by_reason: dict[str, list[str]] = {}
        for check, why in adapter.not_run().items():
            if not check.startswith("metrics."):
                by_reason.setdefault(why, []).append(check)
        say()
        say(adapter.name)
        say(f"  signature:  {adapter.signature}")
        say(f"  roles:      {', '.join(f'{p.role} -> {p.text()}' for p in adapter.params)}")
        say(f"  reads back: {', '.join(adapter.checked)} ({'; '.join(o.text() for o in adapter.outputs)})")
        say(f"  checks:     {', '.join(shown)}")
        for why, checks in by_reason.items():
            named = "selection.*" if checks == selection else ", ".join(checks)
            say(f"  not run:    {named}: {why}")
        say(f"  metrics:    {adapter.maps}")
        say(f"  seen in:    {adapter.seen_in}")
    say()
    prefixes = ", ".join(repr(p) for p in METRIC_PREFIXES)
    aliases = ", ".join(f"{k} -> {v}" for k, v in METRIC_ALIASES.items())
    say(f"Metric names mapped from a returned mapping: our names (m2_before, m2_after, masked_fraction, trust_region_fraction, valid_count, "
        f"trust_region_count, kept_trust_region_count) after any 'prefix/' and {prefixes}; {aliases}. Other keys are not read.")
    say("--bind KEY=VALUE (repeatable): KEY a role -> where it goes (a parameter name, a 0-based position, or PARAMETER.ATTRIBUTE); "
        "KEY a constant -> its value; KEY an output (loss, keep, per_token_loss, metrics or a metric name) -> where it is in the return "
        "(an index, a key, or a path such as 4.M2_after); any other KEY -> an extra keyword argument. Values are Python literals, else strings.")
    return EXIT_EQUIVALENT


def _error(message: str) -> None:
    Console(stderr=True).print(f"error: {message}", highlight=False, markup=False, soft_wrap=True)


def _run(args: argparse.Namespace, console: Console) -> int:
    """compare or replay: open the runner, run, report; load errors and Ctrl-C still report."""
    from m2po_oracle.distributed.world import WorldError
    from m2po_oracle.cli.launch import open_runner
    from m2po_oracle.errors import LoadError
    from m2po_oracle.errors import UsageError
    from m2po_oracle.call.runner import CaptureFailed

    from m2po_oracle.cli.config import load_config

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
            raise UsageError("--impl: required (or impl = \"module:function\" under [tool.m2po-oracle] in pyproject.toml)")
        if args.command != "compare":  # capture = DIR in pyproject.toml is for compare: a replay must not refuse or add to it
            args.values.pop("capture", None)
        run_options = options.run_options({k: v for k, v in args.values.items() if k in {o.name for o in options.COMPARE_OPTIONS}})
        with console.status(f"loading {args.impl}"):  # shown from the start: imports and world start-up can take seconds
            runner = open_runner(args.impl, run_options)
    except UsageError as error:
        _error(str(error))
        return EXIT_UNUSABLE
    except LoadError as error:
        return _load_failed(args, error, run_options, console)
    except ValueError as error:  # e.g. an unusable --device
        _error(str(error))
        return EXIT_UNUSABLE
    try:
        with runner:
            try:
                with console.status(f"starting {args.impl}"):
                    runner.start()
            except LoadError as error:  # raised where the worker loads the implementation
                return _load_failed(args, error, run_options, console)
            return _compare(args, runner, console) if args.command == "compare" else _replay(args, runner, console)
    except WorldError as error:
        _error(f"the world of {args.topology} could not run: {error}")
        return EXIT_UNUSABLE
    except CaptureFailed as error:  # the run cannot go on without losing steps from the capture
        _error(str(error))
        return EXIT_UNUSABLE
    except KeyboardInterrupt:  # outside a compare (which reports its own interruption)
        Console(stderr=True).print("interrupted", highlight=False)
        return EXIT_INTERRUPTED


def _load_failed(args: argparse.Namespace, error: Exception, run_options, console: Console) -> int:
    """A load error: said on stderr, and written as an unusable report when asked."""
    _error(str(error))
    if args.command == "compare":
        from m2po_oracle.compare.report import load_error_report

        _write_reports(args, load_error_report(args.impl, str(error), run_options).to_json(), console)
    return EXIT_UNUSABLE


def _compare(args: argparse.Namespace, runner, console: Console) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from m2po_oracle.compare.search import run_compare

    from m2po_oracle.cli.config import exploration_from

    from m2po_oracle.errors import UsageError

    try:
        exploration = exploration_from(args.values, args.project, tuple(runner.checks))
    except UsageError as error:
        _error(str(error))
        return EXIT_UNUSABLE
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=True) as progress:
        task = progress.add_task(f"checking {args.impl}", total=runner.options.examples)
        report = run_compare(runner, on_example=lambda _: progress.advance(task), exploration=exploration, started=args.started)
    record = report.to_json()
    chosen = runner.describe().get("dtype")  # a trainer computing in one dtype, run without --dtype
    if chosen:
        record["options"]["dtype_why"] = chosen["why"]
    if args.verbosity < 0:
        return _quiet_summary(args, report, record, console)
    if report.interrupted:
        _write_reports(args, record, console, quiet=True)
        written = " ".join(str(p) for p in (args.json, args.html) if p is not None)
        Console(stderr=True).print(f"interrupted after {report.examples} {report.example_unit} ({report.duration_s:.1f} s)"
                                   + (f"; partial report: {written}" if written else ""), highlight=False, soft_wrap=True)
        return EXIT_INTERRUPTED
    if chosen:
        console.print(f"dtype: {chosen['value']} ({chosen['why']})", highlight=False, markup=False, soft_wrap=True)
    if report.adapter:
        a = report.adapter
        skipped = [check for check in a.get("not_run", {}) if not check.startswith("metrics.")]
        console.print(f"adapter {a['name']} ({a['signature']}): checks {', '.join(a['checked'])}"
                      + (f"; not run (the adapter, not the port, decides them): {', '.join(skipped)}" if skipped else "")
                      + (f"; call: {a['call']}" if a.get("call") else ""), highlight=False, markup=False, soft_wrap=True)
        if report.metric_sources:
            console.print(f"metrics read from the port: {_metric_sources_text(report.metric_sources)}", highlight=False, markup=False, soft_wrap=True)
    unit = report.example_unit
    if report.verdict == "unusable":
        console.print(f"[bold red]unusable[/]: no call returned a usable result on {report.examples} {unit}; no check other than 'call' ran", soft_wrap=True)
    if report.stopped_early:
        console.print(f"stopped early after {report.examples} of {report.examples_requested} {unit}: {report.stopped_early}", highlight=False, soft_wrap=True)
    from m2po_oracle.judge.coverage import rate_text

    coverage = report.coverage
    families = ", ".join(f"{name} {count}" for name, count in coverage.families.most_common())
    features = ", ".join(f"{name} {count}" for name, count in coverage.features.items())
    table = Table(title=f"{args.impl} vs Algorithm 1 ({report.examples} {unit}, {report.dtype}, seed {report.seed})",
                  caption=(f"exercised: {unit} that could have failed the check; failure rate: observed, and its one-sided 95% "
                           f"Clopper-Pearson upper bound\nfamilies: {families or '-'}\nfeatures (of {coverage.judged} judged): {features}"))
    table.add_column("check")
    table.add_column("result")
    table.add_column(f"failing {unit}", justify="right")
    table.add_column(f"{unit} checked", justify="right")
    table.add_column("exercised", justify="right")
    table.add_column("failure rate (95%)", justify="right")
    table.add_column("explained by")
    labels = {"fail": "[red]FAIL[/]", "pass": "[green]pass[/]", "not run": "[yellow]not run[/]"}
    by_check, unexplained = report.diagnosis.get("by_check", {}), set(report.diagnosis.get("unexplained", ()))
    for name, tally in report.tallies.items():
        explained = " + ".join(by_check.get(name, ())) or ("[yellow]unexplained[/]" if name in unexplained else "")
        table.add_row(name, labels[tally.status], str(tally.failures), str(tally.ran), str(tally.exercised),
                      rate_text(tally.failures, tally.exercised, tally.failure_rate_upper_95), explained)
    console.print(table)
    _print_diagnosis(console, report.diagnosis)
    for counterexample in report.counterexamples:
        from m2po_oracle.judge.equivalence import format_mismatches

        shows = ", ".join(counterexample.checks or (counterexample.check,))
        cause = f"{counterexample.cause}: " if counterexample.cause else "unexplained: " if counterexample.check in unexplained else ""
        console.print(format_mismatches(list(counterexample.mismatches), batch=counterexample.batch, where=f"(minimal batch for {cause}{shows})",
                                        replay=counterexample.replay), highlight=False, markup=False, soft_wrap=True)
    _print_validation(console, report)
    _print_accepted(console, report)
    _print_output(console, report, every_line=args.verbosity > 0)
    _print_capture(console, report)
    _print_verdict(console, report)
    _write_reports(args, record, console)
    return report.exit_status


def _print_capture(console: Console, report) -> None:
    if report.capture:
        import shlex

        directory = report.capture["directory"]
        console.print(f"capture: {directory} ({report.capture['steps']} steps): {shlex.join(['m2po-oracle', 'audit', directory])}",
                      highlight=False, markup=False, soft_wrap=True)


_COLOURS = {"equivalent": "green", "equivalent-with-accepted": "green", "divergent": "red", "accepted-deviation-fixed": "red", "unusable": "red"}


def _print_verdict(console: Console, report) -> None:
    console.print(f"verdict: [bold {_COLOURS[report.verdict]}]{report.verdict}[/] in {report.duration_s:.1f} s")


def _print_accepted(console: Console, report) -> None:
    say = lambda text: console.print(text, highlight=False, markup=False, soft_wrap=True)  # noqa: E731
    for accepted in report.accepted:
        checks = report.accepted_shown[accepted.deviation]
        why = f" ({accepted.reason})" if accepted.reason else ""
        link = f" {accepted.link}" if accepted.link else ""
        if checks:
            say(f"accepted: {accepted.deviation}{why}{link}: explains {', '.join(checks)}")
        else:
            fate = "the run fails: remove it from accept" if report.strict_accept else "strict = false: reported only"
            say(f"accepted deviation {accepted.deviation} no longer shows on these {report.examples} {report.example_unit}: fixed? {fate}")


def _quiet_summary(args: argparse.Namespace, report, record: dict, console: Console) -> int:
    """-q: the verdict, each failing check with its explanation, the accepted deviations."""
    by_check = report.diagnosis.get("by_check", {})
    for name in report.failing_checks:
        explained = " + ".join(by_check.get(name, ())) or "unexplained"
        console.print(f"FAIL {name}: {report.tallies[name].failures} of {report.examples} ({explained})", highlight=False, markup=False, soft_wrap=True)
    if report.verdict == "unusable":  # the one thing to read: why no call returned a result
        why = report.load_error or next((m.summary.splitlines()[-1] for c in report.counterexamples for m in c.mismatches if m.check == "call"), "")
        console.print(f"  {why}", highlight=False, markup=False, soft_wrap=True)
    _print_accepted(console, report)
    _print_verdict(console, report)
    _write_reports(args, record, console, quiet=True)
    return report.exit_status


def _write_reports(args: argparse.Namespace, record: dict, console: Console, quiet: bool = False) -> None:
    if getattr(args, "json", None) is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2))
        if not quiet:
            console.print(f"JSON report: {args.json}")
    if getattr(args, "html", None) is not None:
        from m2po_oracle.report.html import write_html

        write_html(record, args.html)
        if not quiet:
            console.print(f"HTML report: {args.html}")


def _print_output(console: Console, report, every_line: bool = False) -> None:
    output = report.output
    if not output["lines"]:
        return
    console.print(f"the implementation printed {output['lines']} line(s) (captured; --show-output lets them through); the first:", highlight=False, soft_wrap=True)
    for line in output["first_lines"] if every_line else output["first_lines"][:5]:
        console.print(f"  | {line}", highlight=False, markup=False, soft_wrap=True)


def _bench(args: argparse.Namespace, console: Console) -> int:
    if args.audit:
        from m2po_oracle.bench.audit import main_audit

        return main_audit(args, console)
    import torch

    from m2po_oracle.bench.core import run_bench
    from m2po_oracle.report.bench_html import write_bench_html

    try:
        exponents = list(range(12, 25, 2)) if args.scaling else [int(x) for x in args.sizes.split(",")]
    except ValueError:
        Console(stderr=True).print(f"error: --sizes: expected comma-separated integers (log2 of token counts), got {args.sizes!r}", highlight=False, markup=False)
        return EXIT_UNUSABLE
    if any(not 1 <= e <= 30 for e in exponents):
        Console(stderr=True).print(f"error: --sizes: expected log2 token counts between 1 and 30, got {exponents}", highlight=False, markup=False)
        return EXIT_UNUSABLE
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = f"{args.repeats} interleaved repeats"
    selection = Table(title=f"selection on {args.device}, {torch.get_num_threads()} thread(s): {repeats} (medians)",
                      caption="identical: sort's, radix's and both forwards' masks agree, and the two forwards' losses")
    for column in ("tokens", "candidates", "sort ms", "radix ms", "floor ms", "sort / radix", "radix / floor", "identical"):
        selection.add_column(column, justify="right")
    forward = Table(title=f"core.m2po_loss forward on {args.device}: {repeats} (bests; selection = radix's best)")
    for column in ("tokens", "forward ms", "forward / selection", "sort / forward", "fused", "unfused ms", "unfused / forward",
                   "passes ms", "passes / selection", "forward / passes", "syncs / forward", "syncs / unfused"):
        forward.add_column(column, justify="right")

    def show(row):
        m, b = row["median_ms"], row["best_ms"]
        selection.add_row(f"{row['tokens']:,}", f"{row['candidates']:,}", f"{m['sort']:.2f}", f"{m['radix']:.2f}", f"{m['floor']:.3f}",
                          f"{row['sort_over_radix']:.1f}x", f"{row['radix_over_floor']:.1f}x", "yes" if row["identical"] else "[red]NO[/]")
        forward.add_row(f"{row['tokens']:,}", f"{b['forward']:.2f}", f"{row['forward_over_selection']:.2f}x", f"{row['sort_over_forward']:.1f}x",
                        "yes" if row["fused"] else "no", f"{b['unfused']:.2f}", f"{row['unfused_over_forward']:.2f}x", f"{b['passes']:.2f}",
                        f"{row['passes_over_selection']:.2f}x", f"{row['forward_over_passes']:.2f}x", str(row["syncs_per_forward"]),
                        str(row["syncs_per_unfused_forward"]))

    try:
        record = run_bench([1 << e for e in exponents], repeats=args.repeats, device=args.device, on_size=show)
    except ValueError as error:
        Console(stderr=True).print(f"error: {error}", highlight=False, markup=False)
        return EXIT_UNUSABLE
    console.print(selection)
    console.print(forward)
    console.print(f"fused CPU passes: {record['environment']['fused_passes']}", highlight=False, soft_wrap=True)
    if args.ranks:
        from m2po_oracle.bench.core import run_bench_across

        across = run_bench_across(args.ranks, 1 << max(exponents), repeats=args.repeats)
        record["across_ranks"] = across
        sent = {name: sum(v["bytes"] for v in t.values()) for name, t in across["traffic_rank0"].items()}
        calls = {name: sum(v["calls"] for v in t.values()) for name, t in across["traffic_rank0"].items()}
        m = across["median_ms"]
        console.print(f"{args.ranks} ranks x {1 << max(exponents):,} tokens (gloo): histogram rounds {m['histogram']:.1f} ms, "
                      f"{calls['histogram']} collectives, {sent['histogram']:,} bytes/rank; all-gather {m['all_gather']:.1f} ms, "
                      f"{calls['all_gather']} collectives, {sent['all_gather']:,} bytes/rank; ratio {m['all_gather'] / m['histogram']:.1f}x; "
                      f"identical: {'yes' if across['identical'] else 'NO'}", highlight=False, soft_wrap=True)
        per_rank = ", ".join(f"rank {r['rank']}: {r['syncs']} with {r['collectives']} collectives" for r in across["forward_syncs"])
        console.print(f"distributed m2po_loss forward, would-sync operators per rank: {per_rank}", highlight=False, soft_wrap=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2))
    if args.html:
        write_bench_html(record, args.html)
    identical = all(r["identical"] for r in record["rows"]) and record.get("across_ranks", {}).get("identical", True)
    return EXIT_EQUIVALENT if identical else EXIT_DIVERGENT


def _audit(args: argparse.Namespace, console: Console) -> int:
    """audit DIR: per step verdict, failing checks and diagnosis; exit 0 / 1 / 2 as compare."""
    from m2po_oracle.audit import DESCRIPTIONS, audit_capture

    import shlex

    report = audit_capture(args.directory, steps=set(args.step) if args.step else None, rollout_atol=args.rollout_atol,
                           policy_atol=args.policy_atol)
    say = lambda text: console.print(text, highlight=False, markup=False, soft_wrap=True)  # noqa: E731
    if args.step and not report.steps and not report.refused:
        _error(f"--step: no step {', '.join(map(str, args.step))} in the capture")
        return EXIT_UNUSABLE
    for problem in report.problems:
        say(f"problem: {problem}")
    if report.refused:
        _error(report.refused)
    for step in report.steps:
        failing = step.failing
        line = f"step {step.step}: {step.verdict}"
        if failing:
            line += f": FAIL {', '.join(failing)}"
        if step.diagnosis:
            line += f" (diagnosis: {' + '.join(step.diagnosis)})"
        if step.verdict == "unusable":
            line += f": {step.checks[0].summary}"
        say(line)
        for check in step.checks:
            if check.status == "fail":
                say(f"  [{check.name}] {check.summary}")
        for name in step.diagnosis:
            same = step.alternatives.get(name)
            say(f"  {name}: {DESCRIPTIONS.get(name, '')}" + (f" (identical on this step: {', '.join(same)})" if same else ""))
        if step.counterexample:
            _print_audit_table(say, step.counterexample)
        if step.verdict == "divergent":
            say(f"  replay: {shlex.join(['m2po-oracle', 'audit', str(args.directory), '--step', str(step.step)])}")
    worst = f"; worst step {report.worst_step}" if report.worst_step is not None else ""
    say(f"verdict: {report.verdict} ({len(report.steps)} step(s), {len(report.problems)} problem(s){worst})")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report.to_json(), indent=2))
    if args.html is not None:
        from m2po_oracle.report.audit_html import write_audit_html

        write_audit_html(report.to_json(), args.html)
    return report.exit_status


def _print_audit_table(say: Any, table: dict[str, Any], rows: int = 8) -> None:
    """The first rows of the worst step's counterexample (the HTML and the JSON have them all)."""
    say(f"  counterexample ({table['check']}): {table['shown']} of {table['of']}: {table['note']}")
    for t in table["tokens"][:rows]:
        grad = "not captured" if t["grad"] is None else f"{t['grad']:.6g}"
        compared = f", {t['compared']['what']}: {t['compared']['captured']!r} vs {t['compared']['expected']!r}" if "compared" in t else ""
        say(f"    row {t['row']} position {t['position']} (rank {t['rank']}, micro-batch {t['micro_batch']}): d {t['d']:.6g}, "
            f"A {t['advantage']:.6g}, keep {t['keep']} (Algorithm 1: {t['algorithm_1_keeps']}), grad {grad} "
            f"(expected {t['expected_grad']:.6g}){compared}")
    for value in table["values"][:rows]:
        say(f"    {value['where']}: {value['name']} = {value['captured']!r}, expected {value['expected']!r}")


def _selftest(args: argparse.Namespace, console: Console) -> int:
    from m2po_oracle.cli.selftest import run_selftest, select_controls, spread

    try:
        controls = select_controls(args.only.split(",") if args.only else None, trainer=args.trainer, distributed=args.distributed)
    except ValueError as error:
        _error(str(error))
        return EXIT_UNUSABLE
    examples, seed = args.examples or 500, args.seed or 0
    seeds = f"seeds {seed}..{seed + args.seeds - 1}" if args.seeds > 1 else f"seed {seed}"
    each = "each at its own number of examples (--quick)" if args.quick else f"{examples} examples each"
    table = Table(title=f"selftest: {len(controls)} negative controls, {each}, {seeds}")
    columns = ("control", "status", "first failing example" + (" (min / median / max)" if args.seeds > 1 else ""), "caught by", "diagnosis", "seconds")
    for column in columns:
        table.add_column(column)
    with console.status("running the battery against the negative controls") as status:
        def show(row):
            status.update(f"{row.control}: {row.status}")
            first = spread(row.first_failures) if args.seeds > 1 else str(row.examples_needed or "-")
            named = " + ".join(row.diagnosis) or "-"
            # Why a row is MISDIAGNOSED although it names the planted deviation: a check left over.
            named += "".join(f"; {label}: {', '.join(checks)}" for label, checks in
                             (("unexplained", row.unexplained), ("only partly explained", row.partly_explained)) if checks)
            table.add_row(row.control, row.status if row.status != "ok" else "[green]ok[/]", first,
                          ", ".join(row.caught_by) or "-", named, f"{row.seconds:.1f}")
        started = time.perf_counter()
        rows = run_selftest(controls, examples=examples, seed=seed, seeds=args.seeds, on_row=show, quick=args.quick, jobs=args.jobs)
        wall = time.perf_counter() - started
    console.print(table)
    bad = [r for r in rows if r.status != "ok"]
    total = sum(r.seconds for r in rows)
    jobs = f" ({total:.1f} s over {args.jobs} processes)" if args.jobs > 1 else ""
    console.print(f"{len(rows) - len(bad)}/{len(rows)} controls caught and named in {wall:.1f} s{jobs}", highlight=False)
    return EXIT_DIVERGENT if bad else EXIT_EQUIVALENT


def _print_validation(console: Console, report) -> None:
    if report.validation_not_run:
        console.print(f"validation: not run: {report.validation_not_run}", highlight=False, soft_wrap=True)
        return
    warnings = report.validation_warnings
    ran = [p for p in report.validation if p.ran]
    not_run = [p for p in report.validation if not p.ran]
    warned = [p.probe for p in ran if p.expected == "warned"]
    skipped = f" ({len(not_run)} not run: {', '.join(p.probe for p in not_run)})" if not_run else ""
    run = " run" if not_run else ""
    if not ran:  # nothing to claim: no probe's answer can be told
        console.print(f"validation: no invalid-input probe could run{skipped}", highlight=False, soft_wrap=True)
    elif not warnings:
        also = f"; {', '.join(warned)} allowed with a warning, as required" if warned else ""
        console.print(f"validation: all {len(ran) - len(warned)} invalid-input probes{run} were rejected (fails closed){also}{skipped}",
                      highlight=False, soft_wrap=True)
    else:
        label = "counted as divergence (--strict-validation)" if report.strict_validation else "warnings; the verdict is unchanged (use --strict-validation to count them)"
        console.print(f"validation: {len(warnings)} of {len(ran)} probes{run} were not handled as required{skipped}, {label}:", highlight=False, soft_wrap=True)
        for p in warnings:
            console.print(f"  - {p.probe} ({p.description}): {p.status} (expected: {p.expected}): {p.message}", highlight=False, markup=False, soft_wrap=True)
    for p in not_run:
        console.print(f"  - {p.probe} ({p.description}): not run: {p.message}", highlight=False, markup=False, soft_wrap=True)


def _print_diagnosis(console: Console, diagnosis: dict) -> None:
    status = diagnosis.get("status")
    if status not in ("matched", "mostly_explained", "partly_explained", "no_known_variant"):
        return
    say = lambda text: console.print(text, highlight=False, markup=False, soft_wrap=True)  # noqa: E731
    say(f"diagnosis: {diagnosis.get('summary') or status}")
    for m in diagnosis.get("matches", []):
        say(f"  - {m['variant']}: {m['description']} [{m['source']}] ({m.get('evidence', '')})")
    for residual in diagnosis.get("residuals", []):
        features = ", ".join(f"{f['feature']} {f['residual']}/{f['of']} (vs {f['explained']}/{f['explained_of']} explained)"
                             for f in residual.get("features", [])) or "no feature of the list"
        contradicted = (f", {residual['contradicted']} of them contradicted (Algorithm 1 reproduces the port there, the explanation does not)"
                        if residual.get("contradicted") else "")
        if residual.get("float32_fits"):
            against = " + ".join(residual.get("explanation") or []) or "Algorithm 1"
            contradicted += f"; {residual['float32_fits']} within float32 rounding of {against}'s values"
        lead = "unexplained" if residual.get("unexplained") else "residual of"
        say(f"  {lead} {', '.join(residual['checks'])}: {residual['count']} example(s) not reproduced{contradicted}; features: {features}")
        example = residual.get("counterexample") or {}
        if example.get("difference"):
            say(f"    smallest: {example['difference']}")
        if example.get("replay"):
            say(f"    replay: {example['replay']}")
    for alternative in diagnosis.get("alternatives", []):
        say(f"  equally small: {' + '.join(alternative)} ({diagnosis.get('alternatives_reason') or ALIKE})")
    for hint in diagnosis.get("hints", []):
        say(f"  hint: {hint['text']}" + (f"; to accept it: {hint['option']}" if hint.get("option") else ""))
    for finding in diagnosis.get("findings", []):
        say(f"  finding: {finding['summary']}")
    if diagnosis.get("closest"):
        searched = diagnosis.get("examples_searched", diagnosis["examples_compared"])
        say(f"  leads for the unexplained (searched on the first {searched} of the {diagnosis['examples_compared']} examples compared):")
        for c in diagnosis["closest"]:
            if c.get("check"):  # the explanation's own share, below the threshold that names it
                say(f"  - {c['variant']}: {c['description']}")
            else:
                say(f"  - {c['variant']} alone reproduces {c['agreed']} of the {c['of']} divergent examples; first difference: {c['first_difference']}")


def _replay(args: argparse.Namespace, runner, console: Console) -> int:
    from m2po_oracle.judge.equivalence import format_mismatches

    text = args.source if args.source is not None else args.batch
    if text is None or (args.source is not None and args.batch is not None):
        _error("replay: give exactly one of SOURCE or --batch")
        return EXIT_UNUSABLE
    path = Path(text)
    try:
        if not text.lstrip().startswith("{") and path.is_file():
            text = path.read_text()
        data = json.loads(text)
        # A step runner whose input is not a batch (the trainer) replays its own input records.
        key = runner.example_key()
        if "counterexamples" in data:  # a compare report: replay each of its counterexamples
            examples = [runner.parse_example(c[key]) for c in data["counterexamples"]]
        else:
            examples = [runner.parse_example(data)]
    except (OSError, ValueError, KeyError, TypeError) as error:
        _error(f"batch: expected JSON of a batch or a compare report, or a path to one: {error}")
        return EXIT_UNUSABLE
    status = EXIT_EQUIVALENT
    for example in examples:
        outcome = runner.run_battery(example)
        if outcome.mismatches:
            status = EXIT_DIVERGENT
            console.print(format_mismatches(list(outcome.mismatches), batch=outcome.batch, where=f"for {args.impl!r}"), highlight=False, markup=False, soft_wrap=True)
            if outcome.explained_by:
                console.print(f"explained by: {', '.join(outcome.explained_by)}", highlight=False)
        else:
            console.print(f"all checks pass on the batch of shape {outcome.batch.shape} (tau {outcome.batch.tau})")
    return status

