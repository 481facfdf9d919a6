"""What an audit reads and what it reports: the report's records (a check, a step, the
run), the names the diagnosis may give, and one rank's micro-batch loaded from a capture as
float64 rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
from msgspec import UNSET, UnsetType

from m2po_oracle.adapters.binding import METRIC_NAMES, logged_metrics
from m2po_oracle.capture import reader
from m2po_oracle.distributed.topology import RankCoords, Topology
from m2po_oracle.errors import EXIT_DIVERGENT, EXIT_EQUIVALENT, EXIT_UNUSABLE
from m2po_oracle.explain.step_deviations import described
from m2po_oracle.judge.checks import AUDIT_CHECKS
from m2po_oracle.oracle.batch import Batch
from m2po_oracle.oracle.encoding import to_builtins
from m2po_oracle.records import audit as rec
from m2po_oracle.records.audit import SCHEMA

CHECK_NAMES = tuple(AUDIT_CHECKS)


#: Rollout engines report log-probs in float32 at best (vLLM, HF generate's float32 logits).
ROLLOUT_LOGP_DTYPE = "float32"


#: What each name says. A denominator's words say only what the loss divides by: it may stand
#: beside a scope (the mask is then that scope's), or alone (audit.selection passes).
DESCRIPTIONS = described("audit")


@dataclass
class AuditCheck:
    name: str
    status: str  # "pass", "fail", "not run"
    summary: str = ""


@dataclass
class StepAudit:
    step: int
    verdict: str  # "equivalent", "divergent", "unusable"
    checks: list[AuditCheck] = field(default_factory=list)
    diagnosis: list[str] = field(default_factory=list)
    metrics: rec.Metrics | None = None  # None: an unusable step, nothing computed
    counterexample: dict[str, Any] | UnsetType = UNSET  # the worst step's only
    alternatives: dict[str, list[str]] = field(default_factory=dict)  # diagnosis name -> names identical on this step
    observations: list[str] = field(default_factory=list)  # what the files show that no deviation name says

    @property
    def failing(self) -> list[str]:
        return [c.name for c in self.checks if c.status == "fail"]


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

    def record(self) -> rec.AuditRecord:
        """The audit as its typed record (``m2po_oracle.records.audit``)."""
        named = sorted(
            {name for s in self.steps for name in s.diagnosis} | {n for s in self.steps for names in s.alternatives.values() for n in names}
        )
        return rec.AuditRecord(
            schema=SCHEMA,
            verdict=cast(Any, self.verdict),
            capture=rec.Capture(
                directory=self.directory,
                world_size=self.world_size,
                topology=self.topology,
                steps=tuple(s.step for s in self.steps),
                problems=tuple(self.problems),
                refused=self.refused,
            ),
            steps=tuple(
                rec.Step(
                    step=s.step,
                    verdict=cast(Any, s.verdict),
                    checks=tuple(rec.Check(name=c.name, status=cast(Any, c.status), summary=c.summary) for c in s.checks),
                    diagnosis=tuple(s.diagnosis),
                    metrics=s.metrics,
                    # Built as its JSON by the counterexample's own room (a table of tokens or values).
                    counterexample=cast(rec.Counterexample, s.counterexample),
                    alternatives={name: tuple(others) for name, others in s.alternatives.items()},
                    observations=tuple(s.observations),
                )
                for s in self.steps
            ),
            worst_step=self.worst_step,
            descriptions={name: DESCRIPTIONS[name] for name in named if name in DESCRIPTIONS},
        )

    def to_json(self) -> dict[str, Any]:
        return cast(dict[str, Any], to_builtins(self.record()))


@dataclass
class MicroBatch:
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
    metric_sources: dict[str, str] = field(default_factory=dict)  # our name -> the logged key it was read from, where not ours

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


def _record(record: dict[str, Any], info: reader.RecordInfo, coords: RankCoords) -> MicroBatch:
    shape = tuple(record["logp"].shape)
    optional = {}
    for name in ("grad", "selection_logp", "rollout_logp"):
        value = record.get(name)
        if value is not None and tuple(value.shape) != shape:
            path = info.grad_path if name == "grad" and info.grad_path else info.path
            raise reader.CaptureError(path, f"{name} has shape {list(value.shape)}, logp {list(shape)}")
        optional[name] = None if value is None else _rows(value)
    dtype = str(record["logp"].dtype).removeprefix("torch.")
    # A metric under our name is judged as logged (a non-number is a finding); one logged
    # under a port's own name (m2po/masked_fraction, actor/m2po_M2) is read as compare
    # --adapter reads it, and the report says under which key.
    logged = dict(record["metrics"])
    exact = {name: value for name, value in logged.items() if name in METRIC_NAMES}
    aliased, keys = logged_metrics({k: v for k, v in logged.items() if k not in exact})
    return MicroBatch(
        info.rank,
        coords,
        info.micro_batch,
        _rows(record["logp"]),
        _rows(record["behavior_logp"]),
        _rows(record["advantages"]),
        _rows(record["mask"], True),
        _rows(record["keep"], True),
        optional["selection_logp"],
        optional["rollout_logp"],
        optional["grad"],
        float(record["loss"]),
        float(record["tau"]),
        {**aliased, **exact},
        dtype,
        metric_sources={name: str(key) for name, key in keys.items() if name not in exact},
    )


class Unusable(Exception):
    """A step whose records cannot be put together (the reason is the message)."""


def records_of(capture: reader.Capture, topology: Topology, step: int, bad_paths: set[str], problems: list[str]) -> list[MicroBatch]:
    keys = sorted(k for k in capture.keys() if k[1] == step)  # noqa: SIM118 - Capture.keys() is a method, not a dict
    ranks = {k[0] for k in keys}
    missing = sorted(set(range(capture.world_size)) - ranks)
    if missing:
        raise Unusable(f"incomplete step: no records of rank(s) {missing}")
    gaps = [r for r in ranks if sorted(k[2] for k in keys if k[0] == r) != list(range(1 + max(k[2] for k in keys if k[0] == r)))]
    if gaps:
        raise Unusable(f"incomplete step: rank(s) {sorted(gaps)} miss micro-batches")
    records = []
    for key in keys:
        info = capture.info(*key)
        if str(info.path) in bad_paths or (info.grad_path is not None and str(info.grad_path) in bad_paths):
            raise Unusable(
                f"incomplete step: the files of rank {key[0]} micro-batch {key[2]} have problems (listed in the capture's problems)"
            )
        try:
            records.append(_record(capture.load(*key), info, topology.coords(key[0])))
        except reader.CaptureError as error:
            problems.append(str(error))
            raise Unusable(f"incomplete step: {error}") from None
    return records
