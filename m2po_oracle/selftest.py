"""``m2po-oracle selftest``: the battery against every shipped negative control.

A control passes the self-test when ``compare`` finds it divergent (it is caught) and the
diagnosis names the control's own deviation among the variants that reproduce it. With
``trainer=True`` the trainer-level controls (``trainer:NAME``) are run too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from m2po_oracle.compare import run_compare
from m2po_oracle.controls import NEGATIVE_CONTROLS


@dataclass(frozen=True)
class SelftestTarget:
    """One planted bug: the name its row carries, what it plants, the variant the diagnosis
    must name, and how to get the implementation (a loss function or a step runner)."""

    name: str
    bug: str
    variant: str
    load: Callable[[], Any]
    shrink: bool = True  # a trainer step is costly; catching and naming need no minimal case


@dataclass(frozen=True)
class SelftestRow:
    control: str
    bug: str
    caught_by: tuple[str, ...]
    examples_needed: int | None  # number of the first example on which any check failed
    diagnosis: tuple[str, ...]
    seconds: float
    variant: str = ""  # the variant the diagnosis must name (default: the control's name)

    @property
    def caught(self) -> bool:
        return bool(self.caught_by)

    @property
    def diagnosed(self) -> bool:
        return (self.variant or self.control) in self.diagnosis

    @property
    def status(self) -> str:
        if not self.caught:
            return "ESCAPED"
        return "ok" if self.diagnosed else "MISDIAGNOSED"


def _trainer_targets() -> list[SelftestTarget]:
    from m2po_oracle.trainer.controls import TRAINER_CONTROLS
    from m2po_oracle.trainer.runner import TrainerRunner

    return [SelftestTarget(f"trainer:{c.name}", c.description, c.variant, lambda c=c: TrainerRunner(c.name), shrink=False) for c in TRAINER_CONTROLS]


def select_controls(names: list[str] | None, *, trainer: bool = False) -> list[SelftestTarget]:
    """The loss-function controls (and with ``trainer`` the trainer's), or those named."""
    targets = [SelftestTarget(c.name, c.bug, c.name, lambda c=c: c.fn) for c in NEGATIVE_CONTROLS]
    if trainer or any(n.startswith("trainer:") for n in names or ()):
        targets += _trainer_targets()
    if not names:
        return [t for t in targets if trainer or not t.name.startswith("trainer:")]
    known = {t.name: t for t in targets}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"only: unknown control(s) {unknown}; known: {', '.join(known)}")
    return [known[n] for n in names]


def run_selftest(controls: list[SelftestTarget], *, examples: int = 500, seed: int = 0,
                 on_row: Callable[[SelftestRow], None] | None = None) -> list[SelftestRow]:
    rows = []
    for control in controls:
        started = time.perf_counter()
        spec = control.name if control.name.startswith("trainer:") else f"control:{control.name}"
        report = run_compare(control.load(), spec, examples=examples, seed=seed, shrink=control.shrink)
        failing = [t for t in report.tallies.values() if t.failures]
        row = SelftestRow(
            control=control.name,
            bug=control.bug,
            caught_by=tuple(t.name for t in failing),
            examples_needed=min((t.first_failure_at for t in failing if t.first_failure_at), default=None),
            diagnosis=tuple(m["variant"] for m in report.diagnosis.get("matches", [])),
            seconds=time.perf_counter() - started,
            variant=control.variant,
        )
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows
