"""The toolkit's JSON records, field by field: the one declaration of every key path each
record has, its JSON type and meaning (:mod:`m2po_oracle.report.fields` says how a path and a
type are written).

``docs/gen_reference.py`` writes the JSON reference page from :data:`SCHEMAS`, and
``property_tests/report/test_json_schema.py`` holds each declaration to what real runs write:
every key path a run writes is declared here, and every one declared here is written by one of
its runs or says, in ``when``, which records have it. A script may check a record it reads
with ``SCHEMAS[name].problems(record)``.

Importing this module imports no torch; asking a schema for its id or its fields imports the
module that writes the record (and the dataclasses some fields are read from).
"""

from __future__ import annotations

from m2po_oracle.report import compare_schema
from m2po_oracle.report.fields import Declared, Field, FromDataclass, Schema

JSON_NON_FINITE = ("nan", "inf", "-inf")
#: The capture's manifests spell them as JavaScript and Python's float() read them.
CAPTURE_NON_FINITE = ("NaN", "Infinity", "-Infinity")

AUDIT: tuple[Declared, ...] = (
    Field("schema", "string", "the schema id"),
    Field(
        "verdict",
        "string",
        "`equivalent`, `divergent` or `unusable` (exit status 0 / 1 / 2): divergent where a "
        "step is; unusable where the capture was refused or no step could be audited",
    ),
    Field("capture", "object", "the capture audited"),
    Field("capture.directory", "string", "its directory"),
    Field("capture.world_size", "integer or null", "ranks, as the manifests say; null: no manifest could be read"),
    Field("capture.topology", "string or null", "`dp=N,cp=N,tp=N`, as the manifests say; null: no manifest could be read"),
    Field("capture.steps", "array of integer", "the optimizer steps audited"),
    Field("capture.problems", "array of string", "what is wrong with its files (each names the file); the steps they touch are unusable"),
    Field("capture.refused", "string or null", "why the capture could not be audited at all; else null"),
    Field("steps", "array of object", "one per step audited"),
    FromDataclass(
        "steps[]",
        "m2po_oracle.audit.records:StepAudit",
        {
            "step": "the optimizer step",
            "verdict": "`equivalent`, `divergent` or `unusable`",
            "checks": "every audit check on it (see the checks reference)",
            "diagnosis": "the deviations the files reproduce (see the deviations reference)",
            "metrics": "the optimizer batch's, as Algorithm 1 computes them",
            "counterexample": "what shows the step's first failing check (by `TABLE_ORDER` of `m2po_oracle.audit`)",
            "alternatives": "per deviation named, the others that reproduce this step identically",
            "observations": "what the files show beyond the names (a divergent step): that no known deviation explains it, the divisor "
            "the recorded losses imply against N",
        },
        types={
            "checks": "array of object",
            "metrics": "object",
            "counterexample": "object",
            "alternatives": "map of array of string",
            "observations": "array of string",
        },
        when={"counterexample": "the worst step only (most failing checks, the earliest among equals)"},
        keys={"alternatives": "a deviation in `diagnosis`"},
    ),
    FromDataclass(
        "steps[].checks[]",
        "m2po_oracle.audit.records:AuditCheck",
        {"name": "the check", "status": "`pass`, `fail` or `not run`", "summary": "what it found, in one line"},
    ),
    Field("steps[].metrics.m2_before", "number", "M2 over the trust region before masking"),
    Field("steps[].metrics.m2_after", "number", "M2 over the kept trust-region tokens"),
    Field("steps[].metrics.masked_fraction", "number", "masked share of the trust region"),
    Field("steps[].metrics.tau", "number", "the budget"),
    Field("steps[].counterexample.check", "string", "the failing check it shows"),
    Field("steps[].counterexample.note", "string", "what its rows are"),
    Field("steps[].counterexample.tokens", "array of object", "the tokens that show it (24 at most), the largest difference first"),
    Field("steps[].counterexample.tokens[].row", "integer", "the token's row in the optimizer batch"),
    Field("steps[].counterexample.tokens[].position", "integer", "its position in the row"),
    Field("steps[].counterexample.tokens[].rank", "integer or null", "the rank that recorded it; null on padding"),
    Field("steps[].counterexample.tokens[].micro_batch", "integer or null", "the micro-batch; null on padding"),
    Field("steps[].counterexample.tokens[].d", "number", "its log-ratio, on the log-probs the selection saw"),
    Field("steps[].counterexample.tokens[].m2", "number", "d^2"),
    Field("steps[].counterexample.tokens[].advantage", "number", "its advantage"),
    Field("steps[].counterexample.tokens[].keep", "boolean", "whether the run kept it"),
    Field("steps[].counterexample.tokens[].algorithm_1_keeps", "boolean", "whether Algorithm 1 keeps it, on the optimizer batch"),
    Field("steps[].counterexample.tokens[].grad", "number or null", "the captured gradient; null where none was captured"),
    Field("steps[].counterexample.tokens[].expected_grad", "number", "`-(1/N) keep exp(d) A` with the global N"),
    Field(
        "steps[].counterexample.tokens[].compared",
        "object",
        "the two log-probs the check compares",
        when="a table of `audit.behavior_logp` or `audit.policy_logp`",
    ),
    Field("steps[].counterexample.tokens[].compared.what", "string", "which two"),
    Field("steps[].counterexample.tokens[].compared.captured", "number", "the one the loss used"),
    Field("steps[].counterexample.tokens[].compared.expected", "number", "the one it must equal"),
    Field(
        "steps[].counterexample.values",
        "array of object",
        "the logged values that show it (24 at most), for `audit.metrics` and `audit.parameter_gradient`",
    ),
    Field("steps[].counterexample.values[].where", "string", "the record or rank"),
    Field("steps[].counterexample.values[].name", "string", "the metric or parameter"),
    Field("steps[].counterexample.values[].captured", "number or null", "the logged value; null: no gradient"),
    Field("steps[].counterexample.values[].expected", "number or string", "the optimizer batch's value, or what a gradient norm must be"),
    Field("steps[].counterexample.shown", "integer", "rows shown"),
    Field("steps[].counterexample.of", "integer", "rows found"),
    Field("steps[].counterexample.tau", "number", "the budget"),
    Field("steps[].counterexample.valid_count", "integer", "the optimizer batch's N"),
    Field("steps[].counterexample.replay", "string", "the command that audits this step alone"),
    Field("worst_step", "integer or null", "the divergent step with the most failing checks; null: none"),
    Field(
        "descriptions",
        "map of string",
        "what each deviation named in any step means",
        keys="a deviation named in `steps[].diagnosis` or `steps[].alternatives`",
    ),
)

CAPTURE: tuple[Declared, ...] = (
    Field("schema", "string", "the schema id (each safetensors file's header repeats it, with the rank, step and micro-batch)"),
    Field("rank", "integer", "the global rank that wrote this manifest"),
    Field("world_size", "integer", "ranks in the run"),
    Field("topology", "string", "`dp=N,cp=N,tp=N`, Megatron order"),
    Field("every", "integer", "steps recorded: those divisible by it"),
    Field("versions", "object", "what wrote the capture"),
    Field("versions.python", "string", "Python's version"),
    Field("versions.torch", "string", "torch's version"),
    Field("versions.torch_cuda", "string or null", "the CUDA torch was built with; null: none"),
    Field("versions.safetensors", "string", "safetensors' version"),
    Field("versions.m2po-oracle", "string or null", "the toolkit's version; null for a vendored recorder"),
    Field("created", "string", "when the manifest was created, ISO 8601 in UTC"),
    Field(
        "parameter_gradients",
        "map of map of object",
        "each trainable parameter's gradient norm on this rank, per step",
        keys="a step number (as a string), then a parameter's name",
        when="`record_parameter_gradients` called on a recorded step",
    ),
    Field("parameter_gradients{}{}.numel", "integer", "the parameter's elements on this rank"),
    Field("parameter_gradients{}{}.norm", "number or null", "its gradient's L2 norm; null: no gradient"),
    Field("records", "array of object", "one per recorded micro-batch, in the order recorded"),
    Field("records[].step", "integer", "the optimizer step"),
    Field("records[].micro_batch", "integer", "the micro-batch in it"),
    Field("records[].file", "string", "the tensors' safetensors file, relative to the capture directory"),
    Field("records[].crc32", "integer", "the file's CRC-32"),
    Field("records[].device", "string", "where the tensors were"),
    Field(
        "records[].tensors",
        "map of object",
        "the tensors in the file",
        keys="`logp`, `behavior_logp`, `advantages`, `mask`, `keep`, then `selection_logp` and `rollout_logp` where "
        "recorded (`TENSOR_NAMES`, `OPTIONAL_TENSOR_NAMES` of the recorder)",
    ),
    Field("records[].tensors{}.dtype", "string", "its dtype"),
    Field("records[].tensors{}.shape", "array of integer", "its shape"),
    Field("records[].loss", "number", "this micro-batch's loss as the framework computed it"),
    Field("records[].tau", "number", "the budget"),
    Field("records[].metrics", "map of number", "the scalars the framework logs", keys="the framework's own names"),
    Field("records[].grad", "object or null", "d loss / d logp of the micro-batch; null: not captured"),
    Field("records[].grad.file", "string", "its safetensors file"),
    Field("records[].grad.crc32", "integer", "the file's CRC-32"),
    Field("records[].grad.dtype", "string", "its dtype"),
    Field("records[].grad.shape", "array of integer", "its shape (logp's)"),
    Field("records[].grad.backward_calls", "integer", "backward passes summed into it (0: passed to `record`)"),
)

