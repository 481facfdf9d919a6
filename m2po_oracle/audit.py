"""Offline audit of a recorded training run against Algorithm 1 (issue 15).

Reads a capture (:mod:`m2po_oracle.capture`) and, for every recorded optimizer step,
reassembles the optimizer batch from every rank's micro-batches and judges it with the
float64 oracle. The world is the manifest's ``dp x cp x tp`` in Megatron order
(:mod:`m2po_oracle.distributed.topology`):

- **TP ranks hold replicas**: the audit checks they recorded identical tensors, losses and
  metrics, then uses tensor-parallel rank 0's;
- **CP ranks hold shards**: each CP rank records its shard of every sequence in the
  Megatron layout (``2 * cp`` chunks, CP rank ``i`` holding chunks ``i`` and ``2 * cp - 1 - i``);
  the audit puts the shards back into sequences;
- **DP ranks hold rows**: the optimizer batch is every DP rank's micro-batches, rows
  concatenated in (dp rank, micro-batch) order, sequences padded to the longest T with
  invalid positions.

Checks per step (loss, gradient and metrics are judged on the mask the run chose, as
``compare`` does, so that a selection bug does not also fail them):

- ``audit.replicas_identical``: TP replicas recorded the same thing ("not run" when tp = 1);
- ``audit.selection``: the assembled ``keep`` is an outcome of Algorithm 1 on the whole
  optimizer batch (:func:`equivalence.check_selection`), on the log-probs the selection
  saw (``selection_logp`` when recorded, else ``logp``);
- ``audit.policy_logp``: the selection's log-probs are the loss pass's (a mask prepass and the
  loss pass must see one deterministic forward of one policy; ``policy_atol`` / ``--policy-atol``
  for nondeterministic kernels); "not run" without ``selection_logp``;
- ``audit.behavior_logp``: the behaviour log-probs the loss used are the ones the sampler
  reported (``rollout_logp``), at float32 precision at best or within ``rollout_atol``
  (``--rollout-atol``: a recomputation under the sampler's weights with other kernels);
  "not run" without ``rollout_logp``;
- ``audit.loss_sum``: the losses of one replica set (every DP and CP rank, every micro-batch,
  TP rank 0) add up to the oracle's global loss ``-(1/N) sum keep exp(d) A``, N the valid
  count of the whole optimizer batch. Each recorded loss is that rank's and micro-batch's
  share with the global N (under DDP, which averages gradients over the DP group, a
  trainer multiplies by the DP size for the backward; the *recorded* loss is the share
  before that factor);
- ``audit.gradient``: each captured gradient (d loss / d logp of that record) equals
  ``-(1/N) keep exp(d) A`` on that record's tokens; "not run" when none was captured;
- ``audit.metrics``: every captured metric named like ours (``m2_before``, ``m2_after``,
  ``masked_fraction``, ``trust_region_fraction``, ``valid_count``, ``trust_region_count``,
  ``kept_trust_region_count``) equals the optimizer batch's, on every rank; "not run" when
  none is logged;
- ``audit.parameter_gradient``: no trainable parameter has an all-zero (or no) gradient on
  every rank at every recorded step where some parameter has one (one step is not evidence:
  :func:`always_silent_parameters`); "not run" when no rank noted its parameters' gradient norms.

Diagnosis of a failing step names only what it reproduces from the files (:data:`DESCRIPTIONS`):
the selection's scope (each micro-batch, DP rank or CP shard selecting alone), the loss's
denominator (its own valid count, k times it, the kept count, N counted per CP shard or
once per CP replica), the behaviour log-probs (the current policy's), the policy's forward
(stochastic, or moved by an optimizer step between micro-batches) and parameters left without
a gradient.
"""

from __future__ import annotations

import functools
import math
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from m2po_oracle import capture as capture_module
from m2po_oracle import equivalence, oracle
from m2po_oracle.batch import Batch
from m2po_oracle.distributed.topology import RankCoords, Topology, cp_token_indices
from m2po_oracle.record import COUNT_FIELDS, METRIC_FIELDS

SCHEMA = "m2po-oracle/audit/1"
CHECK_NAMES = ("audit.replicas_identical", "audit.selection", "audit.policy_logp", "audit.behavior_logp", "audit.loss_sum",
               "audit.gradient", "audit.metrics", "audit.parameter_gradient")
EXIT_EQUIVALENT, EXIT_DIVERGENT, EXIT_UNUSABLE = 0, 1, 2
#: Rollout engines report log-probs in float32 at best (vLLM, HF generate's float32 logits).
ROLLOUT_LOGP_DTYPE = "float32"
#: Rows of the worst step's token table: enough to see the pattern, short enough to read.
COUNTEREXAMPLE_TOKENS = 24

DESCRIPTIONS = {
    "per_micro_batch_mask": "the mask is selected within each gradient-accumulation micro-batch alone, not over the optimizer batch",
    "per_rank_selection_global_n": "each DP rank selects over its own rows without communication (dividing by the global N)",
    "per_cp_chunk_selection_global_n": "each CP rank selects over its own shard without communication, dividing by the global N",
    "local_shard_selection": "each rank selects over its own CP shard without communication and divides by the shard's valid count",
    "dp_cp_group_double_count": "selection and N over the DP x CP group after CP reconstruction: every token counted once per CP replica",
    "per_micro_batch_denominator": "each micro-batch divides by its own valid count (then by k), not the optimizer batch's N",
    "local_denominator": "the global mask, but each rank's loss divided by its own (shard's) valid count",
    "kept_count_denominator": "the optimizer batch's mask, but the loss divided by the global kept count instead of N",
    "cp_shard_counts": "the global mask, but N counted on the CP shard and summed over DP only: too low by a factor cp",
    "current_policy_as_behavior": "the behaviour log-probs are the current policy's, not the sampler's: d is 0 and nothing is ever masked",
    "stochastic_forward": "the policy's forward is stochastic (dropout left on?): the selection's and the loss's forwards differ in every micro-batch",
    "optimizer_step_per_micro_batch": "optimizer.step() runs after every micro-batch: micro-batch 0's loss pass sees the selection's policy, later ones a moved policy",
    "parameters_without_gradient": "some parameters get no gradient (frozen or detached by mistake) while the loss depends on them",
}


@dataclass
class AuditCheck:
    name: str
    status: str  # "pass", "fail", "not run"
    summary: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "summary": self.summary}


@dataclass
class StepAudit:
    step: int
    verdict: str  # "equivalent", "divergent", "unusable"
    checks: list[AuditCheck] = field(default_factory=list)
    diagnosis: list[str] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    counterexample: dict[str, Any] | None = None
    alternatives: dict[str, list[str]] = field(default_factory=dict)  # diagnosis name -> names identical on this step

    @property
    def failing(self) -> list[str]:
        return [c.name for c in self.checks if c.status == "fail"]

    def to_json(self) -> dict[str, Any]:
        out = {"step": self.step, "verdict": self.verdict, "checks": [c.to_json() for c in self.checks],
               "diagnosis": list(self.diagnosis), "alternatives": dict(self.alternatives),
               "metrics": {k: _number(v) for k, v in self.metrics.items()}}
        if self.counterexample is not None:
            out["counterexample"] = self.counterexample
        return out


