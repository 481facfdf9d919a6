"""``m2po-oracle selftest``: the battery against every shipped negative control.

A control passes the self-test when ``compare`` finds it divergent (it is caught) and the
diagnosis names the control's own deviation among the variants that reproduce it. With
``trainer=True`` the trainer-level controls (``trainer:NAME``) are run too, with
``distributed=True`` the distributed ones (``distributed:control:NAME``, each on the
topology it shows on). With ``seeds > 1`` each control is also run on seeds 1..seeds-1
until its first failing example: how soon the battery catches it, over seeds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypedDict

from m2po_oracle.call.controls import (
    COMPOSITE_CONTROLS,
    NEGATIVE_CONTROLS,
    QUICK_EXAMPLES,
)
from m2po_oracle.call.runner import Runner
from m2po_oracle.compare.search import in_process_runner, run_compare
from m2po_oracle.distributed.diagnosis import DESCRIPTIONS
from m2po_oracle.distributed.implementations import CONTROL_TOPOLOGIES
from m2po_oracle.distributed.runner import DistributedRunner
from m2po_oracle.distributed.topology import Topology
from m2po_oracle.trainer.controls import TRAINER_CONTROLS
from m2po_oracle.trainer.runner import TrainerRunner


@dataclass(frozen=True)
class SelftestTarget:
    """One planted bug: the name its row carries, what it plants, the variant the diagnosis
    must name, and how to get the implementation (a loss function or a step runner)."""

    name: str
    bug: str
    variant: str  # the deviations the diagnosis must name, exactly ("a + b" for several)
    load: Callable[[], Runner]
    shrink: bool = True  # a trainer step is costly; catching and naming need no minimal case
    quick_examples: int | None = None  # enough to catch and name it on seeds 0-9 (controls.QUICK_EXAMPLES)


@dataclass(frozen=True)
class SelftestRow:
    control: str
    bug: str
    caught_by: tuple[str, ...]
    examples_needed: int | None  # number of the first example on which any check failed
    diagnosis: tuple[str, ...]
    seconds: float
    variant: str = ""  # the deviations the diagnosis must name, "a + b" (default: the control's name)
    first_failures: tuple[int | None, ...] = ()  # per seed: the first failing example (None: not caught)
    alternatives: tuple[tuple[str, ...], ...] = ()  # explanations as small as ``diagnosis``
    unexplained: tuple[str, ...] = ()
    partly_explained: tuple[str, ...] = ()  # failing checks the explanation reproduces on only some examples

    @property
    def caught(self) -> bool:
        return bool(self.caught_by)

    @property
    def diagnosed(self) -> bool:
        """Exactly the planted deviations (or an explanation the examples cannot tell from
        them), and every failing check explained on every failing example: a planted deviation
        is all there is, so a residual means the diagnosis's account of it is wrong somewhere."""
        expected = set((self.variant or self.control).split(" + "))
        return (
            not self.unexplained
            and not self.partly_explained
            and any(expected == set(names) for names in (self.diagnosis, *self.alternatives))
        )

    @property
    def status(self) -> str:
        if not self.caught:
            return "ESCAPED"
        return "ok" if self.diagnosed else "MISDIAGNOSED"


def _distributed_targets() -> list[SelftestTarget]:
    return [
        SelftestTarget(
            f"distributed:{spec}",
            DESCRIPTIONS[spec.split(":", 1)[1]],
            spec.split(":", 1)[1],
            # mypy cannot type a lambda with defaulted parameters as Callable[[], Runner]
            lambda spec=spec, topology=topology: DistributedRunner(spec, Topology.parse(topology)),  # type: ignore[misc]
            shrink=False,
        )
        for spec, topology in CONTROL_TOPOLOGIES.items()
    ]


def _trainer_targets() -> list[SelftestTarget]:
    return [
        # mypy cannot type a lambda with defaulted parameters as Callable[[], Runner]
        SelftestTarget(f"trainer:{c.name}", c.description, c.variant, lambda c=c: TrainerRunner(c.name), shrink=False)  # type: ignore[misc]
        for c in TRAINER_CONTROLS
    ]


def select_controls(names: list[str] | None, *, trainer: bool = False, distributed: bool = False) -> list[SelftestTarget]:
    """The loss-function controls (and with ``trainer`` / ``distributed`` those too), or those named."""
    targets = [
        SelftestTarget(
            c.name,
            c.bug,
            " + ".join(c.variants),
            lambda c=c: in_process_runner(c.fn, f"control:{c.name}", adapter=c.adapter),  # type: ignore[misc]  # mypy cannot type a lambda with defaulted parameters as Callable[[], Runner]
            quick_examples=QUICK_EXAMPLES.get(c.name),
        )
        for c in NEGATIVE_CONTROLS + COMPOSITE_CONTROLS
    ]
    if trainer or any(n.startswith("trainer:") for n in names or ()):
        targets += _trainer_targets()
    if distributed or any(n.startswith("distributed:") for n in names or ()):
        targets += _distributed_targets()
    if not names:
        return [
            t for t in targets if (trainer or not t.name.startswith("trainer:")) and (distributed or not t.name.startswith("distributed:"))
        ]
    known = {t.name: t for t in targets}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"only: unknown control(s) {unknown}; known: {', '.join(known)}")
    return [known[n] for n in names]


def _spec(control: SelftestTarget) -> str:
    if control.name.startswith("trainer:"):
        return control.name
    if control.name.startswith("distributed:"):
        return control.name.split(":", 1)[1]
    return f"control:{control.name}"


def _open(control: SelftestTarget) -> Runner:
    runner = control.load()
    runner.start()  # a world is started once for every seed, and closed after
    return runner


class _Settings(TypedDict):
    """The keyword arguments of :func:`_row`, as :func:`run_selftest` sends them to a worker."""

    examples: int
    seed: int
    seeds: int
    shrink: bool
    quick: bool


def run_selftest(
    controls: list[SelftestTarget],
    *,
    examples: int = 500,
    seed: int = 0,
    seeds: int = 1,
    on_row: Callable[[SelftestRow], None] | None = None,
    shrink: bool = True,
    quick: bool = False,
    jobs: int = 1,
) -> list[SelftestRow]:
    """``shrink=False`` skips the minimal counterexamples (catching and naming need none);
    ``quick`` runs each control at its ``quick_examples`` (else ``examples``), unshrunk.
    ``jobs`` > 1 runs the controls in that many fresh processes at once (rows still in the
    controls' order), except where a distributed control is among them: its gloo worlds
    run one at a time."""
    settings: _Settings = {"examples": examples, "seed": seed, "seeds": seeds, "shrink": shrink, "quick": quick}
    if jobs > 1 and len(controls) > 1 and not any(c.name.startswith("distributed:") for c in controls):
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # Fresh interpreters: a fork of a process whose torch thread pools have run can hang.
        with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(_row_of, control.name, settings) for control in controls]
            rows = []
            for future in futures:
                rows.append(future.result())
                if on_row is not None:
                    on_row(rows[-1])
            return rows
    rows = []
    for control in controls:
        rows.append(_row(control, **settings))
        if on_row is not None:
            on_row(rows[-1])
    return rows


def _row_of(name: str, settings: _Settings) -> SelftestRow:
    """One control's row, by name (what a worker process is sent)."""
    (control,) = select_controls([name])
    return _row(control, **settings)


def _row(control: SelftestTarget, *, examples: int, seed: int, seeds: int, shrink: bool, quick: bool) -> SelftestRow:
    started = time.perf_counter()
    runner = _open(control)
    try:
        count = (control.quick_examples or examples) if quick else examples
        report = run_compare(runner, _spec(control), examples=count, seed=seed, shrink=control.shrink and shrink and not quick)
        failing = [t for t in report.tallies.values() if t.failures]
        first = min((t.first_failure_at for t in failing if t.first_failure_at), default=None)
        later = [_first_failure(runner, control, count, seed + k) for k in range(1, seeds)]
    finally:
        runner.close()
    return SelftestRow(
        control=control.name,
        bug=control.bug,
        caught_by=tuple(t.name for t in failing),
        examples_needed=first,
        diagnosis=report.diagnosis.components,
        alternatives=report.diagnosis.alternatives,
        unexplained=report.diagnosis.unexplained,
        partly_explained=report.diagnosis.partly(),
        seconds=time.perf_counter() - started,
        variant=control.variant,
        first_failures=(first, *later),
    )


def _first_failure(runner: Any, control: SelftestTarget, examples: int, seed: int) -> int | None:
    report = run_compare(runner, _spec(control), examples=examples, seed=seed, shrink=False, until_first_failure=True)
    return min((t.first_failure_at for t in report.tallies.values() if t.first_failure_at), default=None)


def spread(first_failures: tuple[int | None, ...]) -> str:
    """ "min / median / max" of the first failing example over seeds ("-" for a seed that escaped)."""
    import statistics

    caught = [n for n in first_failures if n is not None]
    escaped = len(first_failures) - len(caught)
    if not caught:
        return "-"
    text = f"{min(caught)} / {statistics.median(caught):g} / {max(caught)}"
    return text + (f" ({escaped} seed(s) escaped)" if escaped else "")