_METHODS = "a timed method (`METHODS` of `m2po_oracle.bench.core`)"

BENCH: tuple[Declared, ...] = (
    Field("schema", "string", "the schema id"),
    Field("device", "string", "where it ran"),
    Field("tau", "number", "the budget"),
    Field("repeats", "integer", "interleaved repeats per size"),
    Field("rows", "array of object", "one per size"),
    Field("rows[].tokens", "integer", "tokens in the batch"),
    Field("rows[].candidates", "integer", "trust-region candidates"),
    Field("rows[].identical", "boolean", "sort's, radix's and both forwards' masks agree, and the two forwards' losses"),
    Field("rows[].median_ms", "map of number", "each method's median time, ms", keys=_METHODS),
    Field("rows[].best_ms", "map of number", "each method's best time, ms", keys=_METHODS),
    Field("rows[].sort_over_radix", "number", "median sort / median radix"),
    Field("rows[].radix_over_floor", "number", "median radix / median floor"),
    Field("rows[].forward_over_selection", "number", "best forward / best radix"),
    Field("rows[].sort_over_forward", "number", "best sort / best forward"),
    Field("rows[].forward_over_floor", "number", "best forward / best floor"),
    Field("rows[].forward_over_passes", "number", "best forward / best passes"),
    Field("rows[].passes_over_selection", "number", "best passes / best radix"),
    Field("rows[].unfused_over_forward", "number", "best unfused / best forward"),
    Field("rows[].fused", "boolean", "whether the counted forward ran the fused CPU passes"),
    Field("rows[].syncs_per_forward", "integer", "would-sync operators of one forward"),
    Field("rows[].syncs", "map of integer", "those, per operator", keys="an aten operator"),
    Field("rows[].syncs_per_unfused_forward", "integer", "would-sync operators of one unfused forward"),
    Field("rows[].unfused_syncs", "map of integer", "those, per operator", keys="an aten operator"),
    Field("rows[].operators_per_forward", "integer", "operators one forward dispatches"),
    Field("environment", "object", "what it ran on"),
    Field("environment.torch", "string", "torch's version"),
    Field("environment.threads", "integer", "torch's CPU threads"),
    Field("environment.platform", "string", "the platform"),
    Field("environment.gpu", "string or null", "the GPU; null on the CPU"),
    Field("environment.fused_passes", "string", "`built`, or why the fused CPU passes are not used"),
    Field("across_ranks", "object", "histogram rounds against an all-gather, on a gloo world", when="with --ranks only"),
    Field("across_ranks.world_size", "integer", "ranks"),
    Field("across_ranks.tokens_per_rank", "integer", "tokens per rank (the largest size)"),
    Field("across_ranks.identical", "boolean", "both keep the same tokens on every rank"),
    Field("across_ranks.median_ms", "object", "the slowest rank's median time, ms"),
    Field("across_ranks.median_ms.histogram", "number", "histogram rounds"),
    Field("across_ranks.median_ms.all_gather", "number", "all-gather"),
    Field(
        "across_ranks.traffic_rank0",
        "map of map of object",
        "rank 0's collectives per method",
        keys="`histogram` or `all_gather`, then a collective's kind",
    ),
    Field("across_ranks.traffic_rank0{}{}.calls", "integer", "calls"),
    Field("across_ranks.traffic_rank0{}{}.bytes", "integer", "bytes sent"),
    Field("across_ranks.per_rank", "array of object", "every rank's figures"),
    Field("across_ranks.per_rank[].identical", "boolean", "both keep the same tokens on this rank"),
    Field("across_ranks.per_rank[].kept", "integer", "tokens kept on this rank"),
    Field("across_ranks.per_rank[].median_ms", "map of number", "its median times, ms", keys="`histogram` or `all_gather`"),
    Field(
        "across_ranks.per_rank[].traffic",
        "map of map of object",
        "its collectives per method",
        keys="`histogram` or `all_gather`, then a collective's kind",
    ),
    Field("across_ranks.per_rank[].traffic{}{}.calls", "integer", "calls"),
    Field("across_ranks.per_rank[].traffic{}{}.bytes", "integer", "bytes sent"),
    Field("across_ranks.forward_syncs", "array of object", "the distributed forward's would-sync operators, per rank"),
    Field("across_ranks.forward_syncs[].rank", "integer", "the rank"),
    Field("across_ranks.forward_syncs[].syncs", "integer", "would-sync operators"),
    Field("across_ranks.forward_syncs[].collectives", "integer", "collectives called"),
)

