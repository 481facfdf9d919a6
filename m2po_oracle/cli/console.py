"""What ``compare`` prints on the console, read from the run's JSON record alone (as the HTML is)."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.markup import escape

from m2po_oracle.compare.report import mismatch_from_json
from m2po_oracle.explain.diagnosis import ALIKE
from m2po_oracle.explain.record import EXPLAINING
from m2po_oracle.judge.coverage import THINLY_EXERCISED, rate_text, thinly_exercised
from m2po_oracle.judge.equivalence import format_mismatches
from m2po_oracle.oracle.batch import Batch
from m2po_oracle.report.values import as_float


def metric_sources_text(sources: dict[str, str]) -> str:
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


def say_error(message: str) -> None:
    Console(stderr=True).print(f"error: {message}", highlight=False, markup=False, soft_wrap=True)


def say_note(message: str) -> None:
    """Something the user should know before the run's result (on stderr: the report stays clean)."""
    Console(stderr=True).print(f"note: {message}", highlight=False, markup=False, soft_wrap=True)


def print_capture(console: Console, record: dict[str, Any]) -> None:
    capture = record.get("capture")
    if capture:
        import shlex

        console.print(
            f"capture: {capture['directory']} ({capture['steps']} steps): {shlex.join(['m2po-oracle', 'audit', capture['directory']])}",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )


VERDICT_COLOURS = {
    "equivalent": "green",
    "equivalent-with-accepted": "green",
    "divergent": "red",
    "accepted-deviation-fixed": "red",
    "unusable": "red",
}


def print_verdict(console: Console, record: dict[str, Any]) -> None:
    thin = thinly_exercised(record.get("checks", []))
    note = f" (thinly exercised, a pass on fewer than {THINLY_EXERCISED} examples: {', '.join(thin)})" if thin else ""
    verdict, seconds = record["verdict"], as_float(record.get("duration_s"))
    took = f"{seconds:.1f} s" if seconds is not None and math.isfinite(seconds) else f"{record.get('duration_s')} s"
    console.print(f"verdict: [bold {VERDICT_COLOURS.get(verdict, 'yellow')}]{verdict}[/] in {took}{escape(note)}")


def print_accepted(console: Console, record: dict[str, Any]) -> None:
    say = lambda text: console.print(text, highlight=False, markup=False, soft_wrap=True)  # noqa: E731
    for accepted in record["accepted"]:
        why = f" ({accepted['reason']})" if accepted["reason"] else ""
        link = f" {accepted['link']}" if accepted["link"] else ""
        if accepted["shown"]:
            say(f"accepted: {accepted['deviation']}{why}{link}: explains {', '.join(accepted['checks'])}")
        else:
            fate = "the run fails: remove it from accept" if record["strict_accept"] else "strict = false: reported only"
            say(
                f"accepted deviation {accepted['deviation']} no longer shows on these {record['examples']} {record['example_unit']}: fixed? {fate}"
            )


def print_output(console: Console, record: dict[str, Any], every_line: bool = False) -> None:
    output = record["implementation_output"]
    if not output["lines"]:
        return
    console.print(
        f"the implementation printed {output['lines']} line(s) (captured; --show-output lets them through); the first:",
        highlight=False,
        soft_wrap=True,
    )
    for line in output["first_lines"] if every_line else output["first_lines"][:5]:
        console.print(f"  | {line}", highlight=False, markup=False, soft_wrap=True)


