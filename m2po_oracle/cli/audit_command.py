"""``m2po-oracle audit DIR``: each recorded step's verdict, failing checks and diagnosis."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console

from m2po_oracle.audit import audit_capture
from m2po_oracle.cli.console import say_error
from m2po_oracle.errors import EXIT_UNUSABLE
from m2po_oracle.oracle.encoding import write_json
from m2po_oracle.report.audit_html import write_audit_html


def audit(args: argparse.Namespace, console: Console) -> int:
    """audit DIR: per step verdict, failing checks and diagnosis; exit 0 / 1 / 2 as compare."""
    report = audit_capture(
        args.directory, steps=set(args.step) if args.step else None, rollout_atol=args.rollout_atol, policy_atol=args.policy_atol
    )
    record = report.to_json()
    capture = record["capture"]
    if args.step and not record["steps"] and not capture["refused"]:
        say_error(f"--step: no step {', '.join(map(str, args.step))} in the capture")
        return EXIT_UNUSABLE
    print_audit(console, record, str(args.directory))
    if args.json is not None:
        write_json(record, args.json)
    if args.html is not None:
        write_audit_html(record, args.html)
    return report.exit_status


def print_audit(console: Console, record: dict[str, Any], directory: str) -> None:
    """The audit's console report, from its JSON record alone (as its HTML page)."""
    import shlex

    say = lambda text: console.print(text, highlight=False, markup=False, soft_wrap=True)  # noqa: E731
    capture, descriptions = record["capture"], record["descriptions"]
    for problem in capture["problems"]:
        say(f"problem: {problem}")
    if capture["refused"]:
        say_error(capture["refused"])
    for step in record["steps"]:
        failing = [c["name"] for c in step["checks"] if c["status"] == "fail"]
        line = f"step {step['step']}: {step['verdict']}"
        if failing:
            line += f": FAIL {', '.join(failing)}"
        if step["diagnosis"]:
            line += f" (diagnosis: {' + '.join(step['diagnosis'])})"
        if step["verdict"] == "unusable":
            line += f": {step['checks'][0]['summary']}"
        say(line)
        for check in step["checks"]:
            if check["status"] == "fail":
                say(f"  [{check['name']}] {check['summary']}")
        for name in step["diagnosis"]:
            same = step["alternatives"].get(name)
            say(f"  {name}: {descriptions.get(name, '')}" + (f" (identical on this step: {', '.join(same)})" if same else ""))
        for observation in step["observations"]:
            say(f"  {observation}")
        if step.get("counterexample"):
            _print_audit_table(say, step["counterexample"])
        if step["verdict"] == "divergent":
            say(f"  replay: {shlex.join(['m2po-oracle', 'audit', directory, '--step', str(step['step'])])}")
    worst = f"; worst step {record['worst_step']}" if record["worst_step"] is not None else ""
    say(f"verdict: {record['verdict']} ({len(record['steps'])} step(s), {len(capture['problems'])} problem(s){worst})")


def _print_audit_table(say: Any, table: dict[str, Any], rows: int = 8) -> None:
    """The first rows of the worst step's counterexample (the HTML and the JSON have them all)."""
    say(f"  counterexample ({table['check']}): {table['shown']} of {table['of']}: {table['note']}")
    for t in table["tokens"][:rows]:
        grad = "not captured" if t["grad"] is None else f"{t['grad']:.6g}"
        compared = f", {t['compared']['what']}: {t['compared']['captured']!r} vs {t['compared']['expected']!r}" if "compared" in t else ""
        say(
            f"    row {t['row']} position {t['position']} (rank {t['rank']}, micro-batch {t['micro_batch']}): d {t['d']:.6g}, "
            f"A {t['advantage']:.6g}, keep {t['keep']} (Algorithm 1: {t['algorithm_1_keeps']}), grad {grad} "
            f"(expected {t['expected_grad']:.6g}){compared}"
        )
    for value in table["values"][:rows]:
        say(f"    {value['where']}: {value['name']} = {value['captured']!r}, expected {value['expected']!r}")