@dataclass
class AuditReport:
    directory: str
    world_size: int | None
    topology: str | None
    problems: list[str]
    steps: list[StepAudit]
    refused: str | None = None

    @property
    def verdict(self) -> str:
        if self.refused or not any(s.verdict != "unusable" for s in self.steps):
            return "unusable"
        return "divergent" if any(s.verdict == "divergent" for s in self.steps) else "equivalent"

    @property
    def exit_status(self) -> int:
        return {"equivalent": EXIT_EQUIVALENT, "divergent": EXIT_DIVERGENT}.get(self.verdict, EXIT_UNUSABLE)

    @property
    def worst_step(self) -> int | None:
        """The divergent step with the most failing checks (the earliest among equals)."""
        divergent = [s for s in self.steps if s.verdict == "divergent"]
        return max(divergent, key=lambda s: (len(s.failing), -s.step)).step if divergent else None

    def to_json(self) -> dict[str, Any]:
        named = sorted({name for s in self.steps for name in s.diagnosis} | {n for s in self.steps for names in s.alternatives.values() for n in names})
        return {
            "schema": SCHEMA,
            "verdict": self.verdict,
            "capture": {"directory": self.directory, "world_size": self.world_size, "topology": self.topology,
                        "steps": [s.step for s in self.steps], "problems": list(self.problems), "refused": self.refused},
            "steps": [s.to_json() for s in self.steps],
            "worst_step": self.worst_step,
            "descriptions": {name: DESCRIPTIONS[name] for name in named if name in DESCRIPTIONS},
        }


