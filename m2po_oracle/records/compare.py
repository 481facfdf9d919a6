"""The compare report (``m2po-oracle compare --json``, the pytest plugin's, ``python -m
m2po_oracle.torchrun``'s), key by key: the HTML report is rendered from it and nothing else."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal, get_args

from msgspec import UNSET, UnsetType

from m2po_oracle.records.declare import Number, doc
from m2po_oracle.records.diagnosis import Batch, Diagnosis

SchemaId = Literal["m2po-oracle/compare/1"]
SCHEMA: SchemaId = get_args(SchemaId)[0]


@dataclass(frozen=True, kw_only=True)
class CompareRecord:
    """A run of a loss function, a distributed step or a training step against Algorithm 1; the HTML report is rendered from it and nothing else."""

    schema: Annotated[SchemaId, doc("the schema id")]
    verdict: Annotated[
        Literal["equivalent", "equivalent-with-accepted", "divergent", "accepted-deviation-fixed", "unusable", "interrupted"],
        doc(
            "`equivalent`, `equivalent-with-accepted`, `divergent`, `accepted-deviation-fixed`, `unusable` or `interrupted` (exit status 0, 0, 1, 1, 2, 130)"
        ),
    ]
    implementation: Annotated[str, doc("the `--impl` spec")]
    options: Annotated[Options, doc("the options the run ran with")]
    examples: Annotated[int, doc("examples tried")]
    example_unit: Annotated[str, doc("what one example is: `batches`, or `steps` for the trainer")]
    duration_s: Annotated[float, doc("wall time in seconds")]
    stopped_early: Annotated[
        str | None,
        doc("why exploration ended before the examples requested (timeouts, a process dying on every call, --max-failures); else null"),
    ]
    load_error: Annotated[str | None, doc("why the implementation could not be loaded; else null")]
    checks: Annotated[tuple[Check, ...], doc("the checks this run performs, in report order")]
    coverage: Annotated[Coverage, doc("what the examples tried were")]
    counterexamples: Annotated[tuple[Counterexample, ...], doc("one minimal failing example per distinct cause")]
    diagnosis: Annotated[Diagnosis, doc("which known deviations reproduce the failures (see the diagnosis explanation)")]
    accepted: Annotated[tuple[Accepted, ...], doc("the deviations the project accepts (`accept`, `--accept`)")]
    strict_accept: Annotated[bool, doc("whether an accepted deviation that no longer shows fails the run")]
    validation: Annotated[Validation, doc("the invalid-input probes, reported apart from equivalence")]
    implementation_output: Annotated[ImplementationOutput, doc("what the implementation printed")]
    topology: Annotated[Topology | UnsetType, doc("the world", when="distributed runs only (--topology)")] = UNSET
    collectives_per_step: Annotated[
        tuple[CollectivesPerStep, ...] | UnsetType, doc("per rank, the collectives of one step", when="distributed runs only (--topology)")
    ] = UNSET
    adapter: Annotated[Adapter | UnsetType, doc("the port's calling convention", when="with --adapter only")] = UNSET
    capture: Annotated[Capture | UnsetType, doc("where the run recorded its steps for `m2po-oracle audit`", when="with --capture only")] = (
        UNSET
    )
    tolerances: Annotated[tuple[Tolerance, ...], doc("the tolerance table (see the tolerances reference)")]
    environment: Annotated[Environment, doc("what the run ran on")]


@dataclass(frozen=True, kw_only=True)
class Environment:
    """`environment`"""

    m2po_oracle: Annotated[str, doc("the toolkit's version")]
    python: Annotated[str, doc("Python's version")]
    torch: Annotated[str, doc("torch's version")]
    numpy: Annotated[str, doc("NumPy's version")]
    hypothesis: Annotated[str, doc("Hypothesis' version")]
    platform: Annotated[str, doc("the platform")]
    git_revision: Annotated[str | None, doc("the git revision of the working directory; null outside one")]


@dataclass(frozen=True, kw_only=True)
class Tolerance:
    """`tolerances[]`"""

    dtype: Annotated[str, doc("the input dtype")]
    quantity: Annotated[str, doc("what is compared")]
    rtol: Annotated[Number, doc("relative tolerance")]
    atol: Annotated[Number, doc("absolute tolerance")]


@dataclass(frozen=True, kw_only=True)
class Capture:
    """`capture`"""

    directory: Annotated[str, doc("the capture directory")]
    steps: Annotated[int, doc("optimizer steps recorded")]


@dataclass(frozen=True, kw_only=True)
class Adapter:
    """`adapter`"""

    name: Annotated[str, doc("the adapter (see the adapters reference)")]
    signature: Annotated[str, doc("the signature it calls")]
    checked: Annotated[tuple[str, ...], doc("what of the port's results is checked")]
    supplies: Annotated[
        tuple[str, ...], doc("the result fields the port computed in the run: its family's, less the metrics it never returned")
    ]
    builds: Annotated[dict[str, str], doc("what the adapter computes itself, and how", keys="a result field")]
    metrics_read: Annotated[dict[str, str], doc("where in the port's return each metric was read", keys="a metric's name")]
    not_run: Annotated[dict[str, str], doc("the checks the adapter cannot run, each with why", keys="a check's name")]
    bindings: Annotated[tuple[str, ...], doc("the `--bind` texts")]
    call: Annotated[str | None, doc("the call the port received; null before any call")]


@dataclass(frozen=True, kw_only=True)
class CollectivesPerStep:
    """`collectives_per_step[]`"""

    rank: Annotated[int, doc("the global rank")]
    coords: Annotated[Coords, doc("where it sits in the DP x CP x TP grid")]
    collectives: Annotated[
        dict[str, Collective], doc("the collectives it called", keys="a collective's kind (`all_reduce`, `all_gather`, ...)")
    ]


@dataclass(frozen=True, kw_only=True)
class Topology:
    """`topology`"""

    dp: Annotated[int, doc("data-parallel size")]
    cp: Annotated[int, doc("context-parallel size")]
    tp: Annotated[int, doc("tensor-parallel size")]
    backend: Annotated[str, doc("the collective backend")]


@dataclass(frozen=True, kw_only=True)
class ImplementationOutput:
    """`implementation_output`"""

    first_lines: Annotated[tuple[str, ...], doc("the first lines")]
    lines: Annotated[int, doc("lines printed, counted over every call")]


@dataclass(frozen=True, kw_only=True)
class Validation:
    """`validation`"""

    strict: Annotated[bool, doc("whether a silently accepted invalid input fails the run")]
    not_run: Annotated[str | None, doc("why the probes were skipped; else null")]
    probes: Annotated[tuple[Probe, ...], doc("one per probe")]


@dataclass(frozen=True, kw_only=True)
class Probe:
    """`validation.probes[]`"""

    probe: Annotated[str, doc("the probe's name (see the checks reference)")]
    description: Annotated[str, doc("the invalid input")]
    status: Annotated[
        Literal["rejected", "warned", "accepted", "hung", "crashed", "not run"],
        doc("`rejected`, `warned`, `accepted`, `hung`, `crashed` or `not run`"),
    ]
    message: Annotated[str, doc("what the port said (its exception or warning)")]
    expected: Annotated[str, doc("`rejected`, or `warned` for a setting allowed with a warning")]


@dataclass(frozen=True, kw_only=True)
class Accepted:
    """`accepted[]`"""

    deviation: Annotated[str, doc("its name")]
    reason: Annotated[str, doc("why the project accepts it")]
    link: Annotated[str, doc("where that is discussed")]
    shown: Annotated[bool, doc("whether it showed in this run")]
    checks: Annotated[tuple[str, ...], doc("the failing checks it explains")]


@dataclass(frozen=True, kw_only=True)
class Counterexample:
    """`counterexamples[]`"""

    check: Annotated[str, doc("the check it was shrunk for")]
    cause: Annotated[str | None, doc("the deviations it demonstrates (`a + b`); null for an unexplained check")]
    checks: Annotated[tuple[str, ...], doc("every failing check it shows")]
    shrink_stopped: Annotated[
        str | None, doc("why shrinking stopped before it tried every smaller batch (its budget of calls or time); null when it did not")
    ]
    summary: Annotated[str, doc("its first mismatch in one line")]
    replay: Annotated[str, doc("the command that replays it")]
    batch: Annotated[Batch, doc("the batch the implementation received")]
    shape: Annotated[tuple[int, ...], doc("the batch's [B, T]")]
    tokens: Annotated[tuple[Token, ...], doc("one row per token (the first 512)")]
    tokens_truncated: Annotated[bool, doc("whether the batch has more tokens than `tokens` shows")]
    mismatches: Annotated[tuple[Mismatch, ...], doc("every violated property on this example")]
    expected: Annotated[
        dict[str, Number],
        doc(
            "Algorithm 1's loss and metrics",
            keys="`loss`, then each metric and count the result has (`METRIC_FIELDS`, `COUNT_FIELDS` of `m2po_oracle.oracle.record`)",
        ),
    ]
    expected_on_actual_mask: Annotated[
        dict[str, Number],
        doc(
            "the oracle's loss and metrics on the implementation's own mask (what the loss and metric checks compare with); empty without a result",
            keys="`loss`, then each metric and count the result has (`METRIC_FIELDS`, `COUNT_FIELDS` of `m2po_oracle.oracle.record`)",
        ),
    ]
    actual: Annotated[
        dict[str, Number],
        doc(
            "the implementation's loss and metrics; empty without a result",
            keys="`loss`, then each metric and count the result has (`METRIC_FIELDS`, `COUNT_FIELDS` of `m2po_oracle.oracle.record`)",
        ),
    ]
    removal_curve: Annotated[RemovalCurve, doc("Algorithm 1's removal curve on this batch")]
    ranks: Annotated[tuple[Rank, ...] | UnsetType, doc("every rank's part of the step", when="distributed runs only (--topology)")] = UNSET
    trainer_case: Annotated[
        TrainerCase | UnsetType, doc("the training step's input (the batch is what the trainer produced)", when="trainer runs only")
    ] = UNSET


@dataclass(frozen=True, kw_only=True)
class TrainerCase:
    """`counterexamples[].trainer_case`"""

    kind: Annotated[str, doc("`trainer_case`")]
    seed: Annotated[int, doc("seed of the step's model and rollouts")]
    prompts: Annotated[int, doc("prompts in the step")]
    group_size: Annotated[int, doc("completions per prompt")]
    prompt_len: Annotated[int, doc("tokens per prompt")]
    max_new_tokens: Annotated[int, doc("tokens per completion at most")]
    lags: Annotated[tuple[int, ...], doc("per prompt: optimizer steps its rollout worker is behind the current policy")]
    staleness_lr: Annotated[Number, doc("learning rate of the steps the stale workers missed")]
    tau: Annotated[Number, doc("the budget")]
    split: Annotated[tuple[int, ...], doc("rows per micro-batch")]
    cut: Annotated[int | None, doc("when not null, tau is derived from the step so that Algorithm 1 removes that many trust-region tokens")]
    trainer: Annotated[Trainer | UnsetType, doc("what the step did", when="a step that ran to the end")] = UNSET


@dataclass(frozen=True, kw_only=True)
class Trainer:
    """`counterexamples[].trainer_case.trainer`"""

    split: Annotated[tuple[int, ...], doc("rows per micro-batch")]
    loss: Annotated[Number, doc("the step's loss")]
    rows: Annotated[int, doc("rows of the rollout")]
    tokens: Annotated[int, doc("valid tokens")]
    rewards: Annotated[tuple[Number, ...], doc("each completion's reward")]
    parameters: Annotated[int, doc("the model's parameters")]


@dataclass(frozen=True, kw_only=True)
class Rank:
    """`counterexamples[].ranks[]`"""

    rank: Annotated[int, doc("the global rank")]
    coords: Annotated[Coords, doc("where it sits in the DP x CP x TP grid")]
    rows: Annotated[tuple[int, ...], doc("the rows it was given: [start, stop)")]
    keep: Annotated[tuple[tuple[int, ...], ...] | None, doc("the mask it returned (1: kept); null without a result")]
    loss: Annotated[Number | None, doc("the loss it returned; null without a result")]
    metrics: Annotated[dict[str, Number], doc("the metrics it reported", keys="a metric's name")]
    collectives: Annotated[
        dict[str, Collective], doc("the collectives it called in this step", keys="a collective's kind (`all_reduce`, `all_gather`, ...)")
    ]
    error: Annotated[str | None, doc("the error it raised; else null")]
    stack: Annotated[str | None, doc("its stack, where it was still running at the deadline; else null")]


@dataclass(frozen=True, kw_only=True)
class Collective:
    """`counterexamples[].ranks[].collectives{}`"""

    calls: Annotated[int, doc("calls of that kind")]
    bytes: Annotated[int, doc("bytes those calls sent from this rank")]


@dataclass(frozen=True, kw_only=True)
class Coords:
    """`counterexamples[].ranks[].coords`"""

    dp: Annotated[int, doc("data-parallel rank")]
    cp: Annotated[int, doc("context-parallel rank")]
    tp: Annotated[int, doc("tensor-parallel rank")]


@dataclass(frozen=True, kw_only=True)
class RemovalCurve:
    """`counterexamples[].removal_curve`"""

    tau: Annotated[Number, doc("the budget")]
    prefix_means: Annotated[tuple[Number, ...], doc("mean M2 of the k smallest candidates, k = 1, 2, ... (the first 512)")]
    candidates: Annotated[int, doc("trust-region candidates")]
    oracle_kept_min: Annotated[int, doc("fewest candidates Algorithm 1 may keep (the rounding band of the compute dtype)")]
    oracle_kept_max: Annotated[int, doc("most candidates Algorithm 1 may keep")]
    implementation_kept: Annotated[int | None, doc("candidates the implementation kept; null without a result")]


@dataclass(frozen=True, kw_only=True)
class Mismatch:
    """`counterexamples[].mismatches[]`"""

    check: Annotated[str, doc("the check that failed")]
    summary: Annotated[str, doc("what differs, in one line")]
    field: Annotated[str, doc("the result field compared (`loss`, `grad`, `keep`, a metric); empty where none")]
    index: Annotated[tuple[int, ...] | None, doc("the token compared, where one is")]
    actual: Annotated[float | bool | str | None, doc("the implementation's value (a non-finite one as a string)")]
    expected: Annotated[float | bool | str | None, doc("Algorithm 1's")]
    details: Annotated[tuple[str, ...], doc("more lines (a traceback, the values around it)")]


@dataclass(frozen=True, kw_only=True)
class Token:
    """`counterexamples[].tokens[]`"""

    index: Annotated[tuple[int, ...], doc("the token's [row, column]")]
    valid: Annotated[bool, doc("whether it is a valid token")]
    log_ratio: Annotated[Number | None, doc("d = logp - behavior_logp; null on padding")]
    advantage: Annotated[Number, doc("its advantage")]
    m2: Annotated[Number | None, doc("its second moment d^2; null on padding")]
    trust_region: Annotated[bool, doc("whether it is a trust-region candidate")]
    expected_keep: Annotated[bool, doc("whether Algorithm 1 (the literal loop) keeps it")]
    actual_keep: Annotated[bool | None, doc("whether the implementation kept it; null without a result")]
    expected_grad: Annotated[Number, doc("the oracle's gradient on the implementation's own mask (what the gradient check compares with)")]
    actual_grad: Annotated[Number | None, doc("the implementation's gradient; null without one")]


@dataclass(frozen=True, kw_only=True)
class Coverage:
    """`coverage`"""

    examples: Annotated[int, doc("examples tried")]
    judged: Annotated[int, doc("examples whose call returned a result")]
    unmeasured: Annotated[
        int | UnsetType, doc("judged examples whose batch features could not be computed", when="more than zero of them")
    ] = UNSET
    families: Annotated[
        dict[str, int],
        doc(
            "examples per strategy family, most first",
            keys="a family: `grpo`, `token_advantage`, `dyadic`, `ties`, `extreme`, `degenerate`, `scope`; `untagged` for a batch from elsewhere, `trainer_case` for a training step",
        ),
    ]
    features: Annotated[
        dict[str, int],
        doc(
            "judged examples that hold each batch feature",
            keys="a feature of `m2po_oracle.judge.coverage.FEATURES` (see the checks reference)",
        ),
    ]
    feature_descriptions: Annotated[dict[str, str], doc("when each feature holds", keys="a feature")]
    exercised_when: Annotated[dict[str, str], doc("the examples that exercise each check of the run", keys="a check's name")]
    confidence: Annotated[float, doc("the confidence of `checks[].failure_rate_upper_95`")]
    bound: Annotated[str, doc("what that bound is")]


@dataclass(frozen=True, kw_only=True)
class Check:
    """`checks[]`"""

    name: Annotated[str, doc("the check's name (see the checks reference)")]
    description: Annotated[str, doc("what it asserts")]
    status: Annotated[Literal["pass", "fail", "not run"], doc("`pass`, `fail` or `not run` (a check that never ran claims nothing)")]
    failures: Annotated[int, doc("failing examples")]
    ran: Annotated[int, doc("examples it ran on")]
    first_failure_at: Annotated[int | None, doc("1-based number of the first failing example; null: none")]
    exercised: Annotated[
        int,
        doc(
            "examples that could have failed it: its rule in `m2po_oracle.judge.coverage.EXERCISED` held where it ran, or it failed (a check without a rule, a distributed or trainer one, counts every example it ran on)"
        ),
    ]
    failure_rate_upper_95: Annotated[
        float | None,
        doc(
            "one-sided 95% Clopper-Pearson upper bound on the failure rate over the exercised examples, `beta.ppf(0.95, failures + 1, exercised - failures)`, 1.0 when every one failed; null when none was exercised"
        ),
    ]


@dataclass(frozen=True, kw_only=True)
class Options:
    """`options`"""

    examples: Annotated[int, doc("examples requested (`--examples`)")]
    seed: Annotated[int, doc("seed of the batch generator")]
    dtype: Annotated[str, doc("dtype of the input tensors")]
    compute_dtype: Annotated[str, doc("dtype the implementation computes its selection in")]
    tau: Annotated[Number | None, doc("the budget of every batch (`--tau`); null: drawn per batch")]
    device: Annotated[str, doc("torch device of the input tensors")]
    strict_validation: Annotated[bool, doc("whether silently accepted invalid input counts as a divergence")]
    dtype_why: Annotated[
        str | UnsetType, doc("why the runner chose the dtype", when="a trainer that computes in one dtype, run without --dtype")
    ] = UNSET