BENCH_AUDIT: tuple[Declared, ...] = (
    Field("schema", "string", "the schema id"),
    Field("tau", "number", "the budget"),
    Field("step", "object", "the synthetic optimizer step"),
    Field("step.dp", "integer", "data-parallel ranks"),
    Field("step.micro_batches", "integer", "micro-batches per rank"),
    Field("step.rows_per_micro_batch", "integer", "rows per micro-batch"),
    Field("step.T", "integer", "tokens per row"),
    Field("step.tokens", "integer", "tokens in the step"),
    Field("step.valid_count", "integer", "valid tokens, N"),
    Field("step.trust_region_count", "integer", "trust-region tokens"),
    Field("step.kept_trust_region_count", "integer", "trust-region tokens kept"),
    Field("step.m2_before", "number", "M2 before masking"),
    Field("step.m2_after", "number", "M2 after masking"),
    Field("step.masked_fraction", "number", "masked share of the trust region"),
    Field("step.planted_micro_batch", "object", "the micro-batch of the planted case, selected on its own"),
    Field("step.planted_micro_batch.rank", "integer", "its rank"),
    Field("step.planted_micro_batch.micro_batch", "integer", "its micro-batch"),
    Field("step.planted_micro_batch.tokens_changed", "integer", "tokens whose keep it changes"),
    Field("prepare_s", "number", "seconds to make the step"),
    Field("cases", "array of object", "`correct`, then `planted`"),
    Field("cases[].case", "string", "`correct` or `planted`"),
    Field("cases[].expected", "string", "the verdict it must get"),
    Field("cases[].as_expected", "boolean", "whether it got it"),
    Field("cases[].disk_bytes", "integer", "the capture's size on disk"),
    Field("cases[].write_s", "number", "seconds to write the capture"),
    Field("cases[].wall_s", "number", "seconds `audit_capture` took"),
    Field("cases[].cpu_user_s", "number", "its user CPU seconds"),
    Field("cases[].cpu_system_s", "number", "its system CPU seconds"),
    Field("cases[].peak_rss_bytes", "integer", "the audit process's peak RSS (`VmHWM`)"),
    Field("cases[].rss_after_imports_bytes", "integer", "its RSS once its imports are done"),
    Field("cases[].verdict", "string", "the audit's verdict"),
    Field("cases[].steps", "array of object", "per step audited"),
    Field("cases[].steps[].step", "integer", "the step"),
    Field("cases[].steps[].verdict", "string", "its verdict"),
    Field("cases[].steps[].failing", "array of string", "its failing checks"),
    Field("cases[].steps[].diagnosis", "array of string", "the deviations named"),
    Field("cases[].process_s", "number", "seconds of the whole audit process"),
    Field("cases[].within_target", "boolean", "wall time and peak RSS under `target`'s"),
    Field("target", "object", "the audit's target, an observation, never asserted"),
    Field("target.wall_s", "number", "seconds"),
    Field("target.peak_rss_bytes", "integer", "bytes"),
    Field("environment", "object", "what it ran on"),
    Field("environment.python", "string", "Python's version"),
    Field("environment.torch", "string", "torch's version"),
    Field("environment.cpus", "integer or null", "CPUs"),
    Field("environment.platform", "string", "the platform"),
)

