"""The diagnosis as a typed record: what :func:`~m2po_oracle.explain.diagnosis.diagnose`
returns, what the compare report carries, and the one place its JSON shape is written.

Every room above reads these attributes; only the renderers read the JSON, and they read
nothing else. The shapes of the statuses that explain nothing (``not_needed``, ``not_run``)
are spelled here once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from m2po_oracle.explain.padding import PaddingLeak
from m2po_oracle.oracle.batch import Batch

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

    def to_json(self) -> dict[str, Any]:
        return {
            "explained": self.explained,
            "failing": self.failing,
            "contradicted": self.contradicted,
            "of": self.of,
            "share": self.share,
            "components": list(self.components),
            "held_out": self.held_out.to_json() if self.held_out is not None else None,
        }


@dataclass(frozen=True)
class HeldOut:
    """A share's counts on the held-out examples alone: the search chose its explanation on
    the others, so these say whether the name holds beyond the examples it was fitted to."""

    explained: int
    failing: int
    contradicted: int

    def to_json(self) -> dict[str, Any]:
        return {"explained": self.explained, "failing": self.failing, "contradicted": self.contradicted}


@dataclass(frozen=True)
class Feature:
    """A batch feature the residual's examples hold, against how often the reproduced ones do."""

    feature: str
    residual: int
    of: int
    explained: int
    explained_of: int
    description: str

    def to_json(self) -> dict[str, Any]:
        return {
            "feature": self.feature,
            "residual": self.residual,
            "of": self.of,
            "explained": self.explained,
            "explained_of": self.explained_of,
            "description": self.description,
        }


@dataclass(frozen=True)
class ResidualExample:
    """The smallest example of a residual: its batch, its first difference and its replay."""

    batch: Batch
    difference: str
    replay: str | None

    def to_json(self) -> dict[str, Any]:
        return {"batch": json.loads(self.batch.to_json()), "difference": self.difference, "replay": self.replay}


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

    def to_json(self) -> dict[str, Any]:
        return {
            "checks": list(self.checks),
            "unexplained": self.unexplained,
            "count": self.count,
            "contradicted": self.contradicted,
            "features": [f.to_json() for f in self.features],
            "shared": list(self.shared),
            "float32_fits": self.float32_fits,
            "explanation": list(self.explanation),
            "counterexample": self.counterexample.to_json(),
        }


@dataclass(frozen=True)
class Match:
    """A deviation named, with what reproduces it. ``unobserved`` is None for a step-level
    deviation (distributed, trainer), whose effects are all observed by its step."""

    variant: str
    description: str
    source: str
    evidence: str
    checks: tuple[str, ...]
    unobserved: tuple[str, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "variant": self.variant,
            "description": self.description,
            "source": self.source,
            "evidence": self.evidence,
            "checks": list(self.checks),
        }
        if self.unobserved is not None:
            out["unobserved"] = list(self.unobserved)
        return out


@dataclass(frozen=True)
class Lead:
    """A lead for an unexplained check: the explanation's own share on ``check`` below the
    naming rule, or (``check`` None) a single deviation that agrees on some divergent examples."""

    variant: str
    description: str
    source: str
    agreed: int
    of: int
    first_difference: str
    check: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "variant": self.variant,
            "description": self.description,
            "source": self.source,
            "agreed": self.agreed,
            "of": self.of,
        }
        if self.check is not None:
            out["check"] = self.check
        out["first_difference"] = self.first_difference
        return out


@dataclass(frozen=True)
class Hint:
    """An option that would accept what some checks' failures fit."""

    checks: tuple[str, ...]
    text: str
    option: str

    def to_json(self) -> dict[str, Any]:
        return {"checks": list(self.checks), "text": self.text, "option": self.option}


@dataclass(frozen=True)
class Finding:
    """Something the run showed beside the deviations (``kind``: ``non_finite_result``)."""

    kind: str
    checks: tuple[str, ...]
    summary: str

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "checks": list(self.checks), "summary": self.summary}


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
    alternatives_reason: str | None = None  # set where a search ran on a divergent run
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
        if self.status == "not_run":
            return {
                "status": self.status,
                "examples_compared": self.examples_compared,
                "matches": [m.to_json() for m in self.matches],
                "closest": [c.to_json() for c in self.closest],
            }
        out: dict[str, Any] = {
            "status": self.status,
            "examples_compared": self.examples_compared,
            "examples_searched": self.examples_searched,
            "components": list(self.components),
            "by_check": {check: list(names) for check, names in self.by_check.items()},
            "shares": {check: share.to_json() for check, share in self.shares.items()},
            "residuals": [r.to_json() for r in self.residuals],
            "unexplained": list(self.unexplained),
            "matches": [m.to_json() for m in self.matches],
            "alternatives": [list(a) for a in self.alternatives],
            "closest": [c.to_json() for c in self.closest],
            "findings": [f.to_json() for f in self.findings],
            "hints": [h.to_json() for h in self.hints],
            "summary": self.summary,
            "padding_leak": self.padding_leak.to_json() if self.padding_leak is not None else None,
        }
        if self.alternatives_reason is not None:
            out["alternatives_reason"] = self.alternatives_reason
        return out
