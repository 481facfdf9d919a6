"""The ms-swift tests' two data-parallel demo runs in one torchrun world (ms-swift is imported
once per rank instead of once per run):

    torchrun --standalone --nproc-per-node 2 property_tests/integrations/swift_dp_runs.py OUT

``OUT/dp2``: the correct integration, 3 steps, no clipping, each micro-batch's model inputs in
``OUT/inputs``; ``OUT/alone``: ``--fault per_rank_selection``, 6 steps. Each rank prints its world."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

from m2po_oracle.integrations.swift_demo import DemoSetup, run, write_model


def main(out: Path) -> None:
    import torch.distributed as dist

    rank = os.environ["RANK"]
    scratch = {name: out / f"scratch-{name}-rank{rank}" for name in ("dp2", "alone")}
    # Each rank writes its model before the first run: once the first run has started the
    # process group, save_pretrained writes only on rank 0 (the second run rewrites the same
    # files there, and finds them on the other rank).
    for directory in scratch.values():
        write_model(directory / "model", DemoSetup().seed)
    run(replace(DemoSetup(), steps=3), str(out / "dp2"), scratch=str(scratch["dp2"]), save_inputs=str(out / "inputs"), max_grad_norm=0)
    run(replace(DemoSetup(), steps=6), str(out / "alone"), "per_rank_selection", scratch=str(scratch["alone"]))
    print(f"rank {dist.get_rank()} of {dist.get_world_size()} process(es) on {dist.get_backend()}: ran both")
    # Leave the world together and tear gloo down before the interpreter exits: a rank that
    # exits with the group's threads alive can abort ("terminate called without an active
    # exception", SIGABRT) after its work is done, which fails the run for nothing it did.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
