"""Every recorded optimizer step of a capture through the rooms below: loaded, reassembled,
checked, diagnosed, and the worst one's table."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from msgspec import UNSET

from m2po_oracle.audit.checks import (
    LogpBounds,
    always_silent_parameters,
    behavior_logp_check,
    gradient_check,
    loss_check,
    metrics_check,
    parameter_check,
    policy_logp_check,
    replicas_check,
    selection_check,
)
from m2po_oracle.audit.counterexample import step_counterexample
from m2po_oracle.audit.diagnosis import diagnose_audit_step, observations
from m2po_oracle.audit.reassembly import AuditStep, assemble
from m2po_oracle.audit.records import CHECK_NAMES, AuditCheck, AuditReport, StepAudit, Unusable, records_of
from m2po_oracle.capture import reader
from m2po_oracle.distributed.topology import Topology
from m2po_oracle.records.audit import Metrics


def _audit_step(
    step: AuditStep, noted: dict[int, dict[str, Any]], silent: tuple[set[str], int], bounds: LogpBounds = LogpBounds()
) -> StepAudit:
    audit = StepAudit(step.step, "equivalent")
    algorithm = step.algorithm_1
    audit.metrics = Metrics(
        m2_before=algorithm["m2_before"], m2_after=algorithm["m2_after"], masked_fraction=algorithm["masked_fraction"], tau=step.batch.tau
    )
    # M2 and the counts are the selection's: judged on the log-probs it saw (a prepass when recorded).
    audit.checks = [
        replicas_check(step),
        selection_check(step),
        policy_logp_check(step, bounds),
        behavior_logp_check(step, bounds),
        loss_check(step, step.expected),
        gradient_check(step, step.expected),
        metrics_check(step, step.selected),
        parameter_check(noted, step.expected, *silent),
    ]
    if audit.failing:
        audit.verdict = "divergent"
        audit.diagnosis = diagnose_audit_step(step, set(audit.failing), noted, audit.alternatives, bounds)
        audit.observations = observations(step, audit)
    return audit


def _unusable(step: int, why: str) -> StepAudit:
    return StepAudit(step, "unusable", [AuditCheck(name, "not run", why) for name in CHECK_NAMES])


def audit_capture(
    directory: str | Path, *, steps: set[int] | None = None, rollout_atol: float | None = None, policy_atol: float | None = None
) -> AuditReport:
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
    problems_found, capture = reader.inspect_capture(directory)
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
            assembled = assemble(step, topology, records_of(capture, topology, step, bad_paths, problems))
            audit = _audit_step(assembled, capture.parameter_gradients(step), silent, bounds)
            report.steps.append(audit)
            if audit.verdict == "divergent" and (worst is None or len(audit.failing) > len(worst.failing)):
                # Built while the step's arrays are in memory (not re-read at the end); a later,
                # worse step replaces it, at most once per number of failing checks.
                _attach_counterexample(report, worst, audit, assembled, str(directory), capture.parameter_gradients(step), silent[0])
                worst = audit
        except Unusable as why:
            report.steps.append(_unusable(step, str(why)))
        except Exception as error:
            report.steps.append(_unusable(step, f"could not be audited: {type(error).__name__}: {error}"))
    return report


def _attach_counterexample(
    report: AuditReport,
    displaced: StepAudit | None,
    audit: StepAudit,
    step: AuditStep,
    directory: str,
    noted: dict[int, dict[str, Any]],
    silent_always: set[str],
) -> None:
    """The worst step so far gets the token table; the one it displaces loses its table."""
    if displaced is not None:
        displaced.counterexample = UNSET
    try:
        audit.counterexample = step_counterexample(step, audit, directory, noted, silent_always)
    except Exception as error:
        report.problems.append(f"step {step.step}: the counterexample table could not be built: {type(error).__name__}: {error}")
