"""``m2po-oracle checks`` and ``adapters``: what the battery checks, and every adapter."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from m2po_oracle.errors import EXIT_EQUIVALENT
from m2po_oracle.judge.checks import ALL_CHECKS, AUDIT_CHECKS, CHECKS, DISTRIBUTED_CHECKS


def list_checks(console: Console) -> int:
    """Every check of the battery, with what runs it and what it asserts."""
    table = Table("check", "runs for", "asserts")
    for name, description in ALL_CHECKS.items():
        runs_for = (
            "every run"
            if name == "call"
            else "a loss function"
            if name in CHECKS
            else "--topology"
            if name in DISTRIBUTED_CHECKS
            else "m2po-oracle audit"
            if name in AUDIT_CHECKS
            else "--impl trainer"
        )
        table.add_row(name, runs_for, description)
    console.print(table)
    return EXIT_EQUIVALENT


def list_adapters(console: Console) -> int:
    """Every adapter (``--adapter NAME``): the port's signature, the roles ``--bind`` moves,
    what is read back, which checks it can run and which it cannot (with why)."""
    from m2po_oracle.adapters import ADAPTERS, binding  # torch: here, so that ``checks`` stays a quick listing

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
    prefixes = ", ".join(repr(p) for p in binding.METRIC_PREFIXES)
    aliases = ", ".join(f"{k} -> {v}" for k, v in binding.METRIC_ALIASES.items())
    say(
        f"Metric names mapped from a returned mapping: our names (m2_before, m2_after, masked_fraction, trust_region_fraction, valid_count, "
        f"trust_region_count, kept_trust_region_count) after any 'prefix/' and {prefixes}; {aliases}. Other keys are not read."
    )
    say(
        "--bind KEY=VALUE (repeatable): KEY a role -> where it goes (a parameter name, a 0-based position, or PARAMETER.ATTRIBUTE); "
        "KEY a constant -> its value; KEY an output (loss, keep, per_token_loss, metrics or a metric name) -> where it is in the return "
        "(an index, a key, or a path such as 4.M2_after); any other KEY -> an extra keyword argument. Values are Python literals, else strings."
    )
    return EXIT_EQUIVALENT
