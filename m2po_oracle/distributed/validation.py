"""Does a distributed implementation fail closed on EVERY rank when one rank's input is invalid?

Each probe starts every rank from the same clean local batch (``m2po_oracle.judge.validation``'s
``CLEAN``) and breaks one thing on one data-parallel rank only (a NaN on a valid token, a
missing ``behavior_logp``, a bad tau, a tau that differs between ranks). A fail-closed
implementation makes every rank raise the same error, naming the failing rank and the
argument, promptly. One that checks each rank alone raises on the bad rank and leaves the
others waiting in the selection's first collective: the probe then comes out "hung"
(a rank still running at the deadline) or "crashed" (a rank died or gloo gave up).

The handlers run in :class:`~m2po_oracle.distributed.world.World` ranks (forkserver
processes), so everything here is module-level and importable.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from m2po_oracle.distributed.checks import pad_for_cp
from m2po_oracle.distributed.implementations import ParallelState, load_distributed_implementation
from m2po_oracle.distributed.world import RankContext, RankOutcome, World, WorldError
from m2po_oracle.judge.contract import to_tensors
from m2po_oracle.judge.validation import CLEAN, ProbeResult, is_rejection
from m2po_oracle.judge.validation import probe as local_probe

Corrupt = Callable[[dict[str, Any]], None]  # edits the keyword arguments (with "tau") in place


def _set_tau(value: float) -> Corrupt:
    def corrupt(kwargs: dict[str, Any]) -> None:
        kwargs["tau"] = value

    return corrupt


@dataclass(frozen=True)
class CollectiveProbe:
    """``corrupt`` is applied on data-parallel rank ``rank`` only; the error every rank
    raises must start with ``argument:``."""

    name: str
    description: str
    argument: str
    corrupt: Corrupt
    rank: int = 1


#: Shared corruptions come from the single-process battery, so the two cannot drift apart.
COLLECTIVE_PROBES: tuple[CollectiveProbe, ...] = (
    CollectiveProbe(
        "behavior_logp_missing",
        "behavior_logp is None on one rank (its rollout log-probs missing)",
        "behavior_logp",
        local_probe("behavior_logp_missing").corrupt,
        rank=1,
    ),
    CollectiveProbe(
        "nan_logp_on_valid_token",
        "NaN in logp on a valid token of one rank",
        "logp",
        local_probe("nan_logp_on_valid_token").corrupt,
        rank=0,
    ),
    CollectiveProbe(
        "nan_advantage_on_valid_token",
        "NaN advantage on a valid token of one rank",
        "advantages",
        local_probe("nan_advantage_on_valid_token").corrupt,
        rank=1,
    ),
    CollectiveProbe("negative_tau", "tau = -0.1 on one rank", "tau", local_probe("negative_tau").corrupt, rank=0),
    CollectiveProbe("nan_tau", "tau = NaN on one rank", "tau", local_probe("nan_tau").corrupt, rank=1),
    CollectiveProbe("tau_differs", "tau = 0.0 on one rank, 0.04 on the others (both valid alone)", "tau", _set_tau(0.0), rank=1),
)


def collective_probe(name: str) -> CollectiveProbe:
    for p in COLLECTIVE_PROBES:
        if p.name == name:
            return p
    raise ValueError(f"probe: unknown collective probe {name!r}; known: {', '.join(p.name for p in COLLECTIVE_PROBES)}")


# --- the rank handler ---


def bad_rank(p: CollectiveProbe, topology: Any) -> int:
    """The data-parallel rank ``p`` corrupts in ``topology`` (the last one if it has fewer)."""
    return min(p.rank, topology.dp - 1)


def probes_for(topology: Any, probes: tuple[CollectiveProbe, ...] = COLLECTIVE_PROBES) -> tuple[CollectiveProbe, ...]:
    """The probes that can show something on ``topology``: a budget that differs between
    data-parallel ranks needs two of them."""
    return tuple(p for p in probes if p.name != "tau_differs" or topology.dp > 1)


def _probe_inputs(ctx: RankContext, p: CollectiveProbe, dtype: str, bad_ranks: list[int]) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(to_tensors(pad_for_cp(CLEAN, ctx.topology.cp), dtype, ctx.device), tau=CLEAN.tau)
    if ctx.coords.dp in bad_ranks:  # CP/TP replicas of a bad rank share its (bad) input
        p.corrupt(kwargs)
    return kwargs


def rank_probe(ctx: RankContext, payload: dict[str, Any]) -> dict[str, Any]:
    """World handler: one probe on this rank. ``payload = {"spec", "probe", "dtype"}``, and
    optionally ``"ranks"``: the data-parallel ranks to corrupt (default: the probe's own;
    ``[]`` runs the clean step, to measure what valid input costs).

    The implementation's exception is caught and returned, so a fail-closed implementation
    (every rank raises) still gives ``world.run`` every rank's outcome and the world stays
    warm; only a hang or a dead rank becomes a WorldError.
    """
    import torch.distributed as dist

    p = collective_probe(payload["probe"])
    spec = payload["spec"]
    fn = load_distributed_implementation(spec, payload.get("adapter"))
    kwargs = _probe_inputs(ctx, p, payload.get("dtype", "float64"), list(payload.get("ranks", [bad_rank(p, ctx.topology)])))
    tau = kwargs.pop("tau")
    dist.barrier()  # start every rank's clock together: "seconds" is then the time to refuse
    ctx.counter.reset()
    started = time.perf_counter()
    try:
        fn(kwargs["logp"], kwargs["behavior_logp"], kwargs["advantages"], kwargs["mask"], tau=tau, parallel=ParallelState.of_rank(ctx))
    except Exception as error:
        status = "rejected" if is_rejection(error) else "crashed"
        return _outcome(status, type(error).__name__, str(error), started, ctx)
    return _outcome("accepted", "", "returned a result", started, ctx)


def _outcome(status: str, kind: str, message: str, started: float, ctx: RankContext) -> dict[str, Any]:
    return {
        "status": status,
        "type": kind,
        "message": message,
        "seconds": time.perf_counter() - started,
        "collectives": ctx.counter.snapshot(),
    }


# --- running the battery and reducing the ranks' outcomes ---


def run_collective_probes(
    world: World,
    spec: str,
    *,
    dtype: str = "float64",
    probes: tuple[CollectiveProbe, ...] = COLLECTIVE_PROBES,
    adapter: tuple[str, tuple[str, ...]] | None = None,
) -> list[ProbeResult]:
    """Every probe through ``world`` (restarted after a hang or a dead rank); never raises
    because of the implementation. ``adapter``: (name, bindings) of a distributed adapter."""
    results = []
    for p in probes_for(world.topology, probes):
        try:
            outcomes = world.run(rank_probe, {"spec": spec, "probe": p.name, "dtype": dtype, "adapter": adapter})
        except WorldError as error:
            outcomes = error.outcomes
        results.append(reduce_outcomes(p, outcomes, world))
    return results


def reduce_outcomes(p: CollectiveProbe, outcomes: list[RankOutcome], world: World) -> ProbeResult:
    """ "rejected" only if every rank refused with the same error naming the bad rank and the
    argument; "hung" if a rank was still running at the deadline; "crashed" if a rank died,
    raised anything else, or the ranks disagree; "accepted" if every rank returned a result."""

    def result(status: str, message: str) -> ProbeResult:
        return ProbeResult(p.name, p.description, status, message)

    hung = [o.rank for o in outcomes if o.stack]
    if hung:
        return result("hung", f"ranks {hung} of {len(outcomes)} were still running after {world.timeout_s:g} s ({_statuses(outcomes)})")
    dead = [o for o in outcomes if o.error]
    if dead:
        assert dead[0].error is not None  # dead: the ranks with an error
        return result(
            "crashed", f"ranks {[o.rank for o in dead]} failed outside the implementation: {dead[0].error.strip().splitlines()[-1]}"
        )
    values = [o.value for o in outcomes]
    statuses = {v["status"] for v in values}
    if statuses == {"accepted"}:
        return result("accepted", f"every rank returned a result: the invalid input on rank {p.rank} was silently accepted")
    if statuses != {"rejected"}:
        return result("crashed", f"the ranks disagree: {_statuses(outcomes)}")
    return _reduce_rejections(p, outcomes, world, result)


def _reduce_rejections(
    p: CollectiveProbe, outcomes: list[RankOutcome], world: World, result: Callable[[str, str], ProbeResult]
) -> ProbeResult:
    for o in outcomes:
        peers = world.topology.group_of(o.rank, "dp")
        same = {(outcomes[r].value["type"], outcomes[r].value["message"]) for r in peers}
        if len(same) > 1:
            return result("crashed", f"every rank refused, but the ranks of DP group {peers} with different errors: {sorted(same)}")
        bad = [r for r in peers if world.topology.coords(r).dp == bad_rank(p, world.topology)]
        problem = _naming_problem(o.value["message"], p.argument, bad)
        if problem:
            return result("crashed", f"every rank refused, but rank {o.rank}'s error {problem}: {o.value['message']!r}")
    slowest = max(o.value["seconds"] for o in outcomes)
    first = outcomes[0].value
    return result("rejected", f"every rank ({len(outcomes)}) raised within {slowest:.3f} s: {first['type']}: {first['message']}")


def _naming_problem(message: str, argument: str, bad_ranks: list[int]) -> str | None:
    """Why ``message`` does not name the argument first and the bad rank, or None."""
    if not re.match(rf"{re.escape(argument)}\b", message):
        return f"does not start with the argument {argument!r}"
    if not any(re.search(rf"\brank {r}\b", message) for r in bad_ranks):
        return f"does not name the failing rank ({' or '.join(map(str, bad_ranks))})"
    return None


def _statuses(outcomes: list[RankOutcome]) -> str:
    parts = []
    for o in outcomes:
        if o.stack:
            parts.append(f"rank {o.rank}: still running")
        elif o.error:
            parts.append(f"rank {o.rank}: died")
        else:
            v = o.value
            parts.append(f"rank {o.rank}: {v['status']}" + (f" ({v['type']}: {v['message'][:120]})" if v["type"] else ""))
    return "; ".join(parts)


def probe_seconds(outcomes: list[RankOutcome]) -> list[float]:
    """Each rank's time from its (barrier-aligned) call to its return or raise."""
    return [o.value["seconds"] if o.value else math.inf for o in outcomes]