def _number(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


# ---------------------------------------------------------------------------------------------
# One record, and the optimizer batch reassembled from them.


@dataclass
class _Record:
    """One micro-batch of one rank, as 2-d float64 rows, and where it sits in the optimizer batch."""

    rank: int
    coords: RankCoords
    micro_batch: int
    logp: np.ndarray
    behavior_logp: np.ndarray
    advantages: np.ndarray
    mask: np.ndarray
    keep: np.ndarray
    selection_logp: np.ndarray | None
    rollout_logp: np.ndarray | None
    grad: np.ndarray | None
    loss: float
    tau: float
    metrics: dict[str, Any]
    dtype: str
    rows: slice = field(default_factory=lambda: slice(0, 0))
    columns: np.ndarray | slice = field(default_factory=lambda: slice(0, 0))

    @property
    def where(self) -> str:
        c = self.coords
        return f"rank {self.rank} (dp={c.dp}, cp={c.cp}, tp={c.tp}) micro-batch {self.micro_batch}"

    def batch(self, logp: np.ndarray | None = None) -> Batch:
        return Batch(self.logp if logp is None else logp, self.behavior_logp, self.advantages, self.mask, self.tau)


def _rows(tensor: Any, boolean: bool = False) -> np.ndarray:
    array = tensor.detach().to("cpu").numpy().astype(bool) if boolean else tensor.detach().to("cpu").double().numpy()
    if array.ndim == 0:
        return array.reshape(1, 1)
    if array.ndim == 1:
        return array.reshape(1, -1)
    return array.reshape(-1, array.shape[-1])


def _record(record: dict[str, Any], info: capture_module.RecordInfo, coords: RankCoords) -> _Record:
    shape = tuple(record["logp"].shape)
    optional = {}
    for name in ("grad", "selection_logp", "rollout_logp"):
        value = record.get(name)
        if value is not None and tuple(value.shape) != shape:
            path = info.grad_path if name == "grad" and info.grad_path else info.path
            raise capture_module.CaptureError(path, f"{name} has shape {list(value.shape)}, logp {list(shape)}")
        optional[name] = None if value is None else _rows(value)
    dtype = str(record["logp"].dtype).removeprefix("torch.")
    return _Record(info.rank, coords, info.micro_batch, _rows(record["logp"]), _rows(record["behavior_logp"]),
                   _rows(record["advantages"]), _rows(record["mask"], True), _rows(record["keep"], True),
                   optional["selection_logp"], optional["rollout_logp"], optional["grad"],
                   float(record["loss"]), float(record["tau"]), dict(record["metrics"]), dtype)


class _Unusable(Exception):
    """A step whose records cannot be put together (the reason is the message)."""


@dataclass
class _Step:
    step: int
    topology: Topology
    records: list[_Record]  # every rank's
    replica_set: list[_Record]  # TP rank 0's: one record per (dp, cp, micro-batch)
    batch: Batch  # the loss pass's log-probs
    selection_batch: Batch  # the selection's log-probs (the loss pass's where not recorded)
    keep: np.ndarray
    blocks: dict[tuple[int, int], slice]  # (dp, micro-batch) -> its rows
    micro_batches: dict[int, int]  # dp rank -> k
    dtype: str

    # Computed once per step and shared by the checks, the diagnosis and the worst step's table.

    @functools.cached_property
    def algorithm_1(self) -> dict[str, Any]:
        """Algorithm 1's keep and metrics on the log-probs the selection saw."""
        return _algorithm_1(self.selection_batch)

    @functools.cached_property
    def expected(self) -> Any:
        """The oracle's loss and gradient on the run's own mask (the loss pass's log-probs)."""
        return oracle.evaluate_with_mask(self.batch, self.keep)

    @functools.cached_property
    def selected(self) -> Any:
        """The oracle's metrics and counts on the run's own mask, from the log-probs the selection saw."""
        return self.expected if self.selection_batch.logp is self.batch.logp else oracle.evaluate_with_mask(self.selection_batch, self.keep)

    def rows_alone(self, group: list[_Record]) -> tuple[Batch, np.ndarray]:
        """The selection's batch and the run's keep on the whole rows of ``group`` (every CP shard of them)."""
        index = np.concatenate([np.arange(r.rows.start, r.rows.stop) for r in group if r.coords.cp == 0])
        s = self.selection_batch
        return Batch(s.logp[index], s.behavior_logp[index], s.advantages[index], s.valid[index], s.tau), self.keep[index]


def _non_finite_on_valid(record: _Record) -> str | None:
    for name in ("logp", "behavior_logp", "advantages", "selection_logp", "rollout_logp"):
        values = getattr(record, name)
        if values is None:
            continue
        bad = record.mask & ~np.isfinite(values)
        if bad.any():
            first = tuple(int(i) for i in np.argwhere(bad)[0])
            return f"{record.where}: {name} is {values[first].item()!r} on a valid token at {list(first)} ({int(bad.sum())} such token(s))"
    return None


def _assemble(step: int, topology: Topology, records: list[_Record]) -> _Step:
    cp = topology.cp
    by_place = {(r.coords.dp, r.coords.cp, r.coords.tp, r.micro_batch): r for r in records}
    micro_batches: dict[int, int] = {}
    for dp in range(topology.dp):
        counts = {(c, t): 1 + max((mb for (d, cc, tt, mb) in by_place if (d, cc, tt) == (dp, c, t)), default=-1)
                  for c in range(cp) for t in range(topology.tp)}
        if len(set(counts.values())) > 1:
            said = ", ".join(f"rank {topology.rank(dp=dp, cp=c, tp=t)}: {k}" for (c, t), k in sorted(counts.items()))
            raise _Unusable(f"the ranks of DP rank {dp} recorded different numbers of micro-batches ({said}); "
                            f"its CP and TP ranks must record the same micro-batches")
        micro_batches[dp] = next(iter(counts.values()))
    for record in records:
        why = _non_finite_on_valid(record)
        if why:
            raise _Unusable(f"non-finite input: {why}")

    replica_set = [r for r in records if r.coords.tp == 0]
    blocks: dict[tuple[int, int], slice] = {}
    widths: dict[tuple[int, int], int] = {}
    start = 0
    for dp in range(topology.dp):
        for mb in range(micro_batches[dp]):
            shards = [by_place[(dp, c, 0, mb)] for c in range(cp)]
            shapes = {s.logp.shape for s in shards}
            if len(shapes) > 1:
                said = ", ".join(f"rank {s.rank}: {list(s.logp.shape)}" for s in shards)
                raise _Unusable(f"the CP shards of DP rank {dp} micro-batch {mb} disagree in shape ({said}); "
                                f"every CP rank holds the same rows and an equal share of each sequence")
            rows, width = shards[0].logp.shape
            if cp > 1 and width % 2:
                raise _Unusable(f"DP rank {dp} micro-batch {mb}: a CP shard of width {width} cannot hold two equal chunks "
                                f"(the Megatron layout: 2 * cp chunks per sequence)")
            blocks[(dp, mb)] = slice(start, start + rows)
            widths[(dp, mb)] = width * cp
            start += rows
    width = max(widths.values(), default=0)
    separate_selection = any(r.selection_logp is not None for r in replica_set)
    logp, behavior, advantages = (np.zeros((start, width)) for _ in range(3))
    selection = np.zeros((start, width)) if separate_selection else logp  # no prepass recorded: the same array
    valid, keep = np.zeros((start, width), bool), np.zeros((start, width), bool)
    for record in replica_set:
        key = (record.coords.dp, record.micro_batch)
        record.rows = blocks[key]
        # A slice where it can be one: a fancy-index scatter of 16M float64 costs 0.3-0.6 s, a slice 0.02 s.
        record.columns = slice(0, widths[key]) if cp == 1 else cp_token_indices(widths[key], cp, record.coords.cp)
        at = (record.rows, record.columns)
        sources = [(logp, record.logp), (behavior, record.behavior_logp), (advantages, record.advantages), (valid, record.mask), (keep, record.keep)]
        if separate_selection:
            sources.append((selection, record.logp if record.selection_logp is None else record.selection_logp))
        for target, source in sources:
            target[at] = source
    for record in records:  # TP replicas sit where their TP rank 0 sits
        twin = by_place[(record.coords.dp, record.coords.cp, 0, record.micro_batch)]
        record.rows, record.columns = twin.rows, twin.columns
    taus = {r.tau for r in records}
    if len(taus) > 1:
        raise _Unusable(f"the records of this step disagree on tau: {sorted(taus)}")
    tau = records[0].tau
    if not math.isfinite(tau) or tau < 0:
        raise _Unusable(f"tau {tau!r} is not a finite number >= 0")
    dtype = records[0].dtype if records[0].dtype in equivalence.FORMATS else "float32"
    return _Step(step, topology, records, replica_set, Batch(logp, behavior, advantages, valid, tau),
                 Batch(selection, behavior, advantages, valid, tau), keep, blocks, micro_batches, dtype)


# ---------------------------------------------------------------------------------------------
# Comparisons.


def _fmt(mismatches: list[equivalence.Mismatch]) -> str:
    def one(m: equivalence.Mismatch) -> str:
        text = m.summary if m.check.startswith("audit.") else f"[{m.check}] {m.summary}"
        if m.field and m.actual is not None and m.expected is not None and not m.check.startswith("selection."):
            at = f" at index {m.index}" if m.index is not None else ""
            text += f": actual {m.actual!r}, expected {m.expected!r}{at}"
        return text + (f" ({m.details[0]})" if m.details else "")

    text = "; ".join(one(m) for m in mismatches[:3])
    return text + (f"; and {len(mismatches) - 3} more" if len(mismatches) > 3 else "")


def _share(record: _Record, denominator: float) -> tuple[float, np.ndarray]:
    """The record's loss and d loss / d logp on its own keep, divided by ``denominator``."""
    own = oracle.evaluate_with_mask(record.batch(), record.keep)
    factor = own.valid_count / denominator if denominator else 0.0
    return own.loss * factor, own.grad * factor


def _loss_mismatch(actual: float, expected: float, batch: Batch, grad: np.ndarray, dtype: str, check: str, name: str = "loss"
                   ) -> equivalence.Mismatch | None:
    allowance = equivalence.exp_rounding(batch, grad, dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        scale = float(np.sum(np.abs(grad)))
    return equivalence.compare_values(check, name, actual, expected, equivalence.tolerance(dtype, "loss"),
                                      scale=scale, allowance=float(np.sum(allowance)))


def _grad_mismatch(actual: np.ndarray, expected: np.ndarray, batch: Batch, dtype: str, check: str, name: str,
                   largest: float) -> equivalence.Mismatch | None:
    tol = equivalence.tolerance(dtype, "gradient")
    return equivalence.compare_values(check, name, actual, expected, tol, scale=largest * tol.rtol,
                                      allowance=equivalence.exp_rounding(batch, expected, dtype))


def _logp_mismatch(check: str, what: str, actual: np.ndarray, expected: np.ndarray, valid: np.ndarray, dtype: str
                   ) -> equivalence.Mismatch | None:
    # Log-probs are O(1): scale 1 keeps near-zero log-probs from demanding relative precision.
    return equivalence.compare_values(check, what, np.where(valid, actual, 0.0), np.where(valid, expected, 0.0),
                                      equivalence.tolerance(dtype, "metric"), scale=1.0)


def _shares_match(step: _Step, denominator: Callable[[_Record], float]) -> bool:
    """Every record's loss (and gradient, where captured) is its share with ``denominator(record)``."""
    for record in step.replica_set:
        loss, grad = _share(record, denominator(record))
        if _loss_mismatch(record.loss, loss, record.batch(), grad, step.dtype, "diagnosis") is not None:
            return False
        if record.grad is not None:
            largest = float(np.max(np.abs(grad))) if grad.size else 0.0
            if _grad_mismatch(record.grad, grad, record.batch(), step.dtype, "diagnosis", "grad", largest) is not None:
                return False
    return True


# ---------------------------------------------------------------------------------------------
# The checks of one step.


def _replicas_check(step: _Step) -> AuditCheck:
    if step.topology.tp == 1:
        return AuditCheck("audit.replicas_identical", "not run", "no TP replicas (tp = 1)")
    first = {(r.coords.dp, r.coords.cp, r.micro_batch): r for r in step.replica_set}
    found = []
    for record in step.records:
        if record.coords.tp == 0:
            continue
        twin = first[(record.coords.dp, record.coords.cp, record.micro_batch)]
        for name in ("logp", "behavior_logp", "advantages", "mask", "keep", "selection_logp", "rollout_logp", "grad"):
            mine, theirs = getattr(record, name), getattr(twin, name)
            if (mine is None) != (theirs is None):
                found.append(f"{record.where}: {name} is {'missing' if mine is None else 'recorded'} while its TP rank 0 (rank {twin.rank}) "
                             f"{'records' if mine is None else 'lacks'} it")
            elif mine is not None and mine.shape != theirs.shape:
                found.append(f"{record.where}: {name} has shape {list(mine.shape)}, its TP rank 0 (rank {twin.rank}) {list(theirs.shape)}")
            elif mine is not None and not np.array_equal(mine, theirs, equal_nan=mine.dtype != bool):
                differ = np.argwhere(~((mine == theirs) | (np.isnan(mine) & np.isnan(theirs)) if mine.dtype != bool else mine == theirs))
                at = tuple(int(i) for i in differ[0])
                found.append(f"{record.where}: {name}{list(at)} is {mine[at].item()!r}, its TP rank 0 (rank {twin.rank}) has {theirs[at].item()!r} "
                             f"({len(differ)} element(s) differ)")
        if not (record.loss == twin.loss or (math.isnan(record.loss) and math.isnan(twin.loss))):
            found.append(f"{record.where}: loss {record.loss!r}, its TP rank 0 (rank {twin.rank}) {twin.loss!r}")
    if found:
        return AuditCheck("audit.replicas_identical", "fail", "; ".join(found[:3]) + (f"; and {len(found) - 3} more" if len(found) > 3 else ""))
    return AuditCheck("audit.replicas_identical", "pass",
                      f"the {step.topology.tp} TP replicas of each of {len(step.replica_set)} records are identical")


def _selection_check(step: _Step) -> AuditCheck:
    batch = step.selection_batch
    found = equivalence.check_selection(batch, step.keep, step.dtype)
    if found:
        return AuditCheck("audit.selection", "fail", _fmt(found))
    on = "the selection's log-probs" if any(r.selection_logp is not None for r in step.replica_set) else "logp"
    return AuditCheck("audit.selection", "pass", f"the assembled keep ({int((step.keep & batch.valid).sum())} of {int(batch.valid.sum())} "
                      f"valid tokens kept) is an outcome of Algorithm 1 on the optimizer batch ({on})")


@dataclass(frozen=True)
class LogpBounds:
    """How far two recordings of log-probs may differ per valid token (None: equal at the dtype's
    precision). ``rollout``: the behaviour log-probs against the sampler's, for a trainer that
    recomputes them under the sampler's weights with other kernels; ``policy``: the loss pass
    against the selection's prepass, for nondeterministic kernels (bf16 atomics)."""

    rollout: float | None = None
    policy: float | None = None


def _logp_pairs(check: str, records: list[_Record], what: str, pair: Callable[[_Record], tuple[np.ndarray, np.ndarray]], dtype: str,
                atol: float | None, flag: str) -> tuple[dict[int, equivalence.Mismatch], str, float]:
    """Per record whose two log-prob recordings differ (by ``id``), the mismatch; the precision
    judged at; the largest difference on valid tokens."""
    with np.errstate(invalid="ignore"):
        gaps = {id(r): float(np.max(np.abs(np.subtract(*pair(r))), where=r.mask, initial=0.0)) for r in records}
    largest = max(gaps.values(), default=0.0)
    if atol is None:
        found = {id(r): m for r in records if (m := _logp_mismatch(check, f"{what} of {r.where}", *pair(r), r.mask, dtype))}
        return found, f"{dtype} precision", largest
    # The user states how far they may go: kernels and precision differ between the two.
    found = {id(r): equivalence.Mismatch(check, f"{what} of {r.where} differs by up to {gaps[id(r)]!r} > {atol!r}")
             for r in records if not gaps[id(r)] <= atol}
    return found, f"|difference| <= {flag} {atol!r}", largest


def _logp_agreement_check(step: _Step, check: str, records: list[_Record], missing: str, what: str,
                          pair: Callable[[_Record], tuple[np.ndarray, np.ndarray]], dtype: str, atol: float | None, flag: str,
                          claim: tuple[str, str]) -> AuditCheck:
    """``claim`` (what passing says, what failing says) judged on every record that holds the pair."""
    if not records:
        return AuditCheck(check, "not run", missing)
    found, precision, largest = _logp_pairs(check, records, what, pair, dtype, atol, flag)
    judged = f"({precision}; largest |difference| {largest!r})"
    if found:
        return AuditCheck(check, "fail", f"{len(found)} of {len(records)} records: {claim[1]} {judged}: " + _fmt(list(found.values())))
    return AuditCheck(check, "pass", f"in {len(records)} records {claim[0]} {judged}")


def _policy_logp_check(step: _Step, bounds: LogpBounds) -> AuditCheck:
    return _logp_agreement_check(step, "audit.policy_logp", [r for r in step.replica_set if r.selection_logp is not None],
                                 "no selection_logp recorded: the selection is taken to have seen logp", "logp against its selection_logp",
                                 lambda r: (r.logp, r.selection_logp), step.dtype, bounds.policy, "--policy-atol",
                                 ("the loss pass's log-probs equal the selection's", "the loss pass's log-probs are not the selection's"))


def _behavior_logp_check(step: _Step, bounds: LogpBounds) -> AuditCheck:
    return _logp_agreement_check(step, "audit.behavior_logp", [r for r in step.replica_set if r.rollout_logp is not None],
                                 "no rollout_logp recorded: nothing to check the behaviour log-probs against",
                                 "behavior_logp against the sampler's rollout_logp", lambda r: (r.behavior_logp, r.rollout_logp),
                                 equivalence.coarser(step.dtype, ROLLOUT_LOGP_DTYPE), bounds.rollout, "--rollout-atol",
                                 ("the behaviour log-probs equal the sampler's", "the behaviour log-probs are not the sampler's"))


def _loss_check(step: _Step, expected: Any) -> AuditCheck:
    total = math.fsum(r.loss for r in step.replica_set)
    found = _loss_mismatch(total, expected.loss, step.batch, expected.grad, step.dtype, "audit.loss_sum")
    if found:
        return AuditCheck("audit.loss_sum", "fail", _fmt([found]))
    return AuditCheck("audit.loss_sum", "pass", f"the {len(step.replica_set)} captured losses of one replica set add up to {total!r}, "
                      f"the global loss {expected.loss!r} (N = {expected.valid_count})")


def _gradient_check(step: _Step, expected: Any) -> AuditCheck:
    with_grad = [r for r in step.replica_set if r.grad is not None]
    if not with_grad:
        return AuditCheck("audit.gradient", "not run", "no gradient was captured at this step (watch_gradient or record(grad=))")
    largest = float(np.max(np.abs(expected.grad))) if expected.grad.size else 0.0
    found = [m for r in with_grad
             if (m := _grad_mismatch(r.grad, expected.grad[r.rows][:, r.columns], r.batch(), step.dtype, "audit.gradient", f"grad of {r.where}", largest))]
    if found:
        return AuditCheck("audit.gradient", "fail", _fmt(found))
    return AuditCheck("audit.gradient", "pass", f"{len(with_grad)} of {len(step.replica_set)} record gradients captured, each equals "
                      f"-(1/N) keep exp(d) A with the global N = {expected.valid_count}")


def _metrics_check(step: _Step, expected: Any) -> AuditCheck:
    tol = equivalence.tolerance(step.dtype, "metric")
    allowance = equivalence.m2_rounding(step.selection_batch, expected.keep, step.dtype)
    found, compared = [], set()
    for r in step.records:
        for name in METRIC_FIELDS + COUNT_FIELDS:
            if name not in r.metrics:
                continue
            compared.add(name)
            value, want = r.metrics[name], getattr(expected, name)
            where = f"{name} of {r.where}"
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                found.append(equivalence.Mismatch("audit.metrics", f"{where}: {value!r} is not a number"))
            elif name in COUNT_FIELDS:
                if value != want:
                    found.append(equivalence.Mismatch("audit.metrics", f"{where}: {value!r} differs from the optimizer batch's {want}"))
            else:
                m = equivalence.compare_values("audit.metrics", where, value, want, tol, allowance=allowance.get(name, 0.0))
                if m:
                    found.append(m)
    if not compared:
        return AuditCheck("audit.metrics", "not run", "no captured metric is named like ours (m2_before, m2_after, masked_fraction, ...)")
    if found:
        said = _logged_as(step, compared)
        return AuditCheck("audit.metrics", "fail", "".join(f"{what}; " for what in said) + _fmt(found))
    return AuditCheck("audit.metrics", "pass", f"{', '.join(sorted(compared))} equal the optimizer batch's in every record")


#: Logged M2 and fractions, judged per region: a port may log them per micro-batch and still
#: divide by (and log) the optimizer batch's N.
REGION_METRICS = ("m2_before", "m2_after", "masked_fraction")
#: How audit.metrics says a region's own metrics: scope -> (whose, logged how).
REGION_WORDS = {"per_cp_shard": ("each CP shard's own", "per CP shard"), "per_micro_batch_mask": ("each micro-batch's own", "per micro-batch"),
                "per_rank_selection_global_n": ("each DP rank's own", "per DP rank")}


def _logged_as(step: _Step, compared: set[str]) -> list[str]:
    """What logged metrics that are not the optimizer batch's are instead, where the files show it:
    each region's own M2 (Algorithm 1 on a micro-batch, DP rank or CP shard alone) and a
    valid_count of another scope. A statement about the logs, never a diagnosis of the loss."""
    said = []
    n = int(step.batch.valid.sum())
    counts = [(r, r.metrics["valid_count"]) for r in step.records
              if isinstance(r.metrics.get("valid_count"), (int, float)) and not isinstance(r.metrics["valid_count"], bool)]
    if counts and any(value != n for _, value in counts):
        for words, count in _count_scopes(step):
            if all(value == count(r) for r, value in counts):
                said.append(f"every logged valid_count is {words}, not the optimizer batch's N = {n}")
                break
    names = [name for name in REGION_METRICS if name in compared]
    scopes = _logged_scopes(step) if names and not _logged_globally(step, names) else []
    if scopes:
        whose, how = REGION_WORDS[scopes[0]]
        said.append(f"{', '.join(names)} are {whose} (Algorithm 1 on it alone): metrics logged {how}")
    return said


def _count_scopes(step: _Step) -> list[tuple[str, Callable[[_Record], int]]]:
    """The valid counts a port may log instead of N, each said as what it is, narrowest first."""
    cp = step.topology.cp
    block_n = {key: int(step.batch.valid[rows].sum()) for key, rows in step.blocks.items()}
    rank_n = {dp: sum(block_n[(dp, mb)] for mb in range(k)) for dp, k in step.micro_batches.items()}
    out: list[tuple[str, Callable[[_Record], int]]] = [
        (f"its record's own valid count (logged per micro-batch{' and CP shard' if cp > 1 else ''})", lambda r: int(r.mask.sum()))]
    if cp > 1:
        out.append(("its micro-batch's valid count over every CP shard (logged per micro-batch)", lambda r: block_n[(r.coords.dp, r.micro_batch)]))
    out.append(("its DP rank's valid count (logged per DP rank)", lambda r: rank_n[r.coords.dp]))
    if cp > 1:
        out.append((f"{cp} x N (every token counted once per CP replica)", lambda r: cp * int(step.batch.valid.sum())))
    return out


def _close(step: _Step, logged: Any, want: Any) -> bool:
    return equivalence.compare_values("diagnosis", "metric", logged, want, equivalence.tolerance(step.dtype, "metric")) is None


def _logged_globally(step: _Step, names: list[str]) -> bool:
    selected = step.selected
    return all(_close(step, r.metrics[name], getattr(selected, name)) for r in step.records for name in names if name in r.metrics)


def _logged_scopes(step: _Step) -> list[str]:
    """The scopes whose regions, each run through Algorithm 1 alone, give every record's logged
    M2 and fractions (a port that selects per micro-batch logs per-micro-batch M2, also on a
    step where its masks happen to agree with the optimizer batch's). The narrowest region
    first: a CP shard's metrics can equal its DP rank's by chance (the other shard all padding),
    not the reverse."""
    groups_by_scope = _scope_groups(step)
    matching = []
    for scope in sorted(groups_by_scope, key=lambda name: name != "per_cp_shard"):
        verdicts: list[bool] = []
        for group in groups_by_scope[scope]:
            if scope == "per_cp_shard":
                r = group[0]
                alone = _algorithm_1(r.batch(r.logp if r.selection_logp is None else r.selection_logp))
                places = {(r.coords.dp, r.coords.cp, r.micro_batch)}
                logged = [t for t in step.records if (t.coords.dp, t.coords.cp, t.micro_batch) in places]
            else:
                alone = _algorithm_1(step.rows_alone(group)[0])
                places = {(r.coords.dp, r.micro_batch) for r in group}
                logged = [t for t in step.records if (t.coords.dp, t.micro_batch) in places]
            verdicts += [_close(step, t.metrics[name], alone[name]) for t in logged for name in REGION_METRICS if name in t.metrics]
        if verdicts and all(verdicts):
            matching.append(scope)
    return matching


def always_silent_parameters(capture: capture_module.Capture) -> tuple[set[str], int]:
    """The parameters with no or an all-zero gradient at every recorded step where some parameter
    has one, and the number of such steps.

    One step is not evidence: a parameter's gradient can be exactly zero at one step for good
    reasons (an attention query or key projection when every position attends to one key).
    A freeze or a detach on the wrong tensor silences it at every step. All the capture's
    steps count, not only the audited ones (``--step``): the norms are in the manifests.
    """
    silent: set[str] | None = None
    steps = 0
    for step in capture.steps():
        noted = capture.parameter_gradients(step)
        norms: dict[str, list[Any]] = {}
        for by_name in noted.values():
            for name, entry in by_name.items():
                norms.setdefault(name, []).append(entry.get("norm"))
        if not any(n not in (None, 0.0) for values in norms.values() for n in values):
            continue  # no gradient at all this step (nothing kept, or advantages all zero)
        steps += 1
        here = {name for name, values in norms.items() if all(n in (None, 0.0) for n in values)}
        silent = here if silent is None else silent & here
    return silent or set(), steps


def _parameter_check(noted: dict[int, dict[str, Any]], expected: Any, silent_always: set[str], steps_with_gradient: int) -> AuditCheck:
    if not noted:
        return AuditCheck("audit.parameter_gradient", "not run", "no rank noted its parameters' gradient norms (record_parameter_gradients)")
    names = sorted({name for norms in noted.values() for name in norms})
    if not np.any(expected.grad):
        return AuditCheck("audit.parameter_gradient", "pass", f"{len(names)} parameters noted; the loss's gradient is zero at this step, "
                          f"so no parameter needs one")
    silent_here = [name for name in names
                   if all((norms.get(name) or {}).get("norm") in (None, 0.0) for norms in noted.values() if name in norms)]
    frozen = [name for name in silent_here if name in silent_always]
    if frozen:
        none = [n for n in frozen if all((noted[r].get(n) or {}).get("norm") is None for r in noted if n in noted[r])]
        shown = ", ".join(f"{n} ({'no gradient' if n in none else 'all zero'})" for n in frozen[:5])
        more = f" and {len(frozen) - 5} more" if len(frozen) > 5 else ""
        return AuditCheck("audit.parameter_gradient", "fail", f"{len(frozen)} of {len(names)} trainable parameters have no or an all-zero "
                          f"gradient on every rank at every one of the {steps_with_gradient} recorded step(s) with a gradient: {shown}{more}")
    passing = f"all {len(names)} trainable parameters noted by {len(noted)} rank(s) have a gradient"
    if silent_here:
        passing = (f"{len(names) - len(silent_here)} of {len(names)} trainable parameters have a gradient; {', '.join(silent_here[:3])}"
                   f"{' and more' if len(silent_here) > 3 else ''} are all zero at this step but not at every step (a gradient can be "
                   f"exactly zero at one step, e.g. attention with one key)")
    return AuditCheck("audit.parameter_gradient", "pass", passing)


# ---------------------------------------------------------------------------------------------
# Diagnosis: each name is tested against the files, never fitted to them.


def _group_selects_alone(step: _Step, group: list[_Record]) -> bool:
    """The records of ``group`` (one region of the optimizer batch) kept what Algorithm 1 keeps on that region alone."""
    if len(group) == 1 and step.topology.cp > 1:  # one CP shard: its own columns
        r = group[0]
        alone = r.batch(r.logp if r.selection_logp is None else r.selection_logp)
        return not equivalence.check_selection(alone, r.keep, step.dtype)
    # Otherwise the group holds every CP shard of its rows: whole rows of the assembled batch.
    alone, keep = step.rows_alone(group)
    return not equivalence.check_selection(alone, keep, step.dtype)


def _scope_groups(step: _Step) -> dict[str, list[list[_Record]]]:
    """The regions each scope deviation selects over, where that scope differs from the others."""
    by_block: dict[tuple[int, int], list[_Record]] = {}
    by_dp: dict[int, list[_Record]] = {}
    for r in step.replica_set:
        by_block.setdefault((r.coords.dp, r.micro_batch), []).append(r)
        by_dp.setdefault(r.coords.dp, []).append(r)
    groups: dict[str, list[list[_Record]]] = {}
    if any(k > 1 for k in step.micro_batches.values()):
        groups["per_micro_batch_mask"] = list(by_block.values())
    if step.topology.dp > 1:
        groups["per_rank_selection_global_n"] = list(by_dp.values())
    if step.topology.cp > 1:
        groups["per_cp_shard"] = [[r] for r in step.replica_set]
    return groups


def _denominators(step: _Step) -> dict[str, Callable[[_Record], float]]:
    """The global N and each denominator deviation's divisor per record, in the order ties are resolved."""
    n = float(step.batch.valid.sum())
    kept = float((step.keep & step.batch.valid).sum())
    block_n = {key: float(step.batch.valid[rows].sum()) for key, rows in step.blocks.items()}
    cp_n = {c: float(sum(r.mask.sum() for r in step.replica_set if r.coords.cp == c)) for c in range(step.topology.cp)}
    # The global N first: a deviation whose divisor is N on every record (equal micro-batch
    # counts make k times a micro-batch's count N) is the correct denominator on this step.
    out: dict[str, Callable[[_Record], float]] = {"global": lambda r: n}
    if any(k > 1 for k in step.micro_batches.values()):
        out["per_micro_batch_denominator"] = lambda r: step.micro_batches[r.coords.dp] * block_n[(r.coords.dp, r.micro_batch)]
    out["local_denominator"] = lambda r: float(r.mask.sum())
    if step.topology.cp > 1:
        out["cp_shard_counts"] = lambda r: cp_n[r.coords.cp]
        out["dp_cp_group_double_count"] = lambda r: step.topology.cp * n
    out["kept_count_denominator"] = lambda r: kept
    return out


def _distinct(step: _Step, candidates: dict[str, Callable[[_Record], float]]) -> tuple[dict[str, Callable[[_Record], float]], dict[str, list[str]]]:
    """The candidates whose divisors differ from every earlier one's on some record, and for
    each the later ones the files cannot tell from it (equal divisors on every record)."""
    first_of: dict[tuple[float, ...], str] = {}
    out: dict[str, Callable[[_Record], float]] = {}
    twins: dict[str, list[str]] = {}
    for name, fn in candidates.items():
        values = tuple(fn(r) for r in step.replica_set)
        if values in first_of:
            twins.setdefault(first_of[values], []).append(name)
            continue
        first_of[values] = name
        out[name] = fn
    return out, twins


def _logged_count(step: _Step, fn: Callable[[_Record], float]) -> bool:
    """Every logged ``valid_count`` is ``fn``'s divisor for its record, and not the batch's N:
    a denominator's evidence on a step whose loss cannot show it (nothing kept, or A = 0)."""
    n = int(step.batch.valid.sum())
    twin = {(r.coords.dp, r.coords.cp, r.micro_batch): r for r in step.replica_set}
    logged = [(r.metrics["valid_count"], fn(twin[(r.coords.dp, r.coords.cp, r.micro_batch)])) for r in step.records if "valid_count" in r.metrics]
    return bool(logged) and all(value == want for value, want in logged) and any(value != n for value, _ in logged)


def _diagnose(step: _Step, failing: set[str], noted: dict[int, dict[str, Any]], alternatives: dict[str, list[str]],
              bounds: LogpBounds = LogpBounds()) -> list[str]:
    """The deviations the files reproduce; ``alternatives`` gets, per name, the others that
    reproduce this step identically (the files cannot tell them apart)."""
    found: list[str] = []
    denominator = None
    candidates, twins = _distinct(step, _denominators(step))
    matching: list[str] = []
    # A denominator is named only where the loss and the gradient reproduce it and not the
    # global N: a logged valid_count is a number a port may log per micro-batch or per rank
    # whatever it divides by (audit.metrics says what it is), never evidence against them.
    if failing & {"audit.loss_sum", "audit.gradient"} and not _shares_match(step, candidates["global"]):
        matching = [name for name, fn in candidates.items() if name != "global" and _shares_match(step, fn)]
        if len(matching) > 1:
            # Records without kept terms fit any divisor: a logged valid_count may choose among
            # the divisors the loss and the gradient cannot tell apart, never beyond them.
            matching = [name for name in matching if _logged_count(step, candidates[name])] or matching
    if matching:
        denominator = matching[0]
        same = twins.get(denominator, []) + matching[1:]
        if same:
            alternatives[denominator] = same
    # On a small step several scopes can reproduce one mask; one name explaining the mask and
    # the denominator together (a CP shard alone, its own count) beats two.
    # A scope is named where the mask is not Algorithm 1's on the optimizer batch and is the
    # scope's: where the mask is a global outcome, per-region metrics are audit.metrics' finding.
    scopes: list[str] = []
    if "audit.selection" in failing:
        scopes = [scope for scope, groups in _scope_groups(step).items() if all(_group_selects_alone(step, g) for g in groups)]
    if scopes and denominator == "dp_cp_group_double_count" and _doubled_selection(step):
        scopes = []  # the doubled multiset's selection: the double count explains the mask too
    if "per_cp_shard" in scopes and denominator == "local_denominator":
        found.append("local_shard_selection")
        denominator = None
    elif scopes:
        found.append("per_cp_chunk_selection_global_n" if scopes[0] == "per_cp_shard" else scopes[0])
    if denominator is not None:
        found.append(denominator)
    if "audit.behavior_logp" in failing and _behaviour_is_the_policy(step):
        found.append("current_policy_as_behavior")
    if "audit.policy_logp" in failing:
        found += _forward_deviation(step, bounds)
    if "audit.parameter_gradient" in failing:
        found.append("parameters_without_gradient")
    return found


def _doubled_selection(step: _Step) -> bool:
    """The joined mask is an outcome of Algorithm 1 on the batch with every token counted cp times."""
    s, cp = step.selection_batch, step.topology.cp
    doubled = Batch(*(np.concatenate([a] * cp) for a in (s.logp, s.behavior_logp, s.advantages, s.valid)), s.tau)
    return not equivalence.check_selection(doubled, np.concatenate([step.keep] * cp), step.dtype)


def _behaviour_is_the_policy(step: _Step) -> bool:
    """The behaviour log-probs equal the policy's (the selection's forward) on every record, and not the sampler's."""
    with_rollout = [r for r in step.replica_set if r.rollout_logp is not None]
    return bool(with_rollout) and all(
        _logp_mismatch("diagnosis", "behavior_logp", r.behavior_logp, r.logp if r.selection_logp is None else r.selection_logp,
                       r.mask, step.dtype) is None for r in with_rollout)


def _forward_deviation(step: _Step, bounds: LogpBounds) -> list[str]:
    records = [r for r in step.replica_set if r.selection_logp is not None and r.mask.any()]
    found, _, _ = _logp_pairs("diagnosis", records, "logp", lambda r: (r.logp, r.selection_logp), step.dtype, bounds.policy, "--policy-atol")
    differs = {(r.coords.dp, r.coords.cp, r.micro_batch): id(r) in found for r in records}
    if not differs:
        return []
    first = [v for (dp, cp, mb), v in differs.items() if mb == 0]
    later = [v for (dp, cp, mb), v in differs.items() if mb > 0]
    if first and later and not any(first) and all(later):
        return ["optimizer_step_per_micro_batch"]
    if all(differs.values()):
        return ["stochastic_forward"]
    return []


# ---------------------------------------------------------------------------------------------
# The worst step's token table.


#: Which failing check the worst step's table shows: the first of these that failed.
TABLE_ORDER = ("audit.selection", "audit.behavior_logp", "audit.policy_logp", "audit.gradient", "audit.loss_sum", "audit.metrics",
               "audit.parameter_gradient", "audit.replicas_identical")


def _largest_first(error: np.ndarray) -> np.ndarray:
    flat = np.flatnonzero(error)
    flat = flat[np.argsort(-error.flat[flat], kind="stable")]
    return np.stack(np.unravel_index(flat, error.shape), axis=1)


def _counterexample(step: _Step, audit: StepAudit, directory: str, noted: dict[int, dict[str, Any]], silent_always: set[str]) -> dict[str, Any]:
    """What shows the worst step's failure: one row per token (``tokens``) or per logged value (``values``)."""
    check = next(name for name in TABLE_ORDER if name in audit.failing)
    batch, s = step.batch, step.selection_batch
    d = oracle.log_ratio(s.logp, s.behavior_logp, s.valid)
    expected_keep, expected = step.algorithm_1["keep"], step.expected
    grad, rollout = np.full(batch.shape, np.nan), np.full(batch.shape, np.nan)
    owner = np.full(batch.shape, -1, dtype=np.int64)  # index into the replica set, -1 on padding
    for index, r in enumerate(step.replica_set):
        if r.grad is not None:
            grad[r.rows, r.columns] = r.grad
        if r.rollout_logp is not None:
            rollout[r.rows, r.columns] = r.rollout_logp
        owner[r.rows, r.columns] = index
    compared: tuple[str, np.ndarray, np.ndarray] | None = None
    values: list[dict[str, Any]] = []
    order = np.zeros((0, 2), dtype=np.int64)
    if check == "audit.selection":
        note = ("tokens whose captured keep differs from Algorithm 1's on the whole optimizer batch "
                "(a tie at the cut may fall either way; the check allows it)")
        order = np.argwhere(batch.valid & (step.keep != expected_keep))
    elif check in ("audit.behavior_logp", "audit.policy_logp"):
        if check == "audit.behavior_logp":
            compared = ("behavior_logp against rollout_logp", batch.behavior_logp, rollout)
            note = "the tokens where the behaviour log-probs the loss used differ most from the sampler's"
        else:
            compared = ("logp against selection_logp", batch.logp, s.logp)
            note = "the tokens where the loss pass's log-probs differ most from those the selection saw"
        with np.errstate(invalid="ignore"):
            order = _largest_first(np.where(batch.valid & np.isfinite(compared[2]), np.abs(compared[1] - compared[2]), 0.0))
    elif check in ("audit.gradient", "audit.loss_sum"):
        error = np.where(batch.valid & np.isfinite(grad), np.abs(np.nan_to_num(grad) - expected.grad), 0.0)
        note = "the tokens where the captured gradient differs most from -(1/N) keep exp(d) A with the global N"
        if not np.any(error):
            error = np.where(step.keep & batch.valid, np.abs(expected.grad), 0.0)
            note = "no gradient captured: the kept tokens with the largest terms of the global loss, -(1/N) exp(d) A"
        order = _largest_first(error)
    elif check == "audit.metrics":
        note = "the logged metrics that differ from the optimizer batch's"
        selected = step.selected
        for r in step.records:
            for name in METRIC_FIELDS + COUNT_FIELDS:
                if name in r.metrics and isinstance(r.metrics[name], (int, float)) and not isinstance(r.metrics[name], bool):
                    want = getattr(selected, name)
                    if not math.isclose(float(r.metrics[name]), float(want), rel_tol=1e-9, abs_tol=1e-12):
                        values.append({"where": r.where, "name": name, "captured": _number(float(r.metrics[name])), "expected": _number(float(want))})
    elif check == "audit.parameter_gradient":
        note = "the trainable parameters whose gradient norm is zero (or that have no gradient) on every rank at every recorded step with a gradient"
        for rank, norms in sorted(noted.items()):
            for name, entry in sorted(norms.items()):
                if entry.get("norm") in (None, 0.0) and name in silent_always:
                    values.append({"where": f"rank {rank}", "name": name, "captured": entry.get("norm"), "expected": "a non-zero norm"})
    else:
        note = "the TP replicas differ: the check's summary names the field, rank and element"
    rows = []
    for row, column in (tuple(int(i) for i in at) for at in order[:COUNTEREXAMPLE_TOKENS]):
        record = step.replica_set[owner[row, column]] if owner[row, column] >= 0 else None
        token = {
            "row": row, "position": column,
            "rank": record.rank if record else None, "micro_batch": record.micro_batch if record else None,
            "d": _number(float(d[row, column])), "m2": _number(float(d[row, column]) ** 2), "advantage": _number(float(batch.advantages[row, column])),
            "keep": bool(step.keep[row, column]), "algorithm_1_keeps": bool(expected_keep[row, column]),
            "grad": _number(float(grad[row, column])) if np.isfinite(grad[row, column]) else None,
            "expected_grad": _number(float(expected.grad[row, column])),
        }
        if compared is not None:
            token["compared"] = {"what": compared[0], "captured": _number(float(compared[1][row, column])),
                                 "expected": _number(float(compared[2][row, column]))}
        rows.append(token)
    found = len(order) if not values else len(values)
    return {"check": check, "note": note, "tokens": rows, "values": values[:COUNTEREXAMPLE_TOKENS], "shown": len(rows) or len(values[:COUNTEREXAMPLE_TOKENS]),
            "of": int(found), "tau": _number(float(batch.tau)), "valid_count": int(batch.valid.sum()),
            "replay": shlex.join(["m2po-oracle", "audit", directory, "--step", str(step.step)])}


# ---------------------------------------------------------------------------------------------


def _algorithm_1(batch: Batch) -> dict[str, Any]:
    """Algorithm 1's keep and metrics on ``batch`` (``oracle.m2po`` without its loss and gradient,
    which cost half its time at 16M tokens and are not needed here)."""
    d = oracle.log_ratio(batch.logp, batch.behavior_logp, batch.valid)
    m2 = oracle.second_moment(d)
    trust = oracle.trust_region(d, batch.advantages, batch.valid)
    keep = batch.valid & ~oracle.select_sorted(m2, trust, batch.tau)
    return {"keep": keep, **oracle.metrics(m2, trust, keep, batch.valid)}


def _audit_step(step: _Step, noted: dict[int, dict[str, Any]], silent: tuple[set[str], int], bounds: LogpBounds = LogpBounds()) -> StepAudit:
    audit = StepAudit(step.step, "equivalent")
    algorithm = step.algorithm_1
    audit.metrics = {"m2_before": algorithm["m2_before"], "m2_after": algorithm["m2_after"],
                     "masked_fraction": algorithm["masked_fraction"], "tau": step.batch.tau}
    # M2 and the counts are the selection's: judged on the log-probs it saw (a prepass when recorded).
    audit.checks = [_replicas_check(step), _selection_check(step), _policy_logp_check(step, bounds), _behavior_logp_check(step, bounds),
                    _loss_check(step, step.expected), _gradient_check(step, step.expected), _metrics_check(step, step.selected),
                    _parameter_check(noted, step.expected, *silent)]
    if audit.failing:
        audit.verdict = "divergent"
        audit.diagnosis = _diagnose(step, set(audit.failing), noted, audit.alternatives, bounds)
    return audit


def _unusable(step: int, why: str) -> StepAudit:
    return StepAudit(step, "unusable", [AuditCheck(name, "not run", why) for name in CHECK_NAMES])


def _records_of(capture: capture_module.Capture, topology: Topology, step: int, bad_paths: set[str],
                problems: list[str]) -> list[_Record]:
    keys = sorted(k for k in capture.keys() if k[1] == step)  # noqa: SIM118 - Capture.keys() is a method, not a dict
    ranks = {k[0] for k in keys}
    missing = sorted(set(range(capture.world_size)) - ranks)
    if missing:
        raise _Unusable(f"incomplete step: no records of rank(s) {missing}")
    gaps = [r for r in ranks if sorted(k[2] for k in keys if k[0] == r) != list(range(1 + max(k[2] for k in keys if k[0] == r)))]
    if gaps:
        raise _Unusable(f"incomplete step: rank(s) {sorted(gaps)} miss micro-batches")
    records = []
    for key in keys:
        info = capture.info(*key)
        if str(info.path) in bad_paths or (info.grad_path is not None and str(info.grad_path) in bad_paths):
            raise _Unusable(f"incomplete step: the files of rank {key[0]} micro-batch {key[2]} have problems (listed in the capture's problems)")
        try:
            records.append(_record(capture.load(*key), info, topology.coords(key[0])))
        except capture_module.CaptureError as error:
            problems.append(str(error))
            raise _Unusable(f"incomplete step: {error}") from None
    return records


def audit_capture(directory: str | Path, *, steps: set[int] | None = None, rollout_atol: float | None = None,
                  policy_atol: float | None = None) -> AuditReport:
    """Audit every recorded optimizer step of a capture (or only ``steps``); never raises on a bad capture.

    ``rollout_atol``: how far the behaviour log-probs may be from the sampler's (``rollout_logp``)
    per valid token, for a trainer that recomputes them under the sampler's weights with other
    kernels; None: they must be equal at float32 precision (the sampler's own numbers).
    ``policy_atol``: how far the loss pass's log-probs may be from the selection's prepass
    (``selection_logp``), for nondeterministic kernels; None: equal at the dtype's precision."""
    for name, value in (("rollout_atol", rollout_atol), ("policy_atol", policy_atol)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0):
            raise ValueError(f"{name} must be None or a finite number >= 0, got {value!r}")
    bounds = LogpBounds(rollout=rollout_atol, policy=policy_atol)
    problems_found, capture = capture_module.inspect_capture(directory)
    problems = [f"{path}: {problem}" for path, problem in problems_found]
    if capture is None:
        return AuditReport(str(directory), None, None, problems, [])
    report = AuditReport(str(capture.directory), capture.world_size, capture.topology, problems, [])
    try:
        topology = Topology.parse(capture.topology)
        if topology.world_size != capture.world_size:
            raise ValueError(f"it has {topology.world_size} ranks, the manifests say world_size = {capture.world_size}")
    except ValueError as error:
        report.refused = f"topology {capture.topology!r} cannot be read: {error}"
        return report
    bad_paths = {path for path, _ in problems_found}
    silent = always_silent_parameters(capture)
    worst: StepAudit | None = None  # as AuditReport.worst_step: most failing checks, the earliest among equals
    for step in capture.steps():
        if steps is not None and step not in steps:
            continue
        try:
            assembled = _assemble(step, topology, _records_of(capture, topology, step, bad_paths, problems))
            audit = _audit_step(assembled, capture.parameter_gradients(step), silent, bounds)
            report.steps.append(audit)
            if audit.verdict == "divergent" and (worst is None or len(audit.failing) > len(worst.failing)):
                # Built while the step's arrays are in memory (not re-read at the end); a later,
                # worse step replaces it, at most once per number of failing checks.
                _attach_counterexample(report, worst, audit, assembled, str(directory), capture.parameter_gradients(step), silent[0])
                worst = audit
        except _Unusable as why:
            report.steps.append(_unusable(step, str(why)))
        except Exception as error:  # noqa: BLE001 - a capture is data: one odd step must not end the audit
            report.steps.append(_unusable(step, f"could not be audited: {type(error).__name__}: {error}"))
    return report


def _attach_counterexample(report: AuditReport, displaced: StepAudit | None, audit: StepAudit, step: _Step, directory: str,
                           noted: dict[int, dict[str, Any]], silent_always: set[str]) -> None:
    """The worst step so far gets the token table; the one it displaces loses its table."""
    if displaced is not None:
        displaced.counterexample = None
    try:
        audit.counterexample = _counterexample(step, audit, directory, noted, silent_always)
    except Exception as error:  # noqa: BLE001 - the table is an aid; the verdicts stand without it
        report.problems.append(f"step {step.step}: the counterexample table could not be built: {type(error).__name__}: {error}")
