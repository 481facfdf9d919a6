"""The battery across ranks: one optimizer batch spread over a dp x cp x tp world.

Rank ``r`` gets the rows of its DP shard (CP-reconstructed, so CP and TP ranks hold
replicas) and runs the implementation under the distributed contract
(``distributed_impls``). The parent checks, naming the rank in every failure:

* ``distributed.replica_masks_identical``: TP and CP replicas keep the same mask;
* ``distributed.global_selection``: the mask assembled from one replica per DP rank is an
  outcome Algorithm 1 can produce on the whole batch;
* ``distributed.loss_sum``: the losses of one replica set add up to the global loss;
* ``distributed.shard_gradient``: each rank's gradient is the analytic oracle's, global N,
  on its own rows and CP shard, zero elsewhere;
* ``distributed.metrics``: every rank reports the global metrics and counts.

The step also yields the assembled global result, so the single-process checks,
diagnosis and reports apply unchanged.

With ``--capture`` (the payload's ``capture``: directory and step number) every rank
whose implementation returned also records its step through one
:class:`m2po_oracle.capture.Recorder` per rank process: micro-batch 0, its CP shard in the
Megatron layout (the CP-padded batch as the rank was fed it), its loss share, metrics and
gradient; TP ranks each record their replica.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from m2po_oracle import oracle
from m2po_oracle.capture.recorder import Recorder
from m2po_oracle.distributed.diagnosis import diagnose_step
from m2po_oracle.distributed.implementations import ParallelState, load_distributed_implementation
from m2po_oracle.distributed.topology import RankCoords, Topology, cp_token_indices, dp_row_slices
from m2po_oracle.distributed.world import RankContext, RankOutcome
from m2po_oracle.judge.contract import Finding, Measurement, normalise_result, to_tensors
from m2po_oracle.judge.equivalence import Mismatch, check_selection, compare_values, same_up_to_ties, tolerance, valid_m2
from m2po_oracle.oracle.batch import Batch
from m2po_oracle.oracle.encoding import number
from m2po_oracle.oracle.record import COUNT_FIELDS, METRIC_FIELDS, M2POResult


def pad_for_cp(batch: Batch, cp: int) -> Batch:
    """Pad the sequence axis with invalid tokens to a multiple of 2*cp (Megatron's layout)."""
    width = batch.shape[1]
    target = -(-width // (2 * cp)) * (2 * cp)
    if target == width:
        return batch
    pad = lambda a, v: np.concatenate([a, np.full((a.shape[0], target - width), v, dtype=a.dtype)], axis=1)  # noqa: E731
    return Batch(
        pad(batch.logp, np.nan), pad(batch.behavior_logp, np.nan), pad(batch.advantages, np.nan), pad(batch.valid, False), batch.tau
    )


def rank_step(ctx: RankContext, payload: dict[str, Any]) -> dict[str, Any]:
    """Runs in every rank: the implementation on this rank's rows; never raises for it.

    A capture that cannot be written is returned as ``capture_error`` (the parent stops the
    run), never raised: raising would read as the implementation failing."""
    spec, dtype = payload["spec"], payload["dtype"]
    batch = Batch.from_dict(payload["batch"])
    rows = dp_row_slices(batch.shape[0], ctx.topology.dp)[ctx.coords.dp]
    local = Batch(batch.logp[rows], batch.behavior_logp[rows], batch.advantages[rows], batch.valid[rows], batch.tau)
    capture, recorder, capture_error = payload.get("capture"), None, None
    if capture is not None:
        # Before the implementation: every rank's manifest exists, also one whose implementation raises.
        try:
            recorder = _rank_recorder(ctx, capture["directory"])
        except Exception as error:
            capture_error = f"rank {ctx.rank}: cannot start recording in {capture['directory']}: {type(error).__name__}: {error}"
    try:
        fn = load_distributed_implementation(spec, payload.get("adapter"))
        tensors = to_tensors(local, dtype, ctx.device)
        raw = fn(
            tensors["logp"],
            tensors["behavior_logp"],
            tensors["advantages"],
            tensors["mask"],
            tau=batch.tau,
            parallel=ParallelState.of_rank(ctx),
        )
        result, _ = normalise_result(raw, tensors["logp"], local.shape)
    except Exception as error:
        # Raised to the world, which ends the step at once: the other ranks are likely
        # stuck in a collective this rank will never join.
        raise RankFailure(f"rank {ctx.rank} (rows {rows.start}..{rows.stop - 1}): {type(error).__name__}: {error}") from error
    value: dict[str, Any] = {"rows": (rows.start, rows.stop), "result": result}
    if recorder is not None:
        assert capture is not None  # a recorder is made from a capture only
        try:
            _record_shard(recorder, capture["step"], ParallelState.of_rank(ctx), tensors, result, batch.tau)
        except Exception as error:
            capture_error = f"rank {ctx.rank}: recording step {capture['step']} failed: {type(error).__name__}: {error}"
    if capture_error is not None:
        value["capture_error"] = capture_error
    if ctx.rank == 0:  # after the step, so no rank waits for it: the same batch through one rank
        value["single"] = _as_one_rank(ctx, fn, batch, dtype)
    return value


#: This rank process's recorder per capture directory: made at its first captured step, kept
#: while the world lives (a world restarted after a failed step makes new ones).
_RANK_RECORDERS: dict[str, Any] = {}


def _rank_recorder(ctx: RankContext, directory: str) -> Any:
    recorder = _RANK_RECORDERS.get(directory)
    if recorder is None:
        # resume=True: a world restarted after a failed step continues the manifests its ranks
        # wrote (the parent refused a directory that held a capture before the run began).
        recorder = Recorder(directory, rank=ctx.rank, world_size=ctx.topology.world_size, topology=str(ctx.topology), resume=True)
        _RANK_RECORDERS[directory] = recorder
    return recorder


def _record_shard(recorder: Any, step: int, parallel: Any, tensors: dict[str, Any], result: M2POResult, tau: float) -> None:
    """Micro-batch 0 of ``step``: this rank's CP shard (chunk i, then chunk 2cp-1-i) of what
    its implementation was fed, the shard of its keep and gradient, its loss share and the
    metrics it reported."""
    import torch

    logp = tensors["logp"].detach()
    columns = parallel.shard_columns(logp.shape[1])
    # normalise_result took d loss / d logp in logp's dtype and widened it: narrowing back is exact.
    grad = None if result.grad is None else torch.from_numpy(result.grad)[:, columns].to(logp.dtype)
    recorder.record(
        step=step,
        micro_batch=0,
        logp=parallel.shard(logp),
        behavior_logp=parallel.shard(tensors["behavior_logp"]),
        advantages=parallel.shard(tensors["advantages"]),
        mask=parallel.shard(tensors["mask"]),
        keep=torch.from_numpy(result.keep)[:, columns],
        loss=result.loss,
        tau=tau,
        metrics=result.reported(),
        grad=grad,
    )


def _as_one_rank(ctx: RankContext, fn: Any, batch: Batch, dtype: str) -> M2POResult | str:
    """``fn`` on the whole optimizer batch as a dp=1, cp=1, tp=1 world (its groups: this
    rank alone): the reference of ``distributed.split_invariance``; the error text if it raised."""
    alone = ctx.groups["self"]
    try:
        with ctx.counter.excluded():
            tensors = to_tensors(batch, dtype, ctx.device)
            parallel = ParallelState(Topology(1, 1, 1), RankCoords(0, 0, 0), alone, alone, alone, alone)
            raw = fn(tensors["logp"], tensors["behavior_logp"], tensors["advantages"], tensors["mask"], tau=batch.tau, parallel=parallel)
            return normalise_result(raw, tensors["logp"], batch.shape)[0]
    except Exception as error:
        return f"{type(error).__name__}: {error}"


def _split_invariance(
    batch: Batch, topology: Topology, keep: np.ndarray, loss: float, grad: np.ndarray, outcomes: list[RankOutcome], dtype: str
) -> list[Mismatch]:
    """The assembled step against the same implementation on one rank: splitting the
    optimizer batch must change neither the mask (up to ties), the loss sum nor the gradient."""
    single = (outcomes[0].value or {}).get("single")
    if single is None:
        return []
    label = f"the same optimizer batch through one rank (dp=1) and through {topology}"
    if isinstance(single, str):
        return [Mismatch("distributed.split_invariance", f"{label}: the one-rank call raised {single}")]
    found = []
    if not same_up_to_ties(single.keep, keep, valid_m2(batch)):
        index = tuple(int(i) for i in np.argwhere(single.keep != keep)[0])
        found.append(
            Mismatch(
                "distributed.split_invariance",
                f"{label}: keep differs at {int((single.keep != keep).sum())} token(s), first at index {index} "
                "(the selection depends on the split)",
                "keep",
                index,
                bool(keep[index]),
                bool(single.keep[index]),
            )
        )
    scale = float(np.abs(single.grad).sum()) if single.grad is not None else 0.0
    mismatch = compare_values("distributed.split_invariance", "loss", loss, single.loss, tolerance(dtype, "loss"), scale=scale)
    if mismatch:
        found.append(
            Mismatch(
                mismatch.check,
                f"{label}: the rank losses sum to {loss!r}, one rank computes {single.loss!r}",
                "loss",
                None,
                loss,
                single.loss,
                mismatch.details,
            )
        )
    elif single.grad is not None and np.array_equal(single.keep, keep):
        grad_tol = tolerance(dtype, "gradient")
        mismatch = compare_values(
            "distributed.split_invariance",
            "grad",
            grad,
            single.grad,
            grad_tol,
            scale=float(np.abs(single.grad).max(initial=0)) * grad_tol.rtol,
        )
        if mismatch:
            found.append(
                Mismatch(
                    mismatch.check,
                    f"{label}: {mismatch.summary}",
                    mismatch.field,
                    mismatch.index,
                    mismatch.actual,
                    mismatch.expected,
                    mismatch.details,
                )
            )
    return found


class RankFailure(RuntimeError):
    """The implementation raised in one rank (its traceback follows in the world's error)."""


def _where(outcome: RankOutcome) -> str:
    c = outcome.coords
    return f"rank {outcome.rank} (dp={c.dp}, cp={c.cp}, tp={c.tp})"


@dataclass
class DistributedStep:
    """One optimizer batch through the world, and everything found about it."""

    batch: Batch  # as the implementation received it (rounded, CP-padded)
    outcomes: list[RankOutcome]
    mismatches: list[Mismatch] = field(default_factory=list)
    result: M2POResult | None = None  # assembled over the world
    explained_by: list[dict[str, Any]] = field(default_factory=list)  # distributed variants reproducing it

    def ranks_json(self) -> list[dict[str, Any]]:
        out = []
        for o in self.outcomes:
            value = o.value or {}
            result = value.get("result")
            out.append(
                {
                    "rank": o.rank,
                    "coords": {"dp": o.coords.dp, "cp": o.coords.cp, "tp": o.coords.tp},
                    "rows": list(value.get("rows", [])),
                    "keep": result.keep.astype(int).tolist() if result is not None else None,
                    "loss": number(result.loss) if result is not None else None,
                    "metrics": {k: number(v) for k, v in result.reported().items()} if result is not None else {},
                    "collectives": o.collectives,
                    "error": value.get("error") or o.error,
                    "stack": o.stack,
                }
            )
        return out


def check_step(
    batch: Batch, topology: Topology, outcomes: list[RankOutcome], dtype: str, compute_dtype: str | None = None
) -> DistributedStep:
    step = DistributedStep(batch, outcomes)
    results = {o.rank: o.value["result"] for o in outcomes}
    rows = {o.rank: slice(*o.value["rows"]) for o in outcomes}
    by_dp: dict[int, list[RankOutcome]] = {}
    for o in outcomes:
        by_dp.setdefault(o.coords.dp, []).append(o)

    for dp_rank, replicas in by_dp.items():
        reference = replicas[0]
        for other in replicas[1:]:
            a, b = results[reference.rank].keep, results[other.rank].keep
            if not np.array_equal(a, b):
                index = tuple(int(i) for i in np.argwhere(a != b)[0])
                step.mismatches.append(
                    Mismatch(
                        "distributed.replica_masks_identical",
                        f"{_where(reference)} and {_where(other)} hold replicas of DP rank {dp_rank} but keep different masks "
                        f"({int((a != b).sum())} token(s) differ, first at local index {index})",
                        field="keep",
                        index=index,
                        actual=bool(b[index]),
                        expected=bool(a[index]),
                    )
                )

    keep = np.zeros(batch.shape, dtype=bool)
    grad = np.zeros(batch.shape)
    loss = 0.0
    for o in outcomes:
        if o.coords.cp == 0 and o.coords.tp == 0:
            keep[rows[o.rank]] = results[o.rank].keep
        if o.coords.tp == 0:
            loss += results[o.rank].loss
            grad[rows[o.rank]] += results[o.rank].grad
    for m in check_selection(batch, keep, compute_dtype or dtype):
        step.mismatches.append(
            Mismatch("distributed.global_selection", f"[{m.check}] {m.summary}", m.field, m.index, m.actual, m.expected, m.details)
        )

    expected = oracle.evaluate_with_mask(batch, keep)
    assert expected.grad is not None  # the oracle's result always has its gradient
    scale = float(np.abs(expected.grad).sum())
    mismatch = compare_values("distributed.loss_sum", "loss", loss, expected.loss, tolerance(dtype, "loss"), scale=scale)
    if mismatch:
        step.mismatches.append(
            Mismatch(
                mismatch.check,
                f"the losses of ranks with tp=0 sum to {loss!r}, the global loss is {expected.loss!r}",
                "loss",
                None,
                loss,
                expected.loss,
                mismatch.details,
            )
        )
    grad_tol = tolerance(dtype, "gradient")
    for o in outcomes:
        columns = np.zeros(batch.shape[1], dtype=bool)
        columns[cp_token_indices(batch.shape[1], topology.cp, o.coords.cp)] = True
        want = np.where(columns[None, :], expected.grad[rows[o.rank]], 0.0)
        mismatch = compare_values(
            "distributed.shard_gradient",
            "grad",
            results[o.rank].grad,
            want,
            grad_tol,
            scale=float(np.abs(want).max(initial=0)) * grad_tol.rtol,
        )
        if mismatch:
            step.mismatches.append(
                Mismatch(
                    mismatch.check,
                    f"{_where(o)}: {mismatch.summary} (local index within rows {rows[o.rank].start}..{rows[o.rank].stop - 1})",
                    mismatch.field,
                    mismatch.index,
                    mismatch.actual,
                    mismatch.expected,
                    mismatch.details,
                )
            )
        reported = results[o.rank]
        for name in METRIC_FIELDS + COUNT_FIELDS:
            value = getattr(reported, name)
            if value is None:
                continue
            want_value = getattr(expected, name)
            bad = (
                value != want_value
                if name in COUNT_FIELDS
                else compare_values("distributed.metrics", name, value, want_value, tolerance(dtype, "metric")) is not None
            )
            if bad:
                step.mismatches.append(
                    Mismatch(
                        "distributed.metrics",
                        f"{_where(o)} reports {name} = {value!r}; the optimizer batch's is {want_value!r}",
                        name,
                        None,
                        value,
                        want_value,
                    )
                )
    step.mismatches.extend(_split_invariance(batch, topology, keep, loss, grad, outcomes, dtype))
    metrics = {name: getattr(results[0], name) for name in METRIC_FIELDS + COUNT_FIELDS}
    step.result = M2POResult(loss=loss, keep=keep, grad=grad, **metrics)
    if step.mismatches:
        step.explained_by = diagnose_step(batch, topology, outcomes, dtype)
    return step


def as_measurement(step: DistributedStep, dtype: str) -> Measurement:
    if step.result is None:
        return Measurement(step.batch, dtype, None, Finding("raised", step.mismatches[0].summary if step.mismatches else "no result"))
    return Measurement(step.batch, dtype, step.result)
