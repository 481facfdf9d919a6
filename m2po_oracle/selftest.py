"""``m2po-oracle selftest``: the battery against every shipped negative control.

A control passes the self-test when ``compare`` finds it divergent (it is caught) and the
diagnosis names the control's own deviation among the variants that reproduce it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from m2po_oracle.compare import run_compare
from m2po_oracle.controls import NEGATIVE_CONTROLS, NegativeControl


@dataclass(frozen=True)
class SelftestRow:
    control: str
    bug: str
    caught_by: tuple[str, ...]
    examples_needed: int | None  # number of the first example on which any check failed
    diagnosis: tuple[str, ...]
    seconds: float

    @property
    def caught(self) -> bool:
        return bool(self.caught_by)

    @property
    def diagnosed(self) -> bool:
        return self.control in self.diagnosis

    @property
    def status(self) -> str:
        if not self.caught:
            return "ESCAPED"
        return "ok" if self.diagnosed else "MISDIAGNOSED"


def select_controls(names: list[str] | None) -> list[NegativeControl]:
    if not names:
        return list(NEGATIVE_CONTROLS)
    known = {c.name: c for c in NEGATIVE_CONTROLS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"only: unknown control(s) {unknown}; known: {', '.join(known)}")
    return [known[n] for n in names]


def run_selftest(controls: list[NegativeControl], *, examples: int = 500, seed: int = 0,
                 on_row: Callable[[SelftestRow], None] | None = None) -> list[SelftestRow]:
    rows = []
    for control in controls:
        started = time.perf_counter()
        report = run_compare(control.fn, f"control:{control.name}", examples=examples, seed=seed)
        failing = [t for t in report.tallies.values() if t.failures]
        row = SelftestRow(
            control=control.name,
            bug=control.bug,
            caught_by=tuple(t.name for t in failing),
            examples_needed=min((t.first_failure_at for t in failing if t.first_failure_at), default=None),
            diagnosis=tuple(m["variant"] for m in report.diagnosis.get("matches", [])),
            seconds=time.perf_counter() - started,
        )
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows
