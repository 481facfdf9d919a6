"""``m2po-oracle bench``: the selection's and the core forward's speed, side by side in one run.

For each size: a float32 batch (256 rows; log-probs, behaviour log-probs, +-1 advantages,
every token valid, half of them trust-region candidates) and its candidates' M2 in float64,
then four methods timed in rotating order on the same values, each repeat:

* ``sort``: the sort-and-prefix-sum selection every public port uses;
* ``radix``: the core's exact selection without sorting (``fast_selection``), the selection;
* ``floor``: one streaming pass over the values (their sum): no selection can beat it;
* ``forward``: the whole ``core.m2po_loss`` forward (validation, d, the trust region, the
  selection, the loss with its autograd graph, the metrics) on the batch itself, with the
  fused CPU passes where they apply (``m2po_oracle.core.fused``);
* ``unfused``: the same forward with torch operators only (``fused.disabled()``), as every
  device but the CPU runs it;
* ``passes``: the passes over the batch that a forward made of torch operators cannot
  skip: d in float64 (two conversions and a subtraction), M2's count and sum histogrammed
  for every token (gathering the candidates first needs their count on the host: a second
  synchronisation), and the loss's terms (a subtraction, exp, a product and a sum). What
  the forward takes beyond them is the price of unfused passes (validation, the trust
  region, the digits, bit masks, the tie finish, the backward's buffers).

Medians and bests are recorded; the ratios sort/radix and radix/floor use medians, the
forward's ratios (forward/selection, sort/forward, forward/floor, unfused/forward) use
bests, as the targets are stated. The forward's would-sync operators are counted once per
size (``host_syncs``), for both forwards: the fused passes return their numbers to the
host from C, which no dispatch mode sees (on the CPU nothing waits for a device), so the
unfused forward's count is what a GPU's stream would stall on. Results of sort, radix and both forwards' masks must be identical,
and the two forwards' losses too.
Performance is asserted nowhere but here: timed unit tests lie on a shared machine.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from m2po_oracle.bench.baselines import kept_candidates_by_sorting
from m2po_oracle.bench.host_syncs import count_host_syncs
from m2po_oracle.call.runner import check_device
from m2po_oracle.core import fused
from m2po_oracle.core.fast_selection import BUCKETS, DIGIT_BITS, kept_candidates
from m2po_oracle.core.loss import m2po_loss
from m2po_oracle.core.scratch import CPU_CHUNK
from m2po_oracle.records.bench import SCHEMA

METHODS = ("sort", "radix", "floor", "forward", "unfused", "passes")
#: Rows of the benchmark batch (tokens / ROWS per row), as a training step's sequences.
ROWS = 256


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def forward_batch(tokens: int, *, device: str = "cpu", seed: int = 0, staleness: float = 0.3) -> dict[str, torch.Tensor]:
    """float32 (logp, behavior_logp, advantages, mask) of ``tokens`` tokens (every one valid)."""
    generator = torch.Generator().manual_seed(seed)
    behavior = -torch.empty(tokens).exponential_(0.5, generator=generator)
    # Student-t with 3 degrees of freedom (heavy tails), drawn from ``generator`` alone so
    # that the same seed gives the same batch in every process (a rank, the test that checks it).
    normal = torch.randn(4, tokens, generator=generator)
    d = staleness * normal[0] / (normal[1:].square().sum(0) / 3.0).sqrt()
    logp = (behavior + d).float()
    advantages = torch.where(torch.rand(tokens, generator=generator) < 0.5, 1.0, -1.0)
    rows = ROWS if tokens % ROWS == 0 else 1
    shape = (rows, tokens // rows)
    return {
        "logp": logp.reshape(shape).to(device),
        "behavior_logp": behavior.float().reshape(shape).to(device),
        "advantages": advantages.reshape(shape).to(device),
        "mask": torch.ones(shape, dtype=torch.bool, device=device),
    }


def _trust_region(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidates' flat positions as a mask, and the log-ratio in float64."""
    log_ratio = (batch["logp"].double() - batch["behavior_logp"].double()).reshape(-1)
    advantages = batch["advantages"].reshape(-1)
    return ((advantages > 0) & (log_ratio > 0)) | ((advantages < 0) & (log_ratio < 0)), log_ratio


def candidate_m2(tokens: int, *, device: str = "cpu", seed: int = 0, staleness: float = 0.3) -> torch.Tensor:
    """The M2 of the trust-region candidates of :func:`forward_batch`'s batch, float64."""
    trust, log_ratio = _trust_region(forward_batch(tokens, seed=seed, staleness=staleness))
    return (log_ratio[trust] ** 2).contiguous().to(device)


