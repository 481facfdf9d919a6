"""``m2po-oracle bench``: the selection and forward benchmark (``--audit``: the audit's)."""

from __future__ import annotations

import argparse

import torch
from rich.console import Console
from rich.table import Table

from m2po_oracle.bench.audit import main_audit
from m2po_oracle.bench.core import run_bench, run_bench_across
from m2po_oracle.errors import EXIT_DIVERGENT, EXIT_EQUIVALENT, EXIT_UNUSABLE
from m2po_oracle.oracle.encoding import write_json
from m2po_oracle.report.bench_html import write_bench_html


def bench(args: argparse.Namespace, console: Console) -> int:
    if args.audit:
        return main_audit(args, console)
    try:
        exponents = list(range(12, 25, 2)) if args.scaling else [int(x) for x in args.sizes.split(",")]
    except ValueError:
        Console(stderr=True).print(
            f"error: --sizes: expected comma-separated integers (log2 of token counts), got {args.sizes!r}", highlight=False, markup=False
        )
        return EXIT_UNUSABLE
    if any(not 1 <= e <= 30 for e in exponents):
        Console(stderr=True).print(
            f"error: --sizes: expected log2 token counts between 1 and 30, got {exponents}", highlight=False, markup=False
        )
        return EXIT_UNUSABLE
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = f"{args.repeats} interleaved repeats"
    selection = Table(
        title=f"selection on {args.device}, {torch.get_num_threads()} thread(s): {repeats} (medians)",
        caption="identical: sort's, radix's and both forwards' masks agree, and the two forwards' losses",
    )
    for column in ("tokens", "candidates", "sort ms", "radix ms", "floor ms", "sort / radix", "radix / floor", "identical"):
        selection.add_column(column, justify="right")
    forward = Table(title=f"core.m2po_loss forward on {args.device}: {repeats} (bests; selection = radix's best)")
    for column in (
        "tokens",
        "forward ms",
        "forward / selection",
        "sort / forward",
        "fused",
        "unfused ms",
        "unfused / forward",
        "passes ms",
        "passes / selection",
        "forward / passes",
        "syncs / forward",
        "syncs / unfused",
    ):
        forward.add_column(column, justify="right")

    def show(row):
        m, b = row["median_ms"], row["best_ms"]
        selection.add_row(
            f"{row['tokens']:,}",
            f"{row['candidates']:,}",
            f"{m['sort']:.2f}",
            f"{m['radix']:.2f}",
            f"{m['floor']:.3f}",
            f"{row['sort_over_radix']:.1f}x",
            f"{row['radix_over_floor']:.1f}x",
            "yes" if row["identical"] else "[red]NO[/]",
        )
        forward.add_row(
            f"{row['tokens']:,}",
            f"{b['forward']:.2f}",
            f"{row['forward_over_selection']:.2f}x",
            f"{row['sort_over_forward']:.1f}x",
            "yes" if row["fused"] else "no",
            f"{b['unfused']:.2f}",
            f"{row['unfused_over_forward']:.2f}x",
            f"{b['passes']:.2f}",
            f"{row['passes_over_selection']:.2f}x",
            f"{row['forward_over_passes']:.2f}x",
            str(row["syncs_per_forward"]),
            str(row["syncs_per_unfused_forward"]),
        )

    try:
        record = run_bench([1 << e for e in exponents], repeats=args.repeats, device=args.device, on_size=show)
    except ValueError as error:
        Console(stderr=True).print(f"error: {error}", highlight=False, markup=False)
        return EXIT_UNUSABLE
    console.print(selection)
    console.print(forward)
    console.print(f"fused CPU passes: {record['environment']['fused_passes']}", highlight=False, soft_wrap=True)
    if args.ranks:
        across = run_bench_across(args.ranks, 1 << max(exponents), repeats=args.repeats)
        record["across_ranks"] = across
        sent = {name: sum(v["bytes"] for v in t.values()) for name, t in across["traffic_rank0"].items()}
        calls = {name: sum(v["calls"] for v in t.values()) for name, t in across["traffic_rank0"].items()}
        m = across["median_ms"]
        console.print(
            f"{args.ranks} ranks x {1 << max(exponents):,} tokens (gloo): histogram rounds {m['histogram']:.1f} ms, "
            f"{calls['histogram']} collectives, {sent['histogram']:,} bytes/rank; all-gather {m['all_gather']:.1f} ms, "
            f"{calls['all_gather']} collectives, {sent['all_gather']:,} bytes/rank; ratio {m['all_gather'] / m['histogram']:.1f}x; "
            f"identical: {'yes' if across['identical'] else 'NO'}",
            highlight=False,
            soft_wrap=True,
        )
        per_rank = ", ".join(f"rank {r['rank']}: {r['syncs']} with {r['collectives']} collectives" for r in across["forward_syncs"])
        console.print(f"distributed m2po_loss forward, would-sync operators per rank: {per_rank}", highlight=False, soft_wrap=True)
    if args.json:
        write_json(record, args.json)
    if args.html:
        write_bench_html(record, args.html)
    identical = all(r["identical"] for r in record["rows"]) and record.get("across_ranks", {}).get("identical", True)
    return EXIT_EQUIVALENT if identical else EXIT_DIVERGENT
