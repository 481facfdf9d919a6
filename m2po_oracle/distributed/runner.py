"""The runner of a distributed implementation (``compare --topology``): a warm world of ranks.

Each example is one optimizer batch spread over the world (:mod:`.checks` judges it). The
validation is the collective fail-closed probes (:mod:`.validation`): one rank given
invalid input must make every rank refuse the step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from hypothesis import strategies as st

from m2po_oracle import strategies
from m2po_oracle.adapters import ADAPTERS
from m2po_oracle.call.loss_function import batch_strategy
from m2po_oracle.call.runner import (
    AdapterUse,
    CallHealth,
    CapturedOutput,
    CaptureFailed,
    CaptureTarget,
    RunDescription,
    RunOptions,
    TopologyUse,
    refuse_unhonoured,
)
from m2po_oracle.distributed.checks import DistributedStep, as_measurement, check_step, pad_for_cp, rank_step
from m2po_oracle.distributed.diagnosis import DESCRIPTIONS
from m2po_oracle.distributed.implementations import load_distributed_implementation
from m2po_oracle.distributed.topology import Topology
from m2po_oracle.distributed.validation import run_collective_probes
from m2po_oracle.distributed.world import RankOutcome, World, WorldError
from m2po_oracle.errors import UsageError
from m2po_oracle.judge.battery import BatteryOutcome, replay_command
from m2po_oracle.judge.checks import DISTRIBUTED_CHECKS
from m2po_oracle.judge.contract import rounded_batch
from m2po_oracle.judge.equivalence import Mismatch
from m2po_oracle.judge.validation import ProbeResult
from m2po_oracle.oracle.batch import Batch

if TYPE_CHECKING:
    from m2po_oracle.adapters.families import Adapter

#: The device each backend places its ranks on.
BACKEND_DEVICE = {"gloo": "cpu", "nccl": "cuda"}
DISTRIBUTED_HONOURS = frozenset({"dtype", "compute_dtype", "timeout", "topology", "backend", "device", "capture"})


def step_mismatches(error: WorldError, world_size: int, timeout_s: float) -> tuple[list[Mismatch], bool]:
    """(the ``call`` mismatches of a failed step, whether it timed out): a rank that raised
    is shown first with its own exception; ranks only stuck waiting for it are not blamed."""
    raised = [o for o in error.outcomes if o.error]
    if raised:
        return [
            Mismatch("call", f"{_where(o)} raised: {_last_line(cast(str, o.error))}", details=(cast(str, o.error),)) for o in raised
        ], False  # raised: error is set
    hung = [o for o in error.outcomes if o.stack]
    where = ", ".join(_where(o) for o in hung)
    return [
        Mismatch(
            "call",
            f"timeout: {where} did not finish within {timeout_s:g} s ({len(hung)} of {world_size} ranks)",
            details=tuple(o.stack or "" for o in hung),
        )
    ], True


def _where(o: RankOutcome) -> str:
    c = o.coords
    return f"rank {o.rank} (dp={c.dp}, cp={c.cp}, tp={c.tp})"


def _last_line(text: str) -> str:
    lines = [line for line in text.rstrip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no message)"


class DistributedRunner:
    """Distributed steps of one implementation spec in a warm :class:`World`."""

    checks = ("call", *DISTRIBUTED_CHECKS)
    example_unit = "batches"
    costly_examples = True
    variant_descriptions = DESCRIPTIONS
    variant_source = "docs/explanation/algorithm.md §3 / production PR (distributed scope)"

    def __init__(
        self,
        spec: str,
        topology: Topology,
        *,
        backend: str = "gloo",
        timeout_s: float = 60.0,
        options: RunOptions | None = None,
        world: Any = None,
    ) -> None:
        self.options = options or RunOptions(topology=topology, backend=backend, timeout=timeout_s)

        # A distributed adapter (a port taking group=) is honoured, with its bindings; the
        # others wrap single-process signatures.
        self.adapter = ADAPTERS.get(self.options.adapter or "")
        distributed = self.adapter is not None and self.adapter.distributed
        refuse_unhonoured(
            f"a distributed run ({topology})",
            DISTRIBUTED_HONOURS | ({"adapter", "bind"} if distributed else set()),
            self.options,
            {
                "adapter": "the distributed contract takes parallel=; adapters wrap single-process signatures "
                f"(--adapter {', '.join(n for n, a in ADAPTERS.items() if a.distributed)} adapts a port taking group=)",
                "bind": "--bind shapes a distributed adapter's call (--adapter group)",
                "in_process": "every rank is a process of its own",
                "show_output": "rank output is not captured",
            },
        )
        if distributed and topology.cp > 1:
            assert self.adapter is not None  # distributed: an adapter was found
            raise UsageError(
                f"adapter {self.adapter.name}: a port taking group= computes its loss over its whole rows, but with cp={topology.cp} "
                f"a rank's share is its context-parallel shard; use cp=1 ({topology} asked), or the parallel= contract"
            )
        self._adapter_payload = (
            (cast("Adapter", self.adapter).name, tuple(self.options.bind)) if distributed else None
        )  # distributed: an adapter was found
        if "device" in self.options.given and self.options.device.split(":")[0] != BACKEND_DEVICE[backend]:
            raise UsageError(
                f"device: the {backend} backend places every rank on {BACKEND_DEVICE[backend]}, got --device {self.options.device!r}"
            )
        self.spec, self.topology = spec, topology
        self.world = world if world is not None else World(topology, backend=backend, timeout_s=timeout_s)
        self.health = CallHealth()
        self.output = CapturedOutput()
        # Last, so that a refused run leaves no directory behind; each rank makes its recorder at its first step.
        self.capture = CaptureTarget.prepare(self.options.capture) if self.options.capture else None

    def step(self, batch: Batch, *, dtype: str | None = None, capture_step: int | None = None) -> DistributedStep:
        """One optimizer batch through the world; with ``capture_step`` (and ``--capture``) every
        rank records it as that optimizer step."""
        dtype = dtype or self.options.dtype
        seen = pad_for_cp(rounded_batch(batch, dtype), self.topology.cp)
        payload = {"spec": self.spec, "batch": seen.to_dict(), "dtype": dtype, "adapter": self._adapter_payload}
        if self.capture is not None and capture_step is not None:
            # Absolute: the ranks' working directory is the forkserver's, not necessarily this process's.
            payload["capture"] = {"directory": str(self.capture.directory.resolve()), "step": capture_step}
        try:
            outcomes = self.world.run(rank_step, payload)
        except WorldError as error:
            _stop_if_capture_failed(error.outcomes)
            step = DistributedStep(seen, error.outcomes)
            mismatches, timed_out = step_mismatches(error, self.topology.world_size, self.world.timeout_s)
            self.health.timeouts += timed_out
            step.mismatches.extend(mismatches)
            return step
        _stop_if_capture_failed(outcomes)
        return check_step(seen, self.topology, outcomes, dtype, self.options.compute_dtype)

    def strategy(self) -> st.SearchStrategy[Batch]:
        # Splitting is what a distributed run adds: split-scope batches come first.
        return batch_strategy(self.options.tau, strategies.scope_first_batches())

    def run_battery(self, example: Batch) -> BatteryOutcome:
        step = self.step(example, capture_step=self.capture.next_step() if self.capture is not None else None)
        explained = tuple(v["variant"] for v in step.explained_by) if step.mismatches else None
        return BatteryOutcome(
            step.batch,
            as_measurement(step, self.options.dtype),
            tuple(step.mismatches),
            tuple(step.ranks_json()),
            explained,
            checked=checks_ran(step),
        )

    def validation(self) -> list[ProbeResult]:
        return run_collective_probes(self.world, self.spec, dtype=self.options.dtype, adapter=self._adapter_payload)

    def replay_command(self, example: Batch) -> str:
        o = self.options
        bindings = tuple(part for binding in o.bind for part in ("--bind", binding)) if self._adapter_payload else ()
        return replay_command(
            self.spec,
            example.to_json(),
            dtype=o.dtype,
            compute_dtype=o.compute_dtype,
            adapter=self._adapter_payload[0] if self._adapter_payload else None,
            extra=("--topology", str(self.topology), "--backend", self.world.backend, *bindings),
        )

    def parse_example(self, data: dict[str, Any]) -> Batch:
        return Batch.from_dict(data)

    def example_key(self) -> str:
        return "batch"

    def describe(self) -> RunDescription:
        t = self.topology
        adapter = None
        if self._adapter_payload:
            a, bindings = self.adapter, self.options.bind
            assert a is not None  # an adapter payload is made from an adapter only
            call = load_distributed_implementation(
                self.spec, self._adapter_payload
            ).bound_call.describe_call()  # loaded (and cached) by open_runner
            adapter = AdapterUse(
                a.name,
                a.signature,
                tuple(a.checked),
                tuple(sorted(a.supplies_with(bindings))),
                dict(a.builds),
                a.not_run(bindings),
                tuple(bindings),
                call,
            )
        return RunDescription(
            adapter=adapter,
            topology=TopologyUse(t.dp, t.cp, t.tp, self.world.backend),
            capture=self.capture.use() if self.capture is not None else None,
        )

    def start(self) -> None:
        self.world.start()

    def close(self) -> None:
        self.world.close()

    def __enter__(self) -> DistributedRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stop_if_capture_failed(outcomes: list[RankOutcome]) -> None:
    """:class:`CaptureFailed` naming every rank whose recording failed (none: nothing happens)."""
    failed = [o.value["capture_error"] for o in outcomes if isinstance(o.value, dict) and o.value.get("capture_error")]
    if failed:
        raise CaptureFailed(f"capture: {'; '.join(failed)}")


def checks_ran(step: DistributedStep) -> tuple[str, ...]:
    """The checks a step ran: only ``call`` when a rank failed; ``distributed.metrics`` only
    when some rank reports a metric."""
    if step.result is None:
        return ("call",)
    reported = any((o.value or {}).get("result") is not None and (o.value["result"].reported()) for o in step.outcomes)
    single = any("single" in (o.value or {}) for o in step.outcomes)  # torchrun ranks and this world alike compute it on rank 0
    skipped = {"distributed.metrics": not reported, "distributed.split_invariance": not single}
    return ("call", *(n for n in DISTRIBUTED_CHECKS if not skipped.get(n, False)))