def _essential_passes(batch: dict[str, torch.Tensor], trust: torch.Tensor) -> Callable[[], Any]:
    """The ``passes`` method: the batch's unskippable passes, one torch operator each, in
    the core's chunks on CPU with buffers allocated once (as the core's scratch is), so
    that neither page faults nor cache misses count against the forward alone."""
    logp, behavior, advantages = (batch[k].reshape(-1) for k in ("logp", "behavior_logp", "advantages"))
    n = logp.numel()
    m2 = (logp.double() - behavior.double()).square_()
    # Each token's bucket as the core's first level histograms it (non-candidates in a bank).
    bucket = (m2.view(torch.int64) >> (64 - DIGIT_BITS)) + (~trust).to(torch.int64) * BUCKETS
    chunk = min(n, CPU_CHUNK) if logp.device.type == "cpu" else n
    d, other = (torch.empty(chunk, dtype=torch.float64, device=logp.device) for _ in range(2))
    terms = torch.empty(chunk, dtype=logp.dtype, device=logp.device)
    ones = torch.ones((), dtype=torch.float64, device=logp.device).expand(chunk)

    def passes() -> torch.Tensor:
        histogram = torch.zeros(2, 2 * BUCKETS, dtype=torch.float64, device=logp.device)
        total = torch.zeros((), dtype=logp.dtype, device=logp.device)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            size = end - start
            d[:size].copy_(logp[start:end]).sub_(other[:size].copy_(behavior[start:end]))
            histogram[0].scatter_add_(0, bucket[start:end], m2[start:end])
            histogram[1].scatter_add_(0, bucket[start:end], ones[:size])
            total += torch.sub(logp[start:end], behavior[start:end], out=terms[:size]).exp_().mul_(advantages[start:end]).sum()
        return total

    return passes


def measure_size(tokens: int, *, repeats: int, device: str, tau: float) -> dict[str, Any]:
    batch = forward_batch(tokens, device=device)
    trust, log_ratio = _trust_region(batch)
    m2 = (log_ratio[trust] ** 2).contiguous()
    logp = batch["logp"].clone().requires_grad_(True)  # the forward builds its autograd graph, as in training

    def forward() -> Any:
        return m2po_loss(logp, batch["behavior_logp"], batch["advantages"], batch["mask"], tau=tau)

    def unfused() -> Any:
        with fused.disabled():
            return forward()

    methods: dict[str, Callable[[], Any]] = {
        "sort": lambda: kept_candidates_by_sorting(m2, tau),
        "radix": lambda: kept_candidates(m2, tau),
        "floor": lambda: m2.sum(),
        "forward": forward,
        "unfused": unfused,
        "passes": _essential_passes(batch, trust),
    }
    radix = methods["radix"]()
    ran_before = fused.first_levels_run()
    result, counter = count_host_syncs(forward)
    fused_ran = fused.first_levels_run() > ran_before  # what the counted forward did, not what it should do
    torch_only, unfused_counter = count_host_syncs(unfused)
    identical = (
        bool(torch.equal(methods["sort"](), radix))
        and bool(torch.equal(result.keep.reshape(-1)[trust], radix))
        and bool(torch.equal(torch_only.keep, result.keep))
        and bool(torch.equal(torch_only.loss, result.loss))
    )
    times: dict[str, list[float]] = {name: [] for name in METHODS}
    for repeat in range(repeats):
        # Rotate the order so drift on a shared machine hits every method alike.
        shift = repeat % len(METHODS)
        for name in METHODS[shift:] + METHODS[:shift]:
            _synchronize(device)
            started = time.perf_counter()
            methods[name]()
            _synchronize(device)
            times[name].append(time.perf_counter() - started)
    medians = {name: statistics.median(values) for name, values in times.items()}
    bests = {name: min(values) for name, values in times.items()}
    return {
        "tokens": tokens,
        "candidates": m2.numel(),
        "identical": identical,
        "median_ms": {name: medians[name] * 1e3 for name in METHODS},
        "best_ms": {name: bests[name] * 1e3 for name in METHODS},
        "sort_over_radix": medians["sort"] / medians["radix"],
        "radix_over_floor": medians["radix"] / medians["floor"],
        "forward_over_selection": bests["forward"] / bests["radix"],
        "sort_over_forward": bests["sort"] / bests["forward"],
        "forward_over_floor": bests["forward"] / bests["floor"],
        "forward_over_passes": bests["forward"] / bests["passes"],
        "passes_over_selection": bests["passes"] / bests["radix"],
        "unfused_over_forward": bests["unfused"] / bests["forward"],
        "fused": fused_ran,
        "syncs_per_forward": counter.total,
        "syncs": dict(counter.syncs),
        "syncs_per_unfused_forward": unfused_counter.total,
        "unfused_syncs": dict(unfused_counter.syncs),
        "operators_per_forward": sum(counter.operators.values()),
    }


def run_bench(
    sizes: list[int], *, repeats: int = 7, device: str = "cpu", tau: float = 0.04, on_size: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 2 for s in sizes):
        raise ValueError(f"sizes: expected token counts >= 2, got {sizes!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats: expected an int >= 1, got {repeats!r}")
    check_device(device)
    rows = []
    for tokens in sizes:
        rows.append(measure_size(tokens, repeats=repeats, device=device, tau=tau))
        if on_size is not None:
            on_size(rows[-1])
    return {
        "schema": SCHEMA,
        "device": device,
        "tau": tau,
        "repeats": repeats,
        "rows": rows,
        "environment": {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "platform": platform.platform(),
            "gpu": torch.cuda.get_device_name(0) if device.startswith("cuda") else None,
            "fused_passes": "built" if fused.built() else f"not used: {fused.why_not_built()}",
        },
    }


