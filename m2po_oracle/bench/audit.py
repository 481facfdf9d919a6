"""``m2po-oracle bench --audit``: how long the offline audit takes on a realistic step.

Writes a synthetic capture of ONE optimizer step in a temporary directory (the way a
pure data-parallel run records it, :class:`m2po_oracle.capture.Recorder`), then audits it
in a fresh Python process, so that the peak memory measured is the audit's alone (its
imports included), and reports the wall time of :func:`m2po_oracle.audit.audit_capture`
(and its user and system CPU time), that process's peak RSS (``VmHWM``), the verdict and
the capture's size on disk. The same step is written twice:

* ``correct``: ``keep`` is the project's own selection (:func:`core.select_micro_batches`)
  over the whole optimizer batch, split per micro-batch; must come out "equivalent";
* ``planted``: one micro-batch's ``keep`` selected on that micro-batch alone (a per-
  micro-batch mask, its loss and gradient computed on it with the global N); must come
  out "divergent".

The step: ``dp = 4`` ranks x 2 micro-batches, rows x T (T = 4096) float32 tensors, about
10 % padding at row ends (zeros), one GRPO advantage per sequence broadcast over its row,
a stale rollout (d = logp - behavior_logp about N(0, 0.05^2), 3 % of tokens with
|d| in [0.5, 2], so the selection masks some of them), each micro-batch's loss its global-N
share ``-(1/N) sum keep exp(d) A``, its gradient passed to ``record(grad=...)`` and the
optimizer batch's metrics logged. The capture's files are in the page cache when the audit
reads them (just written): the figures are the audit's compute, not a cold disk.

The audit's performance target (a 16M-token step in under 30 s and 4 GiB) is printed as an
observation, never asserted: timings on a shared machine are not a test.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import m2po_oracle
from m2po_oracle.capture.recorder import Recorder
from m2po_oracle.core.loss import loss_from_selection, select_micro_batches, select_tokens
from m2po_oracle.errors import EXIT_DIVERGENT, EXIT_EQUIVALENT, EXIT_UNUSABLE
from m2po_oracle.oracle.encoding import write_json
from m2po_oracle.records.bench import AUDIT_SCHEMA as SCHEMA

DEFAULT_TOKENS = 1 << 24
DP, MICRO_BATCHES, WIDTH, TAU = 4, 2, 4096, 0.04
TARGET_S, TARGET_BYTES = 30.0, 4 << 30

# The audit, alone in a fresh interpreter; prints one JSON line.
_CHILD = r"""
import json, os, resource, sys, time
def peak():
    # VmHWM: this address space's own high-water mark. (ru_maxrss is not, on Linux: the kernel
    # carries the parent's peak into a child across fork + exec, so it would report the
    # generator's.) ru_maxrss only where there is no /proc.
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
from m2po_oracle.audit import audit_capture
imported = peak()
before, started = os.times(), time.perf_counter()
report = audit_capture(sys.argv[1])
wall, after = time.perf_counter() - started, os.times()
steps = [{"step": s.step, "verdict": s.verdict, "failing": s.failing, "diagnosis": s.diagnosis} for s in report.steps]
print(json.dumps({"wall_s": wall, "cpu_user_s": after.user - before.user, "cpu_system_s": after.system - before.system,
                  "peak_rss_bytes": peak(), "rss_after_imports_bytes": imported, "verdict": report.verdict, "steps": steps}))
"""


def _layout(tokens: int) -> tuple[int, int]:
    """(rows per micro-batch, T): T = 4096 unless the step is too small for one row each."""
    parts = DP * MICRO_BATCHES
    width = min(WIDTH, max(1, tokens // parts))
    return max(1, tokens // (parts * width)), width


def synthetic_step(tokens: int, *, seed: int = 0) -> dict[str, Any]:
    """The tensors of one optimizer step: ``parts[(rank, mb)] = (logp, behavior, advantages, mask)``,
    the correct ``keep`` per part and the optimizer batch's selection."""
    import torch

    rows, width = _layout(tokens)
    generator = torch.Generator().manual_seed(seed)
    parts = {}
    for rank in range(DP):
        for mb in range(MICRO_BATCHES):
            behavior = -torch.empty(rows, width, dtype=torch.float64).exponential_(0.5, generator=generator)
            d = 0.05 * torch.randn(rows, width, generator=generator, dtype=torch.float64)
            stale = torch.rand(rows, width, generator=generator) < 0.03
            sign = torch.where(torch.rand(rows, width, generator=generator) < 0.5, -1.0, 1.0).double()
            d = torch.where(stale, sign * (0.5 + 1.5 * torch.rand(rows, width, generator=generator, dtype=torch.float64)), d)
            # About 10 % padding on average: each row's response ends 0 .. 20 % before T.
            lengths = width - torch.randint(0, max(1, width // 5) + 1, (rows, 1), generator=generator)
            mask = torch.arange(width).expand(rows, width) < lengths.clamp(min=1)
            advantages = torch.randn(rows, 1, generator=generator).expand(rows, width).contiguous()
            logp = torch.where(mask, behavior + d, 0.0).float()
            behavior = torch.where(mask, behavior, 0.0).float()
            parts[(rank, mb)] = (logp, behavior, advantages, mask)
            del d, stale, sign
    order = sorted(parts)
    selections = select_micro_batches([parts[key] for key in order], tau=TAU)
    return {"parts": parts, "order": order, "selections": dict(zip(order, selections)), "rows": rows, "width": width}


def _planted(step: dict[str, Any]) -> tuple[tuple[int, int], Any]:
    """The first micro-batch whose own selection differs from the optimizer batch's, and its keep."""

    for key in step["order"]:
        own = select_tokens(*step["parts"][key], tau=TAU).keep
        if not bool((own == step["selections"][key].keep).all()):
            return key, own
    raise ValueError("no micro-batch's own selection differs from the optimizer batch's: no planted bug possible at this size")


def write_capture(directory: Path, step: dict[str, Any], *, bug: tuple[tuple[int, int], Any] | None = None) -> None:
    import torch

    recorders = [Recorder(directory, rank=r, world_size=DP, topology=f"dp={DP},cp=1,tp=1") for r in range(DP)]
    for key in step["order"]:
        rank, mb = key
        logp0, behavior, advantages, mask = step["parts"][key]
        selection = step["selections"][key]
        keep = bug[1] if bug is not None and bug[0] == key else selection.keep
        logp = logp0.clone().requires_grad_()
        loss = loss_from_selection(logp, behavior, advantages, keep, selection.valid_count)
        (grad,) = torch.autograd.grad(loss, logp)
        metrics = {name: getattr(selection, name) for name in ("m2_before", "m2_after", "masked_fraction", "valid_count")}
        recorders[rank].record(
            step=0,
            micro_batch=mb,
            logp=logp.detach(),
            behavior_logp=behavior,
            advantages=advantages,
            mask=mask,
            keep=keep,
            loss=loss,
            tau=TAU,
            metrics=metrics,
            grad=grad,
        )


def _size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def audit_in_subprocess(directory: Path, *, timeout_s: float = 3600.0) -> dict[str, Any]:
    """Run :func:`audit_capture` on ``directory`` in a fresh interpreter; its figures as a dict.

    The child starts in the directory that holds this very ``m2po_oracle`` package (``-c``
    puts the working directory first on ``sys.path``), so it audits with the code the
    parent runs, whatever the caller's working directory."""

    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(Path(directory).resolve())],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=Path(m2po_oracle.__file__).resolve().parent.parent,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    process_s = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"the audit process exited with {done.returncode}: {done.stderr.strip()[-2000:]}")
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    figures["process_s"] = process_s
    return figures


def run_audit_bench(tokens: int = DEFAULT_TOKENS, *, seed: int = 0, directory: str | None = None, on_case: Any = None) -> dict[str, Any]:
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < DP * MICRO_BATCHES:
        raise ValueError(f"--tokens: expected an integer >= {DP * MICRO_BATCHES} (one token per micro-batch), got {tokens!r}")
    import torch

    started = time.perf_counter()
    step = synthetic_step(tokens, seed=seed)
    bug = _planted(step)
    first = step["selections"][step["order"][0]]
    shape = {
        "dp": DP,
        "micro_batches": MICRO_BATCHES,
        "rows_per_micro_batch": step["rows"],
        "T": step["width"],
        "tokens": DP * MICRO_BATCHES * step["rows"] * step["width"],
        "valid_count": int(first.valid_count),
        "trust_region_count": int(first.trust_region_count),
        "kept_trust_region_count": int(first.kept_trust_region_count),
        "m2_before": float(first.m2_before),
        "m2_after": float(first.m2_after),
        "masked_fraction": float(first.masked_fraction),
        "planted_micro_batch": {
            "rank": bug[0][0],
            "micro_batch": bug[0][1],
            "tokens_changed": int((bug[1] != step["selections"][bug[0]].keep).sum()),
        },
    }
    prepare_s = time.perf_counter() - started
    cases = []
    with tempfile.TemporaryDirectory(prefix="m2po-bench-audit-", dir=directory) as tmp:
        for name, planted, expected in (("correct", None, "equivalent"), ("planted", bug, "divergent")):
            path = Path(tmp) / name
            started = time.perf_counter()
            write_capture(path, step, bug=planted)
            write_s = time.perf_counter() - started
            figures = audit_in_subprocess(path)
            case = {
                "case": name,
                "expected": expected,
                "as_expected": figures["verdict"] == expected,
                "disk_bytes": _size(path),
                "write_s": write_s,
                **figures,
                "within_target": figures["wall_s"] < TARGET_S and figures["peak_rss_bytes"] < TARGET_BYTES,
            }
            cases.append(case)
            if on_case is not None:
                on_case(case)
            shutil.rmtree(path)  # one capture on disk at a time
    return {
        "schema": SCHEMA,
        "tau": TAU,
        "step": shape,
        "prepare_s": prepare_s,
        "cases": cases,
        "target": {"wall_s": TARGET_S, "peak_rss_bytes": TARGET_BYTES},
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
    }


def _gib(value: float) -> str:
    return f"{value / (1 << 30):.2f} GiB"


def main_audit(args: Any, console: Any) -> int:
    """The ``bench --audit`` command: the table, the target as an observation, ``--json``."""
    from rich.table import Table

    table = Table(title="audit_capture of one synthetic optimizer step (dp=4 x 2 micro-batches, float32), each in a fresh process")
    for column in (
        "case",
        "tokens",
        "on disk",
        "audit s",
        "cpu user s",
        "cpu sys s",
        "peak RSS",
        "RSS after imports",
        "verdict",
        "expected",
    ):
        table.add_column(column, justify="right")
    try:
        record = run_audit_bench(args.tokens)
    except (ValueError, RuntimeError) as error:  # a size too small to plant the bug; an audit process that failed
        from rich.console import Console

        Console(stderr=True).print(f"error: {error}", highlight=False, markup=False)
        return EXIT_UNUSABLE
    tokens = record["step"]["tokens"]
    for case in record["cases"]:
        table.add_row(
            case["case"],
            f"{tokens:,}",
            f"{case['disk_bytes'] / 1e6:,.1f} MB",
            f"{case['wall_s']:.2f}",
            f"{case['cpu_user_s']:.2f}",
            f"{case['cpu_system_s']:.2f}",
            _gib(case["peak_rss_bytes"]),
            _gib(case["rss_after_imports_bytes"]),
            case["verdict"] if case["as_expected"] else f"[red]{case['verdict']}[/]",
            case["expected"],
        )
    console.print(table)
    s = record["step"]
    console.print(
        f"step: {s['rows_per_micro_batch']} rows x T = {s['T']} per micro-batch, N = {s['valid_count']:,} valid, "
        f"{s['trust_region_count']:,} trust-region, {s['trust_region_count'] - s['kept_trust_region_count']:,} masked "
        f"(m2 {s['m2_before']:.4f} -> {s['m2_after']:.4f}); planted: rank {s['planted_micro_batch']['rank']} micro-batch "
        f"{s['planted_micro_batch']['micro_batch']} selected alone ({s['planted_micro_batch']['tokens_changed']} tokens differ)",
        highlight=False,
        soft_wrap=True,
    )
    for case in record["cases"]:
        ok = case["wall_s"] < TARGET_S, case["peak_rss_bytes"] < TARGET_BYTES
        console.print(
            f"observation ({case['case']}): {case['wall_s']:.2f} s {'<' if ok[0] else '>='} {TARGET_S:.0f} s, "
            f"peak RSS {_gib(case['peak_rss_bytes'])} {'<' if ok[1] else '>='} {_gib(TARGET_BYTES)}: "
            f"{'within' if all(ok) else 'outside'} the audit's target"
            + ("" if tokens == DEFAULT_TOKENS else f" (which is set for {DEFAULT_TOKENS:,} tokens)"),
            highlight=False,
            soft_wrap=True,
        )
    if args.json:
        write_json(record, args.json)
    return EXIT_EQUIVALENT if all(c["as_expected"] for c in record["cases"]) else EXIT_DIVERGENT
