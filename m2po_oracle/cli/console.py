"""What ``compare`` and ``replay`` print on the console, from the run's report."""

from __future__ import annotations

from rich.console import Console

from m2po_oracle.explain.diagnosis import ALIKE


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


def print_capture(console: Console, report) -> None:
    if report.capture:
        import shlex

        directory = report.capture["directory"]
        console.print(f"capture: {directory} ({report.capture['steps']} steps): {shlex.join(['m2po-oracle', 'audit', directory])}",
                      highlight=False, markup=False, soft_wrap=True)


VERDICT_COLOURS = {"equivalent": "green", "equivalent-with-accepted": "green", "divergent": "red", "accepted-deviation-fixed": "red", "unusable": "red"}


def print_verdict(console: Console, report) -> None:
    console.print(f"verdict: [bold {VERDICT_COLOURS[report.verdict]}]{report.verdict}[/] in {report.duration_s:.1f} s")


def print_accepted(console: Console, report) -> None:
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


def print_output(console: Console, report, every_line: bool = False) -> None:
    output = report.output
    if not output["lines"]:
        return
    console.print(f"the implementation printed {output['lines']} line(s) (captured; --show-output lets them through); the first:", highlight=False, soft_wrap=True)
    for line in output["first_lines"] if every_line else output["first_lines"][:5]:
        console.print(f"  | {line}", highlight=False, markup=False, soft_wrap=True)


def print_validation(console: Console, report) -> None:
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


def print_diagnosis(console: Console, diagnosis: dict) -> None:
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