def bench_across_ranks(ctx: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """World handler: histogram rounds vs all-gather on every rank's own candidates.

    Times both (barrier before each, rotating order), counts the collectives and bytes
    each sends, and checks that both keep the same tokens on this rank."""
    import torch.distributed as dist

    from m2po_oracle.bench.baselines import kept_candidates_across_by_gathering
    from m2po_oracle.core.fast_selection import kept_candidates_across

    group = ctx.groups["dp"]
    m2 = candidate_m2(payload["tokens"], seed=payload["seed"] + ctx.rank)
    if payload.get("ties"):
        m2[: m2.numel() // 4] = 0.0625  # a block of exact ties straddling the cut
    tau = payload["tau"]
    methods = {
        "histogram": lambda: kept_candidates_across(m2, tau, group),
        "all_gather": lambda: kept_candidates_across_by_gathering(m2, tau, group),
    }
    results, traffic = {}, {}
    for name, method in methods.items():
        ctx.counter.reset()
        results[name] = method()
        traffic[name] = ctx.counter.snapshot()
    times: dict[str, list[float]] = {name: [] for name in methods}
    for repeat in range(payload["repeats"]):
        for name in list(methods)[repeat % 2 :] + list(methods)[: repeat % 2]:
            dist.barrier(group=group)
            started = time.perf_counter()
            methods[name]()
            times[name].append(time.perf_counter() - started)
    return {
        "identical": bool(torch.equal(results["histogram"], results["all_gather"])),
        "kept": int(results["histogram"].sum()),
        "median_ms": {name: statistics.median(v) * 1e3 if v else None for name, v in times.items()},
        "traffic": traffic,
    }


def run_bench_across(
    world_size: int, tokens_per_rank: int, *, repeats: int = 5, tau: float = 0.04, ties: bool = False, timeout_s: float = 600.0
) -> dict[str, Any]:
    from m2po_oracle.distributed.topology import Topology
    from m2po_oracle.distributed.world import World

    with World(Topology(world_size, 1, 1), timeout_s=timeout_s) as world:
        outcomes = world.run(bench_across_ranks, {"tokens": tokens_per_rank, "seed": 0, "tau": tau, "repeats": repeats, "ties": ties})
        # The whole distributed forward once more in the same world: its would-sync operators per rank.
        forward = world.run(syncs_across_ranks, {"tokens": tokens_per_rank, "seed": 0, "tau": tau, "ties": ties})
    per_rank = [o.value for o in outcomes]
    slowest = {name: max(r["median_ms"][name] for r in per_rank) if repeats else None for name in ("histogram", "all_gather")}
    return {
        "world_size": world_size,
        "tokens_per_rank": tokens_per_rank,
        "identical": all(r["identical"] for r in per_rank),
        "median_ms": slowest,
        "traffic_rank0": per_rank[0]["traffic"],
        "per_rank": per_rank,
        "forward_syncs": [{"rank": o.rank, "syncs": o.value["syncs"], "collectives": o.value["collectives"]} for o in forward],
    }


def rank_batch(payload: dict[str, Any], rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s batch for :func:`syncs_across_ranks`: :func:`forward_batch`, with
    ``ties`` every third token's log-ratio exactly 0.25 (at tau 0.04 and 4096 tokens per
    rank, the cut falls among them on rank 1: the rank-ordered tie split runs), with
    ``padding`` every fifth token masked."""
    batch = forward_batch(payload["tokens"], seed=payload["seed"] + rank)
    if payload.get("ties"):
        batch["behavior_logp"].reshape(-1)[::3] = -1.0
        batch["logp"].reshape(-1)[::3] = -0.75
        batch["advantages"].reshape(-1)[::3] = 1.0
    if payload.get("padding"):
        batch["mask"].reshape(-1)[1::5] = False
    return batch


def syncs_across_ranks(ctx: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """World handler: one distributed ``core.m2po_loss`` forward over the DP group on this
    rank's own batch (``payload``: tokens, seed, tau, ties), with its would-sync operators
    (``host_syncs``) and the collectives it called, both counted on this rank."""
    batch = rank_batch(payload, ctx.rank)
    logp = batch["logp"].clone().requires_grad_(True)
    ctx.counter.reset()
    result, syncs = count_host_syncs(
        lambda: m2po_loss(logp, batch["behavior_logp"], batch["advantages"], batch["mask"], tau=payload["tau"], group=ctx.groups["dp"])
    )
    collectives = {name: entry["calls"] for name, entry in ctx.counter.snapshot().items()}
    return {
        "syncs": syncs.total,
        "by_operator": dict(syncs.syncs),
        "collectives": sum(collectives.values()),
        "by_collective": collectives,
        "operators": sum(syncs.operators.values()),
        "kept": result.keep.reshape(-1).tolist() if payload.get("keep") else None,
    }