#: Every JSON record the toolkit writes, by name.
SCHEMAS: dict[str, Schema] = {
    schema.name: schema
    for schema in (
        Schema(
            "compare",
            "m2po_oracle.compare.report:SCHEMA",
            "`m2po-oracle compare --json PATH` (and the pytest plugin's and `python -m m2po_oracle.torchrun`'s)",
            "A run of a loss function, a distributed step or a training step "
            "against Algorithm 1; the HTML report is rendered from it and nothing else.",
            JSON_NON_FINITE,
            compare_schema.FIELDS,
        ),
        Schema(
            "audit",
            "m2po_oracle.audit.records:SCHEMA",
            "`m2po-oracle audit DIR --json PATH`",
            "The offline audit of a capture, step by step (see auditing a training run).",
            JSON_NON_FINITE,
            AUDIT,
        ),
        Schema(
            "capture",
            "m2po_oracle.capture.recorder:SCHEMA",
            "`m2po_oracle.capture.Recorder`: `DIR/manifest.rank-NNN.json`",
            "One rank's manifest of a capture: every record it wrote, with a CRC-32 of each file.",
            CAPTURE_NON_FINITE,
            CAPTURE,
        ),
        Schema(
            "bench",
            "m2po_oracle.bench.core:SCHEMA",
            "`m2po-oracle bench --json PATH`",
            "The selection's and the core forward's speed, side by side.",
            (),
            BENCH,
        ),
        Schema(
            "bench-audit",
            "m2po_oracle.bench.audit:SCHEMA",
            "`m2po-oracle bench --audit --json PATH`",
            "How long the offline audit takes on one synthetic step, correct and with a planted bug.",
            (),
            BENCH_AUDIT,
        ),
    )
}


def schema_of(record: dict) -> Schema:
    """The schema whose id a record names; a KeyError naming the ids known."""
    for schema in SCHEMAS.values():
        if schema.id == record.get("schema"):
            return schema
    raise KeyError(f"no declared schema {record.get('schema')!r}; known: {', '.join(s.id for s in SCHEMAS.values())}")
