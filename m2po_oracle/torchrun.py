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
import os
import sys
from datetime import timedelta
from pathlib import Path

from m2po_oracle.call.runner import RunOptions
from m2po_oracle.cli import options
from m2po_oracle.cli.launch import open_runner, run_options
from m2po_oracle.compare.search import run_compare
from m2po_oracle.distributed.torchrun_runner import TorchrunRunner, serve
from m2po_oracle.distributed.world import make_context
from m2po_oracle.oracle.encoding import write_json
from m2po_oracle.report.html import write_html

#: The compare options torchrun takes (the backend follows CUDA; the world is torchrun's).
TORCHRUN_OPTIONS = ("examples", "seed", "dtype", "compute_dtype", "tau", "timeout", "topology", "strict_validation", "capture")


def main(argv: list[str] | None = None) -> int:
    import torch
    import torch.distributed as dist

    parser = argparse.ArgumentParser(prog="python -m m2po_oracle.torchrun")
    parser.add_argument("--impl", required=True)
    options.add_to_argparse(parser, tuple(o for o in options.COMPARE_OPTIONS if o.name in TORCHRUN_OPTIONS))
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
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout or RunOptions.timeout))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size != args.topology.world_size:
        if rank == 0:
            print(f"error: topology {args.topology} has {args.topology.world_size} ranks, torchrun started {world_size}", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    context = make_context(rank, args.topology, backend, device)
    status = 0
    if rank == 0:
        values = {name: getattr(args, name) for name in TORCHRUN_OPTIONS}
        runner = open_runner(args.impl, run_options(values), torchrun=context)
        assert isinstance(runner, TorchrunRunner)  # torchrun= with the required --topology
        try:
            report = run_compare(runner)
        finally:
            runner.world.stop()
        record = report.to_json()
        if args.json:
            write_json(record, args.json)
        if args.html:
            write_html(record, args.html)
        failing = [c["name"] for c in record["checks"] if c["status"] == "fail"]
        print(
            f"m2po-oracle torchrun: {args.impl} on {args.topology} ({backend}): {report.verdict} after {report.examples} batches"
            + (f"; failing checks: {', '.join(failing)}" if failing else "")
        )
        status = report.exit_status
    else:
        while serve(context, None) is not None:
            pass
    dist.barrier()
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
