"""The compare report: the run's typed record (``CompareReport``: tallies, counterexamples,
diagnosis, validation) and the one JSON builder of schema ``m2po-oracle/compare/1``.

Every value that comes from the implementation (names, exception text) is stored as plain
data here and escaped only by a renderer. Non-finite numbers are written as the strings
"nan", "inf" and "-inf" (:func:`m2po_oracle.oracle.encoding.number`) so the file stays
standard JSON."""

from __future__ import annotations

import platform
import subprocess
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import msgspec
import numpy as np
from msgspec import UNSET

from m2po_oracle import __version__, oracle
from m2po_oracle.call.runner import AdapterUse, CaptureUse, RunOptions, TopologyUse
from m2po_oracle.explain.deviations import Accepted
from m2po_oracle.explain.record import Diagnosis
from m2po_oracle.judge.checks import ALL_CHECKS
from m2po_oracle.judge.coverage import CoverageTally, failure_rate_upper
from m2po_oracle.judge.equivalence import TOLERANCES, Mismatch, selection_bounds
from m2po_oracle.judge.validation import ProbeResult
from m2po_oracle.oracle.batch import Batch
from m2po_oracle.oracle.encoding import number, to_builtins
from m2po_oracle.oracle.record import COUNT_FIELDS, METRIC_FIELDS, M2POResult
from m2po_oracle.records import compare as rec
from m2po_oracle.records.compare import SCHEMA

#: Counterexamples are shrunk and small; a fallback batch is cut to this many tokens.
MAX_TOKENS = 512


def mismatch_record(m: Mismatch) -> rec.Mismatch:
    return rec.Mismatch(
        check=m.check,
        summary=m.summary,
        field=m.field,
        index=tuple(m.index) if m.index is not None else None,
        actual=number(m.actual),
        expected=number(m.expected),
        details=tuple(m.details),
    )


def mismatch_from_json(data: dict[str, Any]) -> Mismatch:
    """A mismatch as :func:`mismatch_record` wrote it (non-finite values back to floats)."""

    def value(v: Any) -> Any:
        return float(v) if v in ("nan", "inf", "-inf") else v

    index = data.get("index")
    return Mismatch(
        data["check"],
        data["summary"],
        data.get("field", ""),
        tuple(index) if index is not None else None,
        value(data.get("actual")),
        value(data.get("expected")),
        tuple(data.get("details", ())),
    )


def tolerance_records() -> tuple[rec.Tolerance, ...]:
    return tuple(
        rec.Tolerance(dtype=dtype, quantity=quantity, rtol=tol.rtol, atol=tol.atol) for (dtype, quantity), tol in TOLERANCES.items()
    )


def _fields(result: M2POResult | None) -> dict[str, Any]:
    if result is None:
        return {}
    out = {"loss": number(result.loss)}
    out.update({name: number(getattr(result, name)) for name in METRIC_FIELDS + COUNT_FIELDS if getattr(result, name) is not None})
    return out


