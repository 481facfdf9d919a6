"""The diagnosis as a typed record: what :func:`~m2po_oracle.explain.diagnosis.diagnose`
returns, what the compare report carries, and the one place its JSON shape is written.

Every room above reads these attributes; only the renderers read the JSON, and they read
nothing else. The shapes of the statuses that explain nothing (``not_needed``, ``not_run``)
are spelled here once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from msgspec import UNSET, UnsetType

from m2po_oracle.explain.padding import PaddingLeak
from m2po_oracle.oracle.batch import Batch
from m2po_oracle.oracle.encoding import to_builtins

#: The statuses of a diagnosis that names something or says that nothing known does.
EXPLAINING = ("matched", "mostly_explained", "partly_explained", "no_known_variant")


@dataclass(frozen=True)
class Share:
    """How much of one failing check the explanation reproduces (the naming rule's inputs)."""

    explained: int  # of the check's failing examples, those reproduced
    failing: int
    contradicted: int  # passing examples the explanation gets wrong (Algorithm 1 gets them right)
    of: int  # failing + contradicted
    share: float  # explained / of
    components: tuple[str, ...]  # the deviations it is explained by
    held_out: HeldOut | None = None  # the same counts on the examples the search did not choose on


@dataclass(frozen=True)
class HeldOut:
    """A share's counts on the held-out examples alone: the search chose its explanation on
    the others, so these say whether the name holds beyond the examples it was fitted to."""

    explained: int
    failing: int
    contradicted: int


@dataclass(frozen=True)
class Feature:
    """A batch feature the residual's examples hold, against how often the reproduced ones do."""

    feature: str
    residual: int
    of: int
    explained: int
    explained_of: int
    description: str


@dataclass(frozen=True)
class ResidualExample:
    """The smallest example of a residual: its batch, its first difference and its replay."""

    batch: Batch
    difference: str
    replay: str | None


@dataclass(frozen=True)
class Residual:
    """The examples of some checks that their explanation (or, unexplained, Algorithm 1) does not reproduce."""

    checks: tuple[str, ...]
    unexplained: bool
    count: int
    contradicted: int
    features: tuple[Feature, ...]
    shared: tuple[str, ...]  # the features every one of them holds
    float32_fits: int | None  # of them, those reproduced at float32's tolerance (None: not measured)
    explanation: tuple[str, ...]  # what it is measured against (): Algorithm 1
    counterexample: ResidualExample


@dataclass(frozen=True)
class Match:
    """A deviation named, with what reproduces it. ``unobserved`` is None for a step-level
    deviation (distributed, trainer), whose effects are all observed by its step: not written."""

    variant: str
    description: str
    source: str
    evidence: str
    checks: tuple[str, ...]
    unobserved: tuple[str, ...] | UnsetType = UNSET


@dataclass(frozen=True)
class Lead:
    """A lead for an unexplained check: the explanation's own share on ``check`` below the
    naming rule, or (``check`` UNSET) a single deviation that agrees on some divergent examples."""

    variant: str
    description: str
    source: str
    agreed: int
    of: int
    first_difference: str
    check: str | UnsetType = UNSET


@dataclass(frozen=True)
class Hint:
    """An option that would accept what some checks' failures fit."""

    checks: tuple[str, ...]
    text: str
    option: str


@dataclass(frozen=True)
class Finding:
    """Something the run showed beside the deviations (``kind``: ``non_finite_result``,
    ``unweighted_micro_batch_metric_mean``)."""

    kind: str
    checks: tuple[str, ...]
    summary: str


@dataclass(frozen=True)
class Diagnosis:
    """Which known deviations reproduce a run's failures, and how much of each failing check.

    ``status``: ``not_needed`` (no divergence), ``not_run`` (no result to explain),
    ``matched``, ``mostly_explained`` (a residual is left), ``partly_explained`` (some check
    is unexplained), ``no_known_variant``. ``examples_searched`` is None where no search ran
    on any sample (``not_run``)."""

    status: str
    examples_compared: int = 0
    examples_searched: int | None = None
    components: tuple[str, ...] = ()
    by_check: dict[str, tuple[str, ...]] = field(default_factory=dict)
    shares: dict[str, Share] = field(default_factory=dict)
    residuals: tuple[Residual, ...] = ()
    unexplained: tuple[str, ...] = ()
    matches: tuple[Match, ...] = ()
    alternatives: tuple[tuple[str, ...], ...] = ()
    alternatives_reason: str | UnsetType = UNSET  # set where a search ran on a divergent run
    closest: tuple[Lead, ...] = ()
    findings: tuple[Finding, ...] = ()
    hints: tuple[Hint, ...] = ()
    summary: str = ""
    padding_leak: PaddingLeak | None = None

    @classmethod
    def not_run(cls) -> Diagnosis:
        """No result to explain: the implementation could not be loaded, no call returned, or the run was interrupted first."""
        return cls("not_run")

    def partly(self) -> tuple[str, ...]:
        """The checks explained on fewer than all their failing examples."""
        return tuple(sorted(check for check, share in self.shares.items() if share.share < 1))

    def to_json(self) -> dict[str, Any]:
        """Its JSON, derived from the declaration; one that did not run says only what it has."""
        out = to_builtins(self)
        return {key: out[key] for key in NOT_RUN_KEYS} if self.status == "not_run" else out


#: What a diagnosis that did not run writes.
NOT_RUN_KEYS = ("status", "examples_compared", "matches", "closest")