def print_validation(console: Console, record: dict[str, Any]) -> None:
    validation = record["validation"]
    if validation["not_run"]:
        console.print(f"validation: not run: {validation['not_run']}", highlight=False, soft_wrap=True)
        return
    probes = validation["probes"]
    ran = [p for p in probes if p["status"] != "not run"]
    not_run = [p for p in probes if p["status"] == "not run"]
    warnings = [p for p in ran if p["status"] != p["expected"]]
    warned = [p["probe"] for p in ran if p["expected"] == "warned"]
    skipped = f" ({len(not_run)} not run: {', '.join(p['probe'] for p in not_run)})" if not_run else ""
    run = " run" if not_run else ""
    if not ran:  # nothing to claim: no probe's answer can be told
        console.print(f"validation: no invalid-input probe could run{skipped}", highlight=False, soft_wrap=True)
    elif not warnings:
        also = f"; {', '.join(warned)} allowed with a warning, as required" if warned else ""
        console.print(
            f"validation: all {len(ran) - len(warned)} invalid-input probes{run} were rejected (fails closed){also}{skipped}",
            highlight=False,
            soft_wrap=True,
        )
    else:
        label = (
            "counted as divergence (--strict-validation)"
            if validation["strict"]
            else "warnings; the verdict is unchanged (use --strict-validation to count them)"
        )
        console.print(
            f"validation: {len(warnings)} of {len(ran)} probes{run} were not handled as required{skipped}, {label}:",
            highlight=False,
            soft_wrap=True,
        )
        for p in warnings:
            console.print(
                f"  - {p['probe']} ({p['description']}): {p['status']} (expected: {p['expected']}): {p['message']}",
                highlight=False,
                markup=False,
                soft_wrap=True,
            )
    for p in not_run:
        console.print(f"  - {p['probe']} ({p['description']}): not run: {p['message']}", highlight=False, markup=False, soft_wrap=True)


def print_diagnosis(console: Console, diagnosis: dict[str, Any]) -> None:
    status = diagnosis.get("status")
    if status not in EXPLAINING:
        return
    say = lambda text: console.print(text, highlight=False, markup=False, soft_wrap=True)  # noqa: E731
    say(f"diagnosis: {diagnosis.get('summary') or status}")
    for m in diagnosis.get("matches", []):
        say(f"  - {m['variant']}: {m['description']} [{m['source']}] ({m.get('evidence', '')})")
    for residual in diagnosis.get("residuals", []):
        features = (
            ", ".join(
                f"{f['feature']} {f['residual']}/{f['of']}"
                # Beside nothing explained, a count "where explained" is 0/0: said only where there is a comparison.
                + (f" (vs {f['explained']}/{f['explained_of']} explained)" if f.get("explained_of") else "")
                for f in residual.get("features", [])
            )
            or "no feature of the list"
        )
        contradicted = (
            f", {residual['contradicted']} of them contradicted (Algorithm 1 reproduces the port there, the explanation does not)"
            if residual.get("contradicted")
            else ""
        )
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
        say(
            f"  leads for the unexplained (searched on {searched} of the {diagnosis['examples_compared']} examples compared, "
            "the rest held out):"
        )
        for c in diagnosis["closest"]:
            if c.get("check"):  # the explanation's own share, below the threshold that names it
                say(f"  - {c['variant']}: {c['description']}")
            else:
                say(
                    f"  - {c['variant']} alone reproduces {c['agreed']} of the {c['of']} divergent examples; first difference: {c['first_difference']}"
                )


def _say(console: Console) -> Any:
    return lambda text: console.print(text, highlight=False, markup=False, soft_wrap=True)


def _batch(data: dict[str, Any]) -> Batch | None:
    """The counterexample's batch, or None where the report's is no batch (ragged, empty): the
    console still prints the mismatches and the replay."""
    try:
        return Batch.from_dict(data)
    except (ValueError, TypeError):
        return None


def _counterexample_text(c: dict[str, Any], unexplained: set[str]) -> str:
    checks = c.get("checks") or [c["check"]]
    cause = f"{c['cause']}: " if c.get("cause") else "unexplained: " if c["check"] in unexplained else ""
    text = format_mismatches(
        [mismatch_from_json(m) for m in c["mismatches"]],
        batch=_batch(c["batch"]),
        where=f"(minimal batch for {cause}{', '.join(checks)})",
        replay=c["replay"],
    )
    return text + (f"\nnot minimal for certain: {c['shrink_stopped']}" if c.get("shrink_stopped") else "")