def counterexample_record(c: Counterexample, compute_dtype: str) -> rec.Counterexample:
    """One minimal counterexample with its token table and M2 removal curve.

    ``c.batch`` is what the implementation received. Per token: ``expected_keep`` is
    Algorithm 1's (literal loop), ``expected_grad`` the analytic gradient on the
    implementation's own mask (what the gradient check compares), ``actual_*`` the
    implementation's.
    """
    batch, actual, mismatches = c.batch, c.actual, c.mismatches
    algorithm = oracle.m2po(batch)
    assert algorithm.grad is not None  # the oracle's result always has its gradient
    on_actual_mask = oracle.evaluate_with_mask(batch, actual.keep) if actual is not None else None
    d = oracle.log_ratio(batch.logp, batch.behavior_logp, batch.valid)
    m2 = oracle.second_moment(d)
    trust = oracle.trust_region(d, batch.advantages, batch.valid)
    tokens = []
    for flat, index in enumerate(np.ndindex(*batch.shape)):
        if flat >= MAX_TOKENS:
            break
        tokens.append(
            rec.Token(
                index=tuple(index),
                valid=bool(batch.valid[index]),
                log_ratio=number(d[index]) if batch.valid[index] else None,
                advantage=number(batch.advantages[index]),
                m2=number(m2[index]) if batch.valid[index] else None,
                trust_region=bool(trust[index]),
                expected_keep=bool(algorithm.keep[index]),
                actual_keep=bool(actual.keep[index]) if actual is not None else None,
                expected_grad=number(cast(np.ndarray, on_actual_mask.grad)[index])
                if on_actual_mask is not None
                else number(algorithm.grad[index]),  # the oracle's grad is set
                actual_grad=number(actual.grad[index]) if actual is not None and actual.grad is not None else None,
            )
        )
    bounds = selection_bounds(batch, compute_dtype)
    return rec.Counterexample(
        check=c.check,
        cause=c.cause,
        checks=tuple(c.checks or (c.check,)),
        shrink_stopped=c.shrink_stopped,
        summary=mismatches[0].summary if mismatches else "",
        replay=c.replay,
        batch=cast(rec.Batch, batch.to_dict()),
        shape=tuple(batch.shape),
        tokens=tuple(tokens),
        tokens_truncated=batch.logp.size > MAX_TOKENS,
        mismatches=tuple(mismatch_record(m) for m in mismatches),
        expected=_fields(algorithm),
        expected_on_actual_mask=_fields(on_actual_mask),
        actual=_fields(actual),
        removal_curve=rec.RemovalCurve(
            tau=batch.tau,
            prefix_means=tuple(number(v) for v in bounds.prefix_means[:MAX_TOKENS]),
            candidates=int(bounds.order.size),
            oracle_kept_min=bounds.k_min,
            oracle_kept_max=bounds.k_max,
            implementation_kept=int((actual.keep & trust).sum()) if actual is not None else None,
        ),
        ranks=cast(tuple[rec.Rank, ...], tuple(c.ranks)) if c.ranks else UNSET,
        trainer_case=cast(rec.TrainerCase, c.case) if c.case else UNSET,
    )


@dataclass
class CheckTally:
    name: str
    failures: int = 0
    ran: int = 0  # examples on which the check actually ran
    first_failure: Any = None
    first_failure_at: int | None = None  # 1-based number of the first failing example
    exercised: int = 0  # examples that could have failed it (m2po_oracle.judge.coverage.EXERCISED; a failing one always)

    @property
    def failure_rate_upper_95(self) -> float | None:
        """One-sided 95% Clopper-Pearson upper bound on the failure rate over the exercised examples."""
        return failure_rate_upper(self.failures, self.exercised)

    @property
    def status(self) -> str:
        """fail, pass, or "not run": a check that never ran claims nothing."""
        if self.failures:
            return "fail"
        return "pass" if self.ran else "not run"


@dataclass
class Counterexample:
    check: str
    batch: Batch  # as the implementation received it
    mismatches: tuple[Mismatch, ...]
    replay: str
    actual: M2POResult | None = None
    ranks: tuple[dict, ...] = ()
    case: dict | None = None  # a trainer case: the step's input (the batch is what the trainer produced)
    cause: str | None = None  # the explanation it demonstrates ("a + b"), None for an unexplained check
    checks: tuple[str, ...] = ()  # every failing check it demonstrates
    example: Any = None  # the example as generated (a batch with its drawn padding, or a trainer case)
    shrink_stopped: str | None = None  # why shrinking stopped before it tried every smaller batch


