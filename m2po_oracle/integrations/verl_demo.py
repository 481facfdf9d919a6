"""A short real verl actor update with M2PO on CPU, recorded for ``m2po-oracle audit``.

Everything is built in code (nothing is downloaded): the trainer cases' random-weight Llama
(``trainer.grpo.tiny_llama``), rollout workers some optimizer steps behind it that sample the
completions and record their log-probs (the rollout engine's ``rollout_log_probs``), the case's
reward, and verl's GRPO advantages. Then verl's ``TrainingWorker.train_mini_batch`` runs
:class:`~m2po_oracle.integrations.verl.M2POTrainingWorker` over the rollout in several
mini-batches (one optimizer step each) of several micro-batches, for two epochs, so that
every optimizer step after the first trains on completions an older policy sampled::

    python -m m2po_oracle.integrations.verl_demo --capture runs/verl
    m2po-oracle audit runs/verl

Data parallel, two processes on gloo (each trains on its half of the rows; one selection
across both per mini-batch; the gradients averaged as FSDP's reduce-scatter would)::

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m m2po_oracle.integrations.verl_demo --capture runs/verl-dp2

``--fault NAME`` plants one of the integration's bugs (``VerlFaults``), for the audit to catch.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace

from m2po_oracle.integrations.verl import faults_named
from m2po_oracle.integrations.verl_step import run_update
from m2po_oracle.trainer.grpo import make_policy_versions, sample_rollout

#: The sampling workers' lag behind the policy, one per prompt (in optimizer steps).
LAGS = (1, 3, 2, 3)


@dataclass(frozen=True)
class VerlDemo:
    """One short verl update: ``prompts * group_size`` rows in mini-batches of ``mini_batch_size``
    rows, micro-batches of ``micro_batch_size``, ``epochs`` passes (optimizer steps:
    rows / mini_batch_size * epochs)."""

    seed: int = 1
    prompts: int = 4
    group_size: int = 2
    prompt_len: int = 3
    max_new_tokens: int = 8
    mini_batch_size: int = 4
    micro_batch_size: int = 2
    epochs: int = 2
    tau: float = 0.04
    staleness_lr: float = 0.02
    lr: float = 0.02

    @property
    def steps(self) -> int:
        return self.prompts * self.group_size // self.mini_batch_size * self.epochs


def run(demo: VerlDemo, capture: str, fault: str | None = None) -> dict[str, float]:
    """The demo's update, every micro-batch recorded in ``capture``; returns the logged M2PO metrics."""

    versions = make_policy_versions(demo.seed, steps=max(LAGS), lr=demo.staleness_lr)
    samplers = [versions[-1 - lag] for lag in LAGS[: demo.prompts]]
    rollout = sample_rollout(
        samplers,
        prompts=demo.prompts,
        group_size=demo.group_size,
        prompt_len=demo.prompt_len,
        max_new_tokens=demo.max_new_tokens,
        seed=demo.seed,
    )
    rank, world = _rank_and_world()
    if world > 1:  # each data-parallel rank trains on its share of the rows, as verl's dispatch hands them out
        share = rollout.rows // world
        rows = slice(rank * share, (rank + 1) * share)
        rollout = replace(
            rollout,
            prompt_ids=rollout.prompt_ids[rows],
            completion_ids=rollout.completion_ids[rows],
            valid=rollout.valid[rows],
            behavior_logp=None if rollout.behavior_logp is None else rollout.behavior_logp[rows],
            rewards=rollout.rewards[rows],
        )
    return run_update(
        versions[-1],
        rollout,
        tau=demo.tau,
        lr=demo.lr,
        micro_batch_size=demo.micro_batch_size,
        mini_batch_size=demo.mini_batch_size,
        epochs=demo.epochs,
        fault=fault,
        capture=capture,
    )


def _rank_and_world() -> tuple[int, int]:
    """This process's place in torchrun's world (its world started by the step's platform glue)."""
    import os

    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def main(argv: list[str] | None = None) -> int:

    parser = argparse.ArgumentParser(prog="python -m m2po_oracle.integrations.verl_demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--capture", required=True, help="directory to record every micro-batch in (for m2po-oracle audit)")
    parser.add_argument("--tau", type=float, default=VerlDemo.tau, help="M2PO's budget (default %(default)s)")
    parser.add_argument("--seed", type=int, default=VerlDemo.seed)
    parser.add_argument("--epochs", type=int, default=VerlDemo.epochs, help="passes over the rollout (default %(default)s)")
    parser.add_argument("--fault", help="plant one of the integration's bugs (a negative control)")
    args = parser.parse_args(argv)
    try:
        faults_named(args.fault)
        demo = VerlDemo(seed=args.seed, tau=args.tau, epochs=args.epochs)
        logged = run(demo, args.capture, args.fault)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    shown = ", ".join(f"{name} {value:.4g}" for name, value in sorted(logged.items()))
    rank, world = _rank_and_world()
    print(f"verl {demo.steps} optimizer step(s), rank {rank} of {world}, recorded in {args.capture}: {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
