"""The benchmarks' records (``m2po-oracle bench --json``, ``bench --audit --json``), key by key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal, get_args

from msgspec import UNSET, UnsetType

from m2po_oracle.records.declare import doc

SchemaId = Literal["m2po-oracle/bench/4"]
SCHEMA: SchemaId = get_args(SchemaId)[0]
AuditSchemaId = Literal["m2po-oracle/bench-audit/1"]
AUDIT_SCHEMA: str = get_args(AuditSchemaId)[0]


@dataclass(frozen=True, kw_only=True)
class BenchRecord:
    """The selection's and the core forward's speed, side by side."""

    schema: Annotated[SchemaId, doc("the schema id")]
    device: Annotated[str, doc("where it ran")]
    tau: Annotated[float, doc("the budget")]
    repeats: Annotated[int, doc("interleaved repeats per size")]
    rows: Annotated[tuple[Row, ...], doc("one per size")]
    environment: Annotated[Environment, doc("what it ran on")]
    across_ranks: Annotated[
        AcrossRanks | UnsetType, doc("histogram rounds against an all-gather, on a gloo world", when="with --ranks only")
    ] = UNSET


@dataclass(frozen=True, kw_only=True)
class AcrossRanks:
    """`across_ranks`"""

    world_size: Annotated[int, doc("ranks")]
    tokens_per_rank: Annotated[int, doc("tokens per rank (the largest size)")]
    identical: Annotated[bool, doc("both keep the same tokens on every rank")]
    median_ms: Annotated[MedianMs, doc("the slowest rank's median time, ms")]
    traffic_rank0: Annotated[
        dict[str, dict[str, TrafficRank0]],
        doc("rank 0's collectives per method", keys="`histogram` or `all_gather`, then a collective's kind"),
    ]
    per_rank: Annotated[tuple[PerRank, ...], doc("every rank's figures")]
    forward_syncs: Annotated[tuple[ForwardSync, ...], doc("the distributed forward's would-sync operators, per rank")]


@dataclass(frozen=True, kw_only=True)
class ForwardSync:
    """`across_ranks.forward_syncs[]`"""

    rank: Annotated[int, doc("the rank")]
    syncs: Annotated[int, doc("would-sync operators")]
    collectives: Annotated[int, doc("collectives called")]


@dataclass(frozen=True, kw_only=True)
class PerRank:
    """`across_ranks.per_rank[]`"""

    identical: Annotated[bool, doc("both keep the same tokens on this rank")]
    kept: Annotated[int, doc("tokens kept on this rank")]
    median_ms: Annotated[dict[str, float], doc("its median times, ms", keys="`histogram` or `all_gather`")]
    traffic: Annotated[
        dict[str, dict[str, TrafficRank0]], doc("its collectives per method", keys="`histogram` or `all_gather`, then a collective's kind")
    ]


@dataclass(frozen=True, kw_only=True)
class TrafficRank0:
    """`across_ranks.traffic_rank0{}{}`"""

    calls: Annotated[int, doc("calls")]
    bytes: Annotated[int, doc("bytes sent")]


@dataclass(frozen=True, kw_only=True)
class MedianMs:
    """`across_ranks.median_ms`"""

    histogram: Annotated[float, doc("histogram rounds")]
    all_gather: Annotated[float, doc("all-gather")]


@dataclass(frozen=True, kw_only=True)
class Environment:
    """`environment`"""

    torch: Annotated[str, doc("torch's version")]
    threads: Annotated[int, doc("torch's CPU threads")]
    platform: Annotated[str, doc("the platform")]
    gpu: Annotated[str | None, doc("the GPU; null on the CPU")]
    fused_passes: Annotated[str, doc("`built`, or why the fused CPU passes are not used")]


@dataclass(frozen=True, kw_only=True)
class Row:
    """`rows[]`"""

    tokens: Annotated[int, doc("tokens in the batch")]
    candidates: Annotated[int, doc("trust-region candidates")]
    identical: Annotated[bool, doc("sort's, radix's and both forwards' masks agree, and the two forwards' losses")]
    median_ms: Annotated[
        dict[str, float], doc("each method's median time, ms", keys="a timed method (`METHODS` of `m2po_oracle.bench.core`)")
    ]
    best_ms: Annotated[dict[str, float], doc("each method's best time, ms", keys="a timed method (`METHODS` of `m2po_oracle.bench.core`)")]
    sort_over_radix: Annotated[float, doc("median sort / median radix")]
    radix_over_floor: Annotated[float, doc("median radix / median floor")]
    forward_over_selection: Annotated[float, doc("best forward / best radix")]
    sort_over_forward: Annotated[float, doc("best sort / best forward")]
    forward_over_floor: Annotated[float, doc("best forward / best floor")]
    forward_over_passes: Annotated[float, doc("best forward / best passes")]
    passes_over_selection: Annotated[float, doc("best passes / best radix")]
    unfused_over_forward: Annotated[float, doc("best unfused / best forward")]
    fused: Annotated[bool, doc("whether the counted forward ran the fused CPU passes")]
    syncs_per_forward: Annotated[int, doc("would-sync operators of one forward")]
    syncs: Annotated[dict[str, int], doc("those, per operator", keys="an aten operator")]
    syncs_per_unfused_forward: Annotated[int, doc("would-sync operators of one unfused forward")]
    unfused_syncs: Annotated[dict[str, int], doc("those, per operator", keys="an aten operator")]
    operators_per_forward: Annotated[int, doc("operators one forward dispatches")]


@dataclass(frozen=True, kw_only=True)
class BenchAuditRecord:
    """How long the offline audit takes on one synthetic step, correct and with a planted bug."""

    schema: Annotated[AuditSchemaId, doc("the schema id")]
    tau: Annotated[float, doc("the budget")]
    step: Annotated[Step, doc("the synthetic optimizer step")]
    prepare_s: Annotated[float, doc("seconds to make the step")]
    cases: Annotated[tuple[Case, ...], doc("`correct`, then `planted`")]
    target: Annotated[Target, doc("the audit's target, an observation, never asserted")]
    environment: Annotated[AuditEnvironment, doc("what it ran on")]


@dataclass(frozen=True, kw_only=True)
class AuditEnvironment:
    """`environment`"""

    python: Annotated[str, doc("Python's version")]
    torch: Annotated[str, doc("torch's version")]
    cpus: Annotated[int | None, doc("CPUs")]
    platform: Annotated[str, doc("the platform")]


@dataclass(frozen=True, kw_only=True)
class Target:
    """`target`"""

    wall_s: Annotated[float, doc("seconds")]
    peak_rss_bytes: Annotated[int, doc("bytes")]


@dataclass(frozen=True, kw_only=True)
class Case:
    """`cases[]`"""

    case: Annotated[str, doc("`correct` or `planted`")]
    expected: Annotated[str, doc("the verdict it must get")]
    as_expected: Annotated[bool, doc("whether it got it")]
    disk_bytes: Annotated[int, doc("the capture's size on disk")]
    write_s: Annotated[float, doc("seconds to write the capture")]
    wall_s: Annotated[float, doc("seconds `audit_capture` took")]
    cpu_user_s: Annotated[float, doc("its user CPU seconds")]
    cpu_system_s: Annotated[float, doc("its system CPU seconds")]
    peak_rss_bytes: Annotated[int, doc("the audit process's peak RSS (`VmHWM`)")]
    rss_after_imports_bytes: Annotated[int, doc("its RSS once its imports are done")]
    verdict: Annotated[str, doc("the audit's verdict")]
    steps: Annotated[tuple[CaseStep, ...], doc("per step audited")]
    process_s: Annotated[float, doc("seconds of the whole audit process")]
    within_target: Annotated[bool, doc("wall time and peak RSS under `target`'s")]


@dataclass(frozen=True, kw_only=True)
class CaseStep:
    """`cases[].steps[]`"""

    step: Annotated[int, doc("the step")]
    verdict: Annotated[str, doc("its verdict")]
    failing: Annotated[tuple[str, ...], doc("its failing checks")]
    diagnosis: Annotated[tuple[str, ...], doc("the deviations named")]


@dataclass(frozen=True, kw_only=True)
class Step:
    """`step`"""

    dp: Annotated[int, doc("data-parallel ranks")]
    micro_batches: Annotated[int, doc("micro-batches per rank")]
    rows_per_micro_batch: Annotated[int, doc("rows per micro-batch")]
    T: Annotated[int, doc("tokens per row")]
    tokens: Annotated[int, doc("tokens in the step")]
    valid_count: Annotated[int, doc("valid tokens, N")]
    trust_region_count: Annotated[int, doc("trust-region tokens")]
    kept_trust_region_count: Annotated[int, doc("trust-region tokens kept")]
    m2_before: Annotated[float, doc("M2 before masking")]
    m2_after: Annotated[float, doc("M2 after masking")]
    masked_fraction: Annotated[float, doc("masked share of the trust region")]
    planted_micro_batch: Annotated[PlantedMicroBatch, doc("the micro-batch of the planted case, selected on its own")]


@dataclass(frozen=True, kw_only=True)
class PlantedMicroBatch:
    """`step.planted_micro_batch`"""

    rank: Annotated[int, doc("its rank")]
    micro_batch: Annotated[int, doc("its micro-batch")]
    tokens_changed: Annotated[int, doc("tokens whose keep it changes")]
