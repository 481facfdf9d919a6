"""The audit report (``m2po-oracle audit DIR --json``), key by key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal, get_args

from msgspec import UNSET, UnsetType

from m2po_oracle.records.declare import Number, doc

SchemaId = Literal["m2po-oracle/audit/1"]
SCHEMA: SchemaId = get_args(SchemaId)[0]


@dataclass(frozen=True, kw_only=True)
class AuditRecord:
    """The offline audit of a capture, step by step (see auditing a training run)."""

    schema: Annotated[SchemaId, doc("the schema id")]
    verdict: Annotated[
        Literal["equivalent", "divergent", "unusable"],
        doc(
            "`equivalent`, `divergent` or `unusable` (exit status 0 / 1 / 2): divergent where a step is; unusable where the capture was refused or no step could be audited"
        ),
    ]
    capture: Annotated[Capture, doc("the capture audited")]
    steps: Annotated[tuple[Step, ...], doc("one per step audited")]
    worst_step: Annotated[int | None, doc("the divergent step with the most failing checks; null: none")]
    descriptions: Annotated[
        dict[str, str],
        doc("what each deviation named in any step means", keys="a deviation named in `steps[].diagnosis` or `steps[].alternatives`"),
    ]


@dataclass(frozen=True, kw_only=True)
class Step:
    """`steps[]`"""

    step: Annotated[int, doc("the optimizer step")]
    verdict: Annotated[Literal["equivalent", "divergent", "unusable"], doc("`equivalent`, `divergent` or `unusable`")]
    checks: Annotated[tuple[Check, ...], doc("every audit check on it (see the checks reference)")]
    diagnosis: Annotated[tuple[str, ...], doc("the deviations the files reproduce (see the deviations reference)")]
    metrics: Annotated[Metrics | None, doc("the optimizer batch's, as Algorithm 1 computes them; null on an unusable step")]
    counterexample: Annotated[
        Counterexample | UnsetType,
        doc(
            "what shows the step's first failing check (by `TABLE_ORDER` of `m2po_oracle.audit`)",
            when="the worst step only (most failing checks, the earliest among equals)",
        ),
    ] = UNSET
    alternatives: Annotated[
        dict[str, tuple[str, ...]],
        doc("per deviation named, the others that reproduce this step identically", keys="a deviation in `diagnosis`"),
    ]
    observations: Annotated[
        tuple[str, ...],
        doc(
            "what the files show beyond the names (a divergent step): that no known deviation explains it, the divisor the recorded losses imply against N"
        ),
    ]


@dataclass(frozen=True, kw_only=True)
class Counterexample:
    """`steps[].counterexample`"""

    check: Annotated[str, doc("the failing check it shows")]
    note: Annotated[str, doc("what its rows are")]
    tokens: Annotated[tuple[Token, ...], doc("the tokens that show it (24 at most), the largest difference first")]
    values: Annotated[
        tuple[Value, ...], doc("the logged values that show it (24 at most), for `audit.metrics` and `audit.parameter_gradient`")
    ]
    shown: Annotated[int, doc("rows shown")]
    of: Annotated[int, doc("rows found")]
    tau: Annotated[Number, doc("the budget")]
    valid_count: Annotated[int, doc("the optimizer batch's N")]
    replay: Annotated[str, doc("the command that audits this step alone")]


@dataclass(frozen=True, kw_only=True)
class Value:
    """`steps[].counterexample.values[]`"""

    where: Annotated[str, doc("the record or rank")]
    name: Annotated[str, doc("the metric or parameter")]
    captured: Annotated[Number | None, doc("the logged value; null: no gradient")]
    expected: Annotated[Number | str, doc("the optimizer batch's value, or what a gradient norm must be")]


@dataclass(frozen=True, kw_only=True)
class Token:
    """`steps[].counterexample.tokens[]`"""

    row: Annotated[int, doc("the token's row in the optimizer batch")]
    position: Annotated[int, doc("its position in the row")]
    rank: Annotated[int | None, doc("the rank that recorded it; null on padding")]
    micro_batch: Annotated[int | None, doc("the micro-batch; null on padding")]
    d: Annotated[Number, doc("its log-ratio, on the log-probs the selection saw")]
    m2: Annotated[Number, doc("d^2")]
    advantage: Annotated[Number, doc("its advantage")]
    keep: Annotated[bool, doc("whether the run kept it")]
    algorithm_1_keeps: Annotated[bool, doc("whether Algorithm 1 keeps it, on the optimizer batch")]
    grad: Annotated[Number | None, doc("the captured gradient; null where none was captured")]
    expected_grad: Annotated[Number, doc("`-(1/N) keep exp(d) A` with the global N")]
    compared: Annotated[
        Compared | UnsetType, doc("the two log-probs the check compares", when="a table of `audit.behavior_logp` or `audit.policy_logp`")
    ] = UNSET


@dataclass(frozen=True, kw_only=True)
class Compared:
    """`steps[].counterexample.tokens[].compared`"""

    what: Annotated[str, doc("which two")]
    captured: Annotated[Number, doc("the one the loss used")]
    expected: Annotated[Number, doc("the one it must equal")]


@dataclass(frozen=True, kw_only=True)
class Metrics:
    """`steps[].metrics`"""

    m2_before: Annotated[Number, doc("M2 over the trust region before masking")]
    m2_after: Annotated[Number, doc("M2 over the kept trust-region tokens")]
    masked_fraction: Annotated[Number, doc("masked share of the trust region")]
    tau: Annotated[Number, doc("the budget")]


@dataclass(frozen=True, kw_only=True)
class Check:
    """`steps[].checks[]`"""

    name: Annotated[str, doc("the check")]
    status: Annotated[Literal["pass", "fail", "not run"], doc("`pass`, `fail` or `not run`")]
    summary: Annotated[str, doc("what it found, in one line")]


@dataclass(frozen=True, kw_only=True)
class Capture:
    """`capture`"""

    directory: Annotated[str, doc("its directory")]
    world_size: Annotated[int | None, doc("ranks, as the manifests say; null: no manifest could be read")]
    topology: Annotated[str | None, doc("`dp=N,cp=N,tp=N`, as the manifests say; null: no manifest could be read")]
    steps: Annotated[tuple[int, ...], doc("the optimizer steps audited")]
    problems: Annotated[tuple[str, ...], doc("what is wrong with its files (each names the file); the steps they touch are unusable")]
    refused: Annotated[str | None, doc("why the capture could not be audited at all; else null")]
