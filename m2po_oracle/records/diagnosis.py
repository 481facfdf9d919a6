"""The diagnosis of a compare report (its ``diagnosis`` key), key by key, and the batch its
counterexamples carry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from msgspec import UNSET, UnsetType

from m2po_oracle.records.declare import Number, doc


@dataclass(frozen=True, kw_only=True)
class Diagnosis:
    """`diagnosis`"""

    status: Annotated[
        Literal["not_needed", "not_run", "matched", "mostly_explained", "partly_explained", "no_known_variant"],
        doc("`not_needed`, `not_run`, `matched`, `mostly_explained`, `partly_explained` or `no_known_variant`"),
    ]
    examples_compared: Annotated[int, doc("the examples the shares count")]
    examples_searched: Annotated[
        int | UnsetType, doc("the sample the search ran on", when="absent where the implementation could not be loaded")
    ] = UNSET
    summary: Annotated[str | UnsetType, doc("the diagnosis in one line", when="absent where the implementation could not be loaded")] = (
        UNSET
    )
    components: Annotated[
        tuple[str, ...] | UnsetType,
        doc(
            "the deviations of the best explanation, by name (a fitted value in the name: `clip_floors(0.2, 0.28)`)",
            when="absent where the implementation could not be loaded",
        ),
    ] = UNSET
    by_check: Annotated[
        dict[str, tuple[str, ...]] | UnsetType,
        doc(
            "the deviations that explain each failing check",
            when="absent where the implementation could not be loaded",
            keys="a failing check's name",
        ),
    ] = UNSET
    shares: Annotated[
        dict[str, Share] | UnsetType,
        doc(
            "how much of each failing check the explanation reproduces",
            when="absent where the implementation could not be loaded",
            keys="an explained check's name",
        ),
    ] = UNSET
    residuals: Annotated[
        tuple[Residual, ...] | UnsetType,
        doc(
            "what an explanation does not reproduce, grouped by the checks that leave the same examples",
            when="absent where the implementation could not be loaded; items only where an explanation leaves some of a check's failing examples unreproduced",
        ),
    ] = UNSET
    unexplained: Annotated[
        tuple[str, ...] | UnsetType,
        doc("failing checks nothing explains (or explains on less than half)", when="absent where the implementation could not be loaded"),
    ] = UNSET
    matches: Annotated[tuple[Match, ...], doc("each deviation named, with its evidence")]
    alternatives: Annotated[
        tuple[tuple[str, ...], ...] | UnsetType,
        doc("explanations as small as the chosen one", when="absent where the implementation could not be loaded"),
    ] = UNSET
    alternatives_reason: Annotated[
        str | UnsetType, doc("why they stand side by side", when="a divergent run's diagnosis with alternatives only")
    ] = UNSET
    closest: Annotated[
        tuple[Closest, ...] | UnsetType,
        doc(
            "leads: the explanation below the naming threshold for a check, then single variants agreeing somewhere",
            when="items only where a failing check is unexplained",
        ),
    ] = UNSET
    findings: Annotated[
        tuple[Finding, ...] | UnsetType,
        doc(
            "findings beside the deviations",
            when="absent where the implementation could not be loaded; items only where the loss or gradient is NaN/inf on inputs finite on every valid token, or where a training step's logged metrics are its micro-batches' own values averaged with equal weight",
        ),
    ] = UNSET
    hints: Annotated[
        tuple[Hint, ...] | UnsetType,
        doc("options that would accept what the failures fit", when="absent where the implementation could not be loaded"),
    ] = UNSET
    padding_leak: Annotated[
        PaddingLeak | UnsetType | None,
        doc(
            "the evidence of a padding leak; else null",
            when="absent where the implementation could not be loaded; an object only where `nan_padding_leak` is named",
        ),
    ] = UNSET


@dataclass(frozen=True, kw_only=True)
class PaddingLeak:
    """`diagnosis.padding_leak`"""

    fill: Annotated[str, doc("the padding probe that showed it first on the smallest such batch")]
    where: Annotated[str, doc("`loss`, `valid token` or `padding position`")]
    index: Annotated[tuple[int, ...] | None, doc("the token, where a gradient is NaN/inf")]
    value: Annotated[str, doc("the NaN/inf value, as Python writes it")]
    examples: Annotated[int, doc("examples on which some padding made the result NaN/inf")]
    inputs: Annotated[tuple[str, ...] | None, doc("the inputs whose NaN padding alone does it; null: not probed")]
    text: Annotated[str, doc("the evidence in one sentence")]


@dataclass(frozen=True, kw_only=True)
class Hint:
    """`diagnosis.hints[]`"""

    checks: Annotated[tuple[str, ...], doc("the checks")]
    text: Annotated[str, doc("what their failures fit")]
    option: Annotated[str, doc("the option")]


@dataclass(frozen=True, kw_only=True)
class Finding:
    """`diagnosis.findings[]`"""

    kind: Annotated[str, doc("`non_finite_result` or `unweighted_micro_batch_metric_mean`")]
    checks: Annotated[tuple[str, ...], doc("the checks it concerns")]
    summary: Annotated[str, doc("the finding in one line")]


@dataclass(frozen=True, kw_only=True)
class Closest:
    """`diagnosis.closest[]`"""

    variant: Annotated[str, doc("the deviations, `a + b`")]
    description: Annotated[str, doc("what they do, or how far they reproduce the check")]
    source: Annotated[str, doc("where the deviation is seen in the wild")]
    agreed: Annotated[int, doc("examples it agrees on")]
    of: Annotated[int, doc("examples compared")]
    first_difference: Annotated[str, doc("its first difference from the port")]
    check: Annotated[str | UnsetType, doc("the check it falls short on", when="a row for one check's explanation")] = UNSET


@dataclass(frozen=True, kw_only=True)
class Match:
    """`diagnosis.matches[]`"""

    variant: Annotated[str, doc("its name")]
    description: Annotated[str, doc("what the port does")]
    source: Annotated[str, doc("where the deviation is seen in the wild")]
    evidence: Annotated[str, doc("what reproduces it")]
    checks: Annotated[tuple[str, ...], doc("the failing checks it explains")]
    unobserved: Annotated[
        tuple[str, ...] | UnsetType,
        doc(
            "its effects the run could not observe (an adapter that builds the loss and gradient)",
            when="a deviation of one loss call (not a distributed or trainer one)",
        ),
    ] = UNSET


@dataclass(frozen=True, kw_only=True)
class Residual:
    """`diagnosis.residuals[]`"""

    checks: Annotated[tuple[str, ...], doc("the checks")]
    unexplained: Annotated[bool, doc("whether nothing known names them")]
    count: Annotated[int, doc("the examples left")]
    contradicted: Annotated[int, doc("of them, passing examples the explanation gets wrong")]
    features: Annotated[
        tuple[Feature, ...],
        doc("the batch features they hold most, against how often each holds where the explanation reproduces the checks"),
    ]
    shared: Annotated[tuple[str, ...], doc("the features every one of them holds")]
    float32_fits: Annotated[
        int | None,
        doc("of them, those the explanation reproduces at float32's tolerance; null where the run already judges at float32 or coarser"),
    ]
    explanation: Annotated[tuple[str, ...], doc("what the residual is measured against ([]: Algorithm 1)")]
    counterexample: Annotated[ResidualCounterexample, doc("the smallest of them")]


@dataclass(frozen=True, kw_only=True)
class ResidualCounterexample:
    """`diagnosis.residuals[].counterexample`"""

    batch: Annotated[Batch, doc("its batch")]
    difference: Annotated[str, doc("its first difference from the explanation")]
    replay: Annotated[str | None, doc("the command that replays it")]


@dataclass(frozen=True, kw_only=True)
class Feature:
    """`diagnosis.residuals[].features[]`"""

    feature: Annotated[str, doc("the feature")]
    description: Annotated[str, doc("when it holds")]
    residual: Annotated[int, doc("residual examples that hold it")]
    of: Annotated[int, doc("residual examples")]
    explained: Annotated[int, doc("reproduced examples that hold it")]
    explained_of: Annotated[int, doc("reproduced examples")]


@dataclass(frozen=True, kw_only=True)
class Share:
    """`diagnosis.shares{}`"""

    components: Annotated[tuple[str, ...], doc("the deviations it is explained by")]
    explained: Annotated[int, doc("of the check's failing examples, those reproduced")]
    failing: Annotated[int, doc("the check's failing examples")]
    contradicted: Annotated[int, doc("passing examples the explanation gets wrong")]
    of: Annotated[int, doc("the examples counted")]
    share: Annotated[Number, doc("`explained / (failing + contradicted)`")]
    held_out: Annotated[
        HeldOut | None, doc("the same counts on the held-out examples alone (the search chose on the others); null where none was held out")
    ]


@dataclass(frozen=True, kw_only=True)
class HeldOut:
    """`diagnosis.shares{}.held_out`"""

    explained: Annotated[int, doc("held-out failing examples reproduced")]
    failing: Annotated[int, doc("held-out failing examples")]
    contradicted: Annotated[int, doc("held-out passing examples the explanation gets wrong")]


@dataclass(frozen=True, kw_only=True)
class Batch:
    """`counterexamples[].batch`"""

    logp: Annotated[tuple[tuple[Number, ...], ...], doc("log-probs of the current policy, [B, T]")]
    behavior_logp: Annotated[tuple[tuple[Number, ...], ...], doc("log-probs of the behaviour policy, [B, T]")]
    advantages: Annotated[tuple[tuple[Number, ...], ...], doc("advantages, [B, T]")]
    valid: Annotated[tuple[tuple[int, ...], ...], doc("the loss mask, 1 on a valid token, 0 on padding, [B, T]")]
    tau: Annotated[Number, doc("the second-moment budget")]
