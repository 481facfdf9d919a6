"""The runner of a loss function: called in this process or in an isolated worker.

Both ways run the same single-process battery (:data:`m2po_oracle.judge.checks.CHECKS`) on
generated batches and the eight invalid-input probes; they differ only in how a call is
made (:mod:`m2po_oracle.call.isolation`), and so in which options they honour.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from hypothesis import strategies as st

from m2po_oracle import strategies
from m2po_oracle.adapters import ADAPTERS
from m2po_oracle.call.isolation import InProcess, Isolated
from m2po_oracle.call.runner import (
    CAPTURE_NEEDS_A_STEP,
    AdapterUse,
    CallHealth,
    CapturedOutput,
    RunDescription,
    RunOptions,
    refuse_unhonoured,
)
from m2po_oracle.judge.battery import BatteryOutcome, replay_command, run_battery
from m2po_oracle.judge.checks import CHECKS
from m2po_oracle.judge.validation import PROBES, ProbeResult
from m2po_oracle.oracle.batch import Batch

#: What both ways honour; the worker adds the per-call timeout and output pass-through.
_HONOURED = frozenset({"dtype", "compute_dtype", "device", "adapter", "bind", "validation_errors"})
IN_PROCESS_HONOURS = _HONOURED | {"in_process", "show_output"}
ISOLATED_HONOURS = _HONOURED | {"timeout", "show_output"}


def batch_strategy(tau: float | None, base: st.SearchStrategy[Batch] | None = None) -> st.SearchStrategy[Batch]:
    """``base`` (default: the default mix of generated batches), with every budget set to ``tau`` if given."""
    base = base if base is not None else strategies.batches()
    if tau is None:
        return base
    return base.map(lambda b: strategies.with_family(Batch(b.logp, b.behavior_logp, b.advantages, b.valid, tau), strategies.family_of(b)))


class LossFunctionRunner:
    """A loss function under the contract, called through ``caller`` (in-process or isolated)."""

    checks = tuple(CHECKS)
    example_unit = "batches"
    costly_examples = False
    variant_descriptions: ClassVar[dict[str, str]] = {}
    variant_source = ""

    def __init__(self, spec: str, caller: InProcess | Isolated, options: RunOptions, *, call: str | None = None) -> None:
        """``call``: the call an adapter makes of the port (``BoundCall.describe_call``), for the report."""
        self.spec, self.caller, self.options = spec, caller, options
        self.call = call
        self.output = CapturedOutput()
        self.isolated = isinstance(caller, Isolated)
        refuse_unhonoured(
            "a loss function run in a worker" if self.isolated else "a loss function run in this process (--in-process)",
            ISOLATED_HONOURS if self.isolated else IN_PROCESS_HONOURS,
            options,
            {
                "timeout": "no timeout can stop a call in this process; drop --in-process",
                "in_process": "--in-process and a worker exclude each other",
                "capture": CAPTURE_NEEDS_A_STEP,
            },
        )

    @property
    def health(self) -> CallHealth:
        return CallHealth(self.caller.timeouts, self.caller.crashes)

    def strategy(self) -> st.SearchStrategy[Batch]:
        return batch_strategy(self.options.tau)

    def run_battery(self, example: Batch) -> BatteryOutcome:
        o = self.options
        outcome = run_battery(self.caller, example, dtype=o.dtype, compute_dtype=o.compute_dtype, device=o.device)
        self.output.add(outcome.measurement.output, outcome.measurement.output_lines)
        return self._within_adapter(outcome)

    def _not_run(self) -> dict[str, str]:
        """The checks the adapter cannot run (a field it builds itself, a property its own
        construction decides), each with why; empty without an adapter."""
        if not self.options.adapter:
            return {}

        return ADAPTERS[self.options.adapter].not_run(self.options.bind)

    def _within_adapter(self, outcome: BatteryOutcome) -> BatteryOutcome:
        # A check on what the adapter built would judge the adapter, not the port: it is
        # "not run" (dropped from what ran and from the mismatches), never "pass".
        skipped = self._not_run()
        if not skipped:
            return outcome
        return dataclasses.replace(
            outcome,
            checked=tuple(c for c in outcome.checked if c not in skipped),
            mismatches=tuple(m for m in outcome.mismatches if m.check not in skipped),
        )

    def validation(self) -> list[ProbeResult]:
        return [self.caller.probe(p.name, dtype=self.options.dtype, device=self.options.device) for p in PROBES]

    def replay_command(self, example: Batch) -> str:
        o = self.options
        bindings = tuple(part for binding in o.bind for part in ("--bind", binding))  # the replay makes the same call of the port
        return replay_command(self.spec, example.to_json(), dtype=o.dtype, compute_dtype=o.compute_dtype, adapter=o.adapter, extra=bindings)

    def parse_example(self, data: dict[str, Any]) -> Batch:
        return Batch.from_dict(data)

    def example_key(self) -> str:
        return "batch"

    def describe(self) -> RunDescription:
        if not self.options.adapter:
            return RunDescription()

        adapter = ADAPTERS[self.options.adapter]
        bindings = self.options.bind
        return RunDescription(
            adapter=AdapterUse(
                adapter.name,
                adapter.signature,
                tuple(adapter.checked),
                tuple(sorted(adapter.supplies_with(bindings))),
                dict(adapter.builds),
                self._not_run(),
                tuple(bindings),
                self.call,
            )
        )

    def start(self) -> None:
        if self.isolated:
            assert isinstance(self.caller, Isolated)  # what self.isolated records
            self.caller.start()

    def close(self) -> None:
        if self.isolated:
            assert isinstance(self.caller, Isolated)  # what self.isolated records
            self.caller.close()

    def __enter__(self) -> LossFunctionRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