@dataclass
class CompareReport:
    impl: str
    dtype: str
    compute_dtype: str
    seed: int
    examples: int
    tallies: dict[str, CheckTally]
    counterexamples: list[Counterexample] = field(default_factory=list)
    duration_s: float = 0.0
    tau: float | None = None
    device: str = "cpu"
    diagnosis: Diagnosis = field(default_factory=Diagnosis.not_run)
    validation: list[ProbeResult] = field(default_factory=list)
    validation_not_run: str | None = None  # why the probes were skipped
    strict_validation: bool = False
    topology: TopologyUse | None = None  # the world of a distributed run
    adapter: AdapterUse | None = None  # the adapter the port is called through
    collectives: list[dict[str, Any]] = field(default_factory=list)  # per rank, for one step
    metric_sources: dict[str, str] = field(default_factory=dict)  # an adapted port's metrics: ours -> where in its return
    example_unit: str = "batches"  # what one example is: a batch, or a training step (the trainer)
    stopped_early: str | None = None  # why exploration ended before ``examples_requested``
    examples_requested: int = 0
    interrupted: bool = False
    load_error: str | None = None  # the implementation could not be loaded at all
    output: dict[str, Any] = field(default_factory=lambda: {"lines": 0, "first_lines": []})
    coverage: CoverageTally = field(default_factory=CoverageTally)  # families and features of the examples tried
    accepted: tuple[Accepted, ...] = ()  # deviations the project accepts ([tool.m2po-oracle] accept, --accept)
    strict_accept: bool = True  # an accepted deviation that no longer shows fails the run
    capture: CaptureUse | None = None  # --capture: what the run recorded for `m2po-oracle audit`
    dtype_why: str | None = None  # why the runner chose the dtype itself (a trainer computing in one dtype, run without --dtype)

    @property
    def validation_warnings(self) -> list[ProbeResult]:
        return [p for p in self.validation if p.ran and not p.as_expected]

    @property
    def usable(self) -> bool:
        """Whether any call returned a result: otherwise no check but ``call`` ran."""
        return self.load_error is None and any(t.ran for n, t in self.tallies.items() if n != "call")

    @property
    def failing_checks(self) -> list[str]:
        return [n for n, t in self.tallies.items() if t.failures]

    @property
    def accepted_shown(self) -> dict[str, list[str]]:
        """Each accepted deviation -> the failing checks it explains ([]: it did not show)."""
        by_check = self.diagnosis.by_check
        return {a.deviation: [c for c, names in by_check.items() if any(_accepts(a.deviation, n) for n in names)] for a in self.accepted}

    @property
    def fixed_accepted(self) -> list[str]:
        return [name for name, checks in self.accepted_shown.items() if not checks]

    def _explained_by_accepted(self, failing: list[str]) -> bool:
        """Every failing check is explained, on every failing example (no residual), by accepted deviations only."""
        by_check, accepted, shares = self.diagnosis.by_check, [a.deviation for a in self.accepted], self.diagnosis.shares
        return bool(accepted) and all(
            by_check.get(c)
            and all(any(_accepts(a, n) for a in accepted) for n in by_check[c])
            and (c not in shares or shares[c].share == 1.0)
            for c in failing
        )

    @property
    def verdict(self) -> str:
        if self.interrupted:
            return "interrupted"
        if self.load_error is not None or (self.examples and not self.usable):
            return "unusable"
        failing = self.failing_checks
        if (self.strict_validation and self.validation_warnings) or (failing and not self._explained_by_accepted(failing)):
            return "divergent"
        if self.strict_accept and self.fixed_accepted:
            return "accepted-deviation-fixed"
        return "equivalent-with-accepted" if failing else "equivalent"

    @property
    def exit_status(self) -> int:
        return {
            "equivalent": 0,
            "equivalent-with-accepted": 0,
            "divergent": 1,
            "accepted-deviation-fixed": 1,
            "unusable": 2,
            "interrupted": 130,
        }[self.verdict]

    def record(self) -> rec.CompareRecord:
        """The run as its typed record (``m2po_oracle.records.compare``)."""
        return rec.CompareRecord(
            schema=SCHEMA,
            verdict=cast(Any, self.verdict),
            implementation=self.impl,
            options=rec.Options(
                examples=self.examples_requested or self.examples,
                seed=self.seed,
                dtype=self.dtype,
                compute_dtype=self.compute_dtype,
                tau=self.tau,
                device=self.device,
                strict_validation=self.strict_validation,
                dtype_why=self.dtype_why if self.dtype_why is not None else UNSET,
            ),
            examples=self.examples,
            example_unit=self.example_unit,
            duration_s=round(self.duration_s, 3),
            stopped_early=self.stopped_early,
            load_error=self.load_error,
            checks=tuple(
                rec.Check(
                    name=name,
                    description=ALL_CHECKS[name],
                    status=cast(Any, t.status),
                    failures=t.failures,
                    ran=t.ran,
                    first_failure_at=t.first_failure_at,
                    exercised=t.exercised,
                    failure_rate_upper_95=t.failure_rate_upper_95,
                )
                for name, t in self.tallies.items()
            ),
            coverage=self.coverage.record(self.tallies),
            counterexamples=tuple(counterexample_record(c, self.compute_dtype) for c in self.counterexamples),
            diagnosis=msgspec.convert(self.diagnosis.to_json(), rec.Diagnosis),
            accepted=tuple(
                rec.Accepted(
                    deviation=a.deviation,
                    reason=a.reason,
                    link=a.link,
                    shown=bool(self.accepted_shown[a.deviation]),
                    checks=tuple(self.accepted_shown[a.deviation]),
                )
                for a in self.accepted
            ),
            strict_accept=self.strict_accept,
            validation=rec.Validation(
                strict=self.strict_validation,
                not_run=self.validation_not_run,
                probes=tuple(
                    rec.Probe(probe=p.probe, description=p.description, status=cast(Any, p.status), message=p.message, expected=p.expected)
                    for p in self.validation
                ),
            ),
            implementation_output=msgspec.convert(self.output, rec.ImplementationOutput),
            topology=rec.Topology(**asdict(self.topology)) if self.topology else UNSET,
            collectives_per_step=cast(tuple[rec.CollectivesPerStep, ...], tuple(self.collectives)) if self.topology else UNSET,
            adapter=self._adapter_record(self.adapter) if self.adapter else UNSET,
            capture=rec.Capture(directory=self.capture.directory, steps=self.capture.steps) if self.capture else UNSET,
            tolerances=tolerance_records(),
            environment=environment(),
        )

    def to_json(self) -> dict[str, Any]:
        return cast(dict[str, Any], to_builtins(self.record()))

    def _adapter_record(self, used: AdapterUse) -> rec.Adapter:
        """The adapter as described, with what this run observed: ``metrics_read`` (each
        metric of ours the port returned, and where), and ``supplies`` narrowed to the
        metrics it returned (the family may return more than this port does)."""
        metrics = set(METRIC_FIELDS + COUNT_FIELDS)
        return rec.Adapter(
            name=used.name,
            signature=used.signature,
            checked=used.checked,
            supplies=tuple(f for f in used.supplies if f not in metrics or f in self.metric_sources),
            builds=dict(used.builds),
            metrics_read=dict(sorted(self.metric_sources.items())),
            not_run=dict(used.not_run),
            bindings=used.bindings,
            call=used.call,
        )


def _accepts(accepted: str, name: str) -> bool:
    """An accepted deviation covers its name; without a value, every fitted value of it too."""
    return name == accepted or ("(" not in accepted and name.split("(", 1)[0] == accepted)


def environment() -> rec.Environment:
    import hypothesis
    import torch

    try:
        revision = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        revision = None
    return rec.Environment(
        m2po_oracle=__version__,
        python=platform.python_version(),
        torch=str(torch.__version__),
        numpy=np.__version__,
        hypothesis=hypothesis.__version__,
        platform=platform.platform(),
        git_revision=revision,
    )


def load_error_report(spec: str, error: str, options: RunOptions) -> CompareReport:
    """The report of a run whose implementation could not be loaded (verdict unusable)."""
    report = CompareReport(
        spec,
        options.dtype,
        options.effective_compute_dtype,
        options.seed,
        0,
        {},
        tau=options.tau,
        device=options.device,
        strict_validation=options.strict_validation,
        examples_requested=options.examples,
        load_error=error,
        validation_not_run="the implementation could not be loaded",
    )
    return report