def print_report(console: Console, record: dict[str, Any], impl: str, every_line: bool = False) -> None:
    """The whole console report of a compare run, from its JSON record."""
    from rich.table import Table

    say = _say(console)
    options, unit = record["options"], record["example_unit"]
    if options.get("dtype_why"):
        say(f"dtype: {options['dtype']} ({options['dtype_why']})")
    adapter = record.get("adapter")
    if adapter:
        skipped = [check for check in adapter.get("not_run", {}) if not check.startswith("metrics.")]
        say(
            f"adapter {adapter['name']} ({adapter['signature']}): checks {', '.join(adapter['checked'])}"
            + (f"; not run (the adapter, not the port, decides them): {', '.join(skipped)}" if skipped else "")
            + (f"; call: {adapter['call']}" if adapter.get("call") else "")
        )
        if adapter.get("metrics_read"):
            say(f"metrics read from the port: {metric_sources_text(adapter['metrics_read'])}")
    if record["verdict"] == "unusable":
        console.print(
            f"[bold red]unusable[/]: no call returned a usable result on {record['examples']} {unit}; no check other than 'call' ran",
            soft_wrap=True,
        )
    if record["stopped_early"]:
        console.print(
            f"stopped early after {record['examples']} of {options['examples']} {unit}: {record['stopped_early']}",
            highlight=False,
            soft_wrap=True,
        )
    coverage = record["coverage"]
    families = ", ".join(f"{name} {count}" for name, count in coverage["families"].items())
    features = ", ".join(f"{name} {count}" for name, count in coverage["features"].items())
    table = Table(
        title=f"{impl} vs Algorithm 1 ({record['examples']} {unit}, {options['dtype']}, seed {options['seed']})",
        caption=(
            f"exercised: {unit} that could have failed the check; failure rate: observed, and its one-sided 95% "
            f"Clopper-Pearson upper bound\nfamilies: {families or '-'}\nfeatures (of {coverage['judged']} judged): {features}"
        ),
    )
    for column in ("check", "result"):
        table.add_column(column)
    for column in (f"failing {unit}", f"{unit} checked", "exercised", "failure rate (95%)"):
        table.add_column(column, justify="right")
    table.add_column("explained by")
    labels = {"fail": "[red]FAIL[/]", "pass": "[green]pass[/]", "not run": "[yellow]not run[/]"}
    diagnosis = record["diagnosis"]
    by_check, unexplained = diagnosis.get("by_check", {}), set(diagnosis.get("unexplained", ()))
    for c in record["checks"]:
        explained = " + ".join(by_check.get(c["name"], ())) or ("[yellow]unexplained[/]" if c["name"] in unexplained else "")
        table.add_row(
            c["name"],
            labels[c["status"]],
            str(c["failures"]),
            str(c["ran"]),
            str(c["exercised"]),
            rate_text(c["failures"], c["exercised"], c["failure_rate_upper_95"]),
            explained,
        )
    console.print(table)
    print_diagnosis(console, diagnosis)
    for c in record["counterexamples"]:
        say(_counterexample_text(c, unexplained))
    print_validation(console, record)
    print_accepted(console, record)
    print_output(console, record, every_line=every_line)
    print_capture(console, record)
    print_verdict(console, record)


def print_quiet(console: Console, record: dict[str, Any]) -> None:
    """-q: the verdict, each failing check with its explanation, the accepted deviations."""
    say = _say(console)
    by_check = record["diagnosis"].get("by_check", {})
    for c in record["checks"]:
        if c["status"] == "fail":
            say(f"FAIL {c['name']}: {c['failures']} of {record['examples']} ({' + '.join(by_check.get(c['name'], ())) or 'unexplained'})")
    if record["verdict"] == "unusable":  # the one thing to read: why no call returned a result
        why = record["load_error"] or next(
            (m["summary"].splitlines()[-1] for c in record["counterexamples"] for m in c["mismatches"] if m["check"] == "call"), ""
        )
        say(f"  {why}")
    print_accepted(console, record)
    print_verdict(console, record)
