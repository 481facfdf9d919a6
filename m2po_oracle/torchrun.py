"""The distributed battery under torchrun, for real (multi-node, NCCL) clusters.

    torchrun --nnodes N --nproc-per-node G ... -m m2po_oracle.torchrun \\
        --impl SPEC --topology dp=..,cp=..,tp=.. [--examples 200] [--json report.json]

Every process is one rank (Megatron order over the global ranks). Rank 0 runs the same
``compare`` as the command line: it draws and shrinks batches, broadcasts each to every
rank, and checks the gathered per-rank results; the other ranks serve steps until rank 0
says stop. Backend: NCCL when CUDA is available, else gloo. A dead or hung rank surfaces
as the backend's collective timeout (``--timeout``), which ends the job.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

from m2po_oracle import options


class TorchrunRunner:
    """On rank 0: one step = broadcast the batch, run this rank's share, gather every rank's."""

    def __init__(self, context: Any, spec: str) -> None:
        self.context, self.spec, self.topology = context, spec, context.topology
        self.timeouts = 0
        self.world = argparse.Namespace(backend=context.backend)

    def step_battery(self, batch: Any, *, dtype: str = "float64", compute_dtype: str | None = None, device: str = "cpu") -> Any:
        # Each rank runs on its backend's device; ``device`` (the parent's) is not used.
        from m2po_oracle.battery import BatteryOutcome
        from m2po_oracle.contract import rounded_batch
        from m2po_oracle.distributed_checks import as_measurement, check_step, pad_for_cp

        seen = pad_for_cp(rounded_batch(batch, dtype), self.topology.cp)
        outcomes = _serve_step(self.context, {"spec": self.spec, "batch": seen.to_dict(), "dtype": dtype})
        step = check_step(seen, self.topology, outcomes, dtype)
        return BatteryOutcome(step.batch, as_measurement(step, dtype), tuple(step.mismatches), tuple(step.ranks_json()))

    def stop(self) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list([None], src=0)


def _serve_step(context: Any, payload: Any) -> list[Any] | None:
    """Every rank: receive the step from rank 0, run it, gather the values on rank 0."""
    import torch.distributed as dist

    from m2po_oracle.distributed import RankOutcome
    from m2po_oracle.distributed_checks import rank_step

    box = [payload]
    dist.broadcast_object_list(box, src=0)
    if box[0] is None:
        return None
    context.counter.reset()
    value = rank_step(context, box[0])
    collectives = context.counter.snapshot()
    gathered: list[Any] | None = [None] * context.topology.world_size if context.rank == 0 else None
    dist.gather_object((value, collectives), gathered, dst=0)
    if context.rank != 0:
        return []
    return [RankOutcome(r, context.topology.coords(r), v, c) for r, (v, c) in enumerate(gathered)]


def main(argv: list[str] | None = None) -> int:
    import torch
    import torch.distributed as dist

    from m2po_oracle.distributed import make_context

    parser = argparse.ArgumentParser(prog="python -m m2po_oracle.torchrun")
    parser.add_argument("--impl", required=True)
    options.add_to_argparse(parser, tuple(o for o in options.COMPARE_OPTIONS if o.name in ("examples", "seed", "dtype", "compute_dtype", "tau", "timeout", "topology")))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--html", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.topology is None:
        parser.error("--topology is required (dp=N,cp=N,tp=N with dp*cp*tp = WORLD_SIZE)")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = f"cuda:{local_rank}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size != args.topology.world_size:
        if rank == 0:
            print(f"error: topology {args.topology} has {args.topology.world_size} ranks, torchrun started {world_size}", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    context = make_context(rank, args.topology, backend, device)
    status = 0
    if rank == 0:
        from m2po_oracle.compare import run_compare

        runner = TorchrunRunner(context, args.impl)
        try:
            report = run_compare(runner, args.impl, examples=args.examples, seed=args.seed, dtype=args.dtype, compute_dtype=args.compute_dtype, tau=args.tau, device=device)
        finally:
            runner.stop()
        record = report.to_json()
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(record, indent=2))
        if args.html:
            from m2po_oracle.html_report import write_html

            write_html(record, args.html)
        failing = [c["name"] for c in record["checks"] if c["status"] == "fail"]
        print(f"m2po-oracle torchrun: {args.impl} on {args.topology} ({backend}): {report.verdict} after {report.examples} batches"
              + (f"; failing checks: {', '.join(failing)}" if failing else ""))
        status = report.exit_status
    else:
        while _serve_step(context, None) is not None:
            pass
    dist.barrier()
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
