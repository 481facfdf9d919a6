"""Offline audit of a recorded training run against Algorithm 1 (issue 15, step 2).

Reads a capture (:mod:`m2po_oracle.capture`) and, for every recorded optimizer step,
reassembles the optimizer batch from every data-parallel rank's micro-batches (rows
concatenated in (rank, micro_batch) order, sequences padded to the longest T with invalid
positions) and judges it with the float64 oracle. Pure data parallel only (``cp=1, tp=1``):
a capture with context- or tensor-parallel ranks is refused, their reassembly (CP shards,
TP replicas) is not implemented yet.

Checks per step (loss, gradient and metrics are judged on the mask the run chose, as
``compare`` does, so that a selection bug does not also fail them):

- ``audit.selection``: the assembled ``keep`` is an outcome of Algorithm 1 on the whole
  optimizer batch (:func:`equivalence.check_selection`, the captured dtype as compute dtype);
- ``audit.loss_sum``: the captured losses of every rank and micro-batch add up to the
  oracle's global loss ``-(1/N) sum keep exp(d) A``, N the valid count of the whole
  optimizer batch. This is the project's convention: each micro-batch's loss is its share
  with the global N, so the rank losses of one replica set add up to the global loss
  (under DDP, which averages gradients over the DP group, a trainer multiplies by the DP
  size for the backward; the *recorded* loss is the share before that factor);
- ``audit.gradient``: each captured gradient (d loss / d logp of that micro-batch) equals
  ``-(1/N) keep exp(d) A`` on that micro-batch's tokens; "not run" when no gradient was captured;
- ``audit.metrics``: every captured metric named like ours (``m2_before``, ``m2_after``,
  ``masked_fraction``, ``trust_region_fraction``, ``valid_count``, ``trust_region_count``,
  ``kept_trust_region_count``) equals the optimizer batch's; "not run" when none is logged.

Diagnosis of a failing step, only of what it reproduces: ``per_micro_batch_mask`` (every
micro-batch's ``keep`` is Algorithm 1 run on that micro-batch alone, and the assembled one
is not an outcome on the whole batch), ``per_micro_batch_denominator`` (the losses, and the
gradients where captured, match N counted per micro-batch).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from m2po_oracle import capture as capture_module
from m2po_oracle import equivalence, oracle
from m2po_oracle.batch import Batch
from m2po_oracle.record import COUNT_FIELDS, METRIC_FIELDS

SCHEMA = "m2po-oracle/audit/1"
CHECK_NAMES = ("audit.selection", "audit.loss_sum", "audit.gradient", "audit.metrics")
EXIT_EQUIVALENT, EXIT_DIVERGENT, EXIT_UNUSABLE = 0, 1, 2
REFUSED_CP_TP = ("CP/TP reassembly is not implemented yet: the audit handles pure data-parallel captures "
                 "(cp=1, tp=1) only")


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

    @property
    def failing(self) -> list[str]:
        return [c.name for c in self.checks if c.status == "fail"]

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "verdict": self.verdict, "checks": [c.to_json() for c in self.checks],
                "diagnosis": list(self.diagnosis), "metrics": {k: _number(v) for k, v in self.metrics.items()}}


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
        return {
            "schema": SCHEMA,
            "verdict": self.verdict,
            "capture": {"directory": self.directory, "world_size": self.world_size, "topology": self.topology,
                        "steps": [s.step for s in self.steps], "problems": list(self.problems), "refused": self.refused},
            "steps": [s.to_json() for s in self.steps],
            "worst_step": self.worst_step,
        }


def _number(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def _sizes(topology: str) -> dict[str, int]:
    return {key: int(value) for key, value in re.findall(r"(dp|cp|tp)=([0-9]+)", topology or "")}


# ---------------------------------------------------------------------------------------------


@dataclass
class _Part:
    """One micro-batch of one rank, as 2-d float64 rows."""

    rank: int
    micro_batch: int
    shape: tuple[int, ...]
    logp: np.ndarray
    behavior_logp: np.ndarray
    advantages: np.ndarray
    mask: np.ndarray
    keep: np.ndarray
    grad: np.ndarray | None
    loss: float
    tau: float
    metrics: dict[str, Any]
    dtype: str

    def batch(self) -> Batch:
        return Batch(self.logp, self.behavior_logp, self.advantages, self.mask, self.tau)


def _rows(tensor: Any, dtype: Any) -> np.ndarray:
    array = tensor.detach().to("cpu").double().numpy() if dtype is None else tensor.detach().to("cpu").numpy().astype(bool)
    if array.ndim == 0:
        return array.reshape(1, 1)
    if array.ndim == 1:
        return array.reshape(1, -1)
    return array.reshape(-1, array.shape[-1])


def _part(record: dict[str, Any], info: capture_module.RecordInfo) -> _Part:
    shape = tuple(record["logp"].shape)
    grad = record.get("grad")
    grad_rows = None
    if grad is not None:
        if tuple(grad.shape) != shape:
            raise capture_module.CaptureError(info.grad_path or info.path, f"grad has shape {list(grad.shape)}, logp {list(shape)}")
        grad_rows = _rows(grad, None)
    dtype = str(record["logp"].dtype).removeprefix("torch.")
    return _Part(info.rank, info.micro_batch, shape, _rows(record["logp"], None), _rows(record["behavior_logp"], None),
                 _rows(record["advantages"], None), _rows(record["mask"], bool), _rows(record["keep"], bool), grad_rows,
                 float(record["loss"]), float(record["tau"]), dict(record["metrics"]), dtype)


def _assemble(parts: list[_Part]) -> tuple[Batch, np.ndarray, list[slice]]:
    width = max(p.logp.shape[1] for p in parts)
    rows = sum(p.logp.shape[0] for p in parts)
    logp, behavior, advantages = (np.zeros((rows, width)) for _ in range(3))
    valid, keep = np.zeros((rows, width), bool), np.zeros((rows, width), bool)
    slices, start = [], 0
    for p in parts:
        r, t = p.logp.shape
        for target, source in ((logp, p.logp), (behavior, p.behavior_logp), (advantages, p.advantages), (valid, p.mask), (keep, p.keep)):
            target[start:start + r, :t] = source
        slices.append(slice(start, start + r))
        start += r
    return Batch(logp, behavior, advantages, valid, parts[0].tau), keep, slices


def _fmt(mismatches: list[equivalence.Mismatch]) -> str:
    def one(m: equivalence.Mismatch) -> str:
        text = m.summary if m.check.startswith("audit.") else f"[{m.check}] {m.summary}"
        if m.field and m.actual is not None and m.expected is not None and not m.check.startswith("selection."):
            at = f" at index {m.index}" if m.index is not None else ""
            text += f": actual {m.actual!r}, expected {m.expected!r}{at}"
        return text + (f" ({m.details[0]})" if m.details else "")

    text = "; ".join(one(m) for m in mismatches[:3])
    return text + (f"; and {len(mismatches) - 3} more" if len(mismatches) > 3 else "")


def _loss_mismatch(actual: float, expected: Any, batch: Batch, dtype: str, check: str) -> equivalence.Mismatch | None:
    allowance = equivalence.exp_rounding(batch, expected.grad, dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        scale = float(np.sum(np.abs(expected.grad)))
    return equivalence.compare_values(check, "loss", actual, expected.loss, equivalence.tolerance(dtype, "loss"),
                                      scale=scale, allowance=float(np.sum(allowance)))


def _grad_mismatch(actual: np.ndarray, expected: np.ndarray, batch: Batch, dtype: str, check: str, name: str,
                   largest: float) -> equivalence.Mismatch | None:
    tol = equivalence.tolerance(dtype, "gradient")
    return equivalence.compare_values(check, name, actual, expected, tol, scale=largest * tol.rtol,
                                      allowance=equivalence.exp_rounding(batch, expected, dtype))


def _audit_parts(step: int, parts: list[_Part]) -> StepAudit:
    dtype = parts[0].dtype if parts[0].dtype in equivalence.FORMATS else "float32"
    batch, keep, slices = _assemble(parts)
    audit = StepAudit(step, "equivalent")
    algorithm = oracle.m2po(batch, vectorised=True)
    audit.metrics = {"m2_before": algorithm.m2_before, "m2_after": algorithm.m2_after,
                     "masked_fraction": algorithm.masked_fraction, "tau": batch.tau}

    selection = equivalence.check_selection(batch, keep, dtype)
    audit.checks.append(AuditCheck("audit.selection", "fail" if selection else "pass",
                                   _fmt(selection) if selection else f"the assembled keep ({int((keep & batch.valid).sum())} of "
                                   f"{int(batch.valid.sum())} valid tokens kept) is an outcome of Algorithm 1 on the optimizer batch"))
    expected = oracle.evaluate_with_mask(batch, keep)

    total = math.fsum(p.loss for p in parts)
    loss = _loss_mismatch(total, expected, batch, dtype, "audit.loss_sum")
    audit.checks.append(AuditCheck("audit.loss_sum", "fail" if loss else "pass",
                                   _fmt([loss]) if loss else f"the {len(parts)} captured losses add up to {total!r}, "
                                   f"the global loss {expected.loss!r} (N = {expected.valid_count})"))

    with_grad = [(p, s) for p, s in zip(parts, slices) if p.grad is not None]
    if not with_grad:
        audit.checks.append(AuditCheck("audit.gradient", "not run", "no gradient was captured at this step (watch_gradient)"))
    else:
        largest = float(np.max(np.abs(expected.grad))) if expected.grad.size else 0.0
        found = []
        for p, s in with_grad:
            t = p.logp.shape[1]
            m = _grad_mismatch(p.grad, expected.grad[s, :t], p.batch(), dtype, "audit.gradient", f"grad of rank {p.rank} micro-batch {p.micro_batch}", largest)
            if m:
                found.append(m)
        audit.checks.append(AuditCheck("audit.gradient", "fail" if found else "pass",
                                       _fmt(found) if found else f"{len(with_grad)} of {len(parts)} micro-batch gradients captured, "
                                       f"each equals -(1/N) keep exp(d) A with the global N = {expected.valid_count}"))

    audit.checks.append(_metrics_check(parts, batch, expected, dtype))
    if audit.failing:
        audit.verdict = "divergent"
        audit.diagnosis = _diagnose(audit, parts, slices, dtype)
    return audit


def _metrics_check(parts: list[_Part], batch: Batch, expected: Any, dtype: str) -> AuditCheck:
    tol = equivalence.tolerance(dtype, "metric")
    allowance = equivalence.m2_rounding(batch, expected.keep, dtype)
    found, compared = [], set()
    for p in parts:
        for name in METRIC_FIELDS + COUNT_FIELDS:
            if name not in p.metrics:
                continue
            compared.add(name)
            value, want = p.metrics[name], getattr(expected, name)
            where = f"{name} of rank {p.rank} micro-batch {p.micro_batch}"
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
        return AuditCheck("audit.metrics", "fail", _fmt(found))
    return AuditCheck("audit.metrics", "pass", f"{', '.join(sorted(compared))} equal the optimizer batch's in every micro-batch")


def _diagnose(audit: StepAudit, parts: list[_Part], slices: list[slice], dtype: str) -> list[str]:
    found = []
    failing = set(audit.failing)
    if "audit.selection" in failing and all(not equivalence.check_selection(p.batch(), p.keep, dtype) for p in parts):
        found.append("per_micro_batch_mask")
    if failing & {"audit.loss_sum", "audit.gradient"}:
        matches = True
        for p in parts:
            own = oracle.evaluate_with_mask(p.batch(), p.keep)
            if _loss_mismatch(p.loss, own, p.batch(), dtype, "loss") is not None:
                matches = False
                break
            if p.grad is not None:
                largest = float(np.max(np.abs(own.grad))) if own.grad.size else 0.0
                if _grad_mismatch(p.grad, own.grad, p.batch(), dtype, "gradient", "grad", largest) is not None:
                    matches = False
                    break
        if matches:
            found.append("per_micro_batch_denominator")
    return found


def _unusable(step: int, why: str) -> StepAudit:
    return StepAudit(step, "unusable", [AuditCheck(name, "not run", why) for name in CHECK_NAMES])


def audit_capture(directory: str | Path, *, steps: set[int] | None = None) -> AuditReport:
    """Audit every recorded optimizer step of a capture (or only ``steps``); never raises on a bad capture."""
    problems_found, capture = capture_module.inspect_capture(directory)
    problems = [f"{path}: {problem}" for path, problem in problems_found]
    if capture is None:
        return AuditReport(str(directory), None, None, problems, [])
    report = AuditReport(str(capture.directory), capture.world_size, capture.topology, problems, [])
    sizes = _sizes(capture.topology)
    if sizes.get("cp", 1) > 1 or sizes.get("tp", 1) > 1:
        report.refused = f"topology {capture.topology}: {REFUSED_CP_TP}"
        return report
    bad_paths = {path for path, _ in problems_found}
    for step in capture.steps():
        if steps is not None and step not in steps:
            continue
        keys = sorted(k for k in capture.keys() if k[1] == step)  # noqa: SIM118 - Capture.keys() is a method, not a dict
        ranks = {k[0] for k in keys}
        missing = sorted(set(range(capture.world_size)) - ranks)
        if missing:
            report.steps.append(_unusable(step, f"incomplete step: no records of rank(s) {missing}"))
            continue
        gaps = [r for r in ranks if sorted(k[2] for k in keys if k[0] == r) != list(range(1 + max(k[2] for k in keys if k[0] == r)))]
        if gaps:
            report.steps.append(_unusable(step, f"incomplete step: rank(s) {sorted(gaps)} miss micro-batches"))
            continue
        parts, why = [], None
        for key in keys:
            info = capture.info(*key)
            if str(info.path) in bad_paths or (info.grad_path is not None and str(info.grad_path) in bad_paths):
                why = f"incomplete step: the files of rank {key[0]} micro-batch {key[2]} have problems (listed in the capture's problems)"
                break
            try:
                parts.append(_part(capture.load(*key), info))
            except capture_module.CaptureError as error:
                problems.append(str(error))
                why = f"incomplete step: {error}"
                break
        if why is None and len({p.tau for p in parts}) > 1:
            why = f"the micro-batches of this step disagree on tau: {sorted({p.tau for p in parts})}"
        if why is None and (not math.isfinite(parts[0].tau) or parts[0].tau < 0):
            why = f"tau {parts[0].tau!r} is not a finite number >= 0"
        if why is not None:
            report.steps.append(_unusable(step, why))
            continue
        try:
            report.steps.append(_audit_parts(step, parts))
        except Exception as error:  # noqa: BLE001 - a capture is data: one odd step must not end the audit
            report.steps.append(_unusable(step, f"could not be audited: {type(error).__name__}: {error}"))
    return report
