"""A warm world of ranks on gloo (CPU) or NCCL (GPU), for distributed checks.

:class:`World` starts ``dp x cp x tp`` rank processes once (forkserver with torch
preloaded, FileStore rendezvous in a temp dir: no fixed ports), builds the Megatron-order
groups of every kind in each rank, then serves requests: every rank runs
``handler(ctx, payload)`` and the parent gets every rank's value. A rank that raises, or
a request that does not finish within the deadline, tears the world down: the error
names every failed rank with its traceback, or the live ranks' stacks, and no process is
left behind. Collectives are counted per rank (calls and bytes).
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

from m2po_oracle.distributed.topology import GROUP_KINDS, RankCoords, Topology

BACKENDS = ("gloo", "nccl")
_context: Any = None


def _forkserver() -> Any:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(["torch", "torch.distributed", "numpy", "m2po_oracle.distributed.world", "m2po_oracle.core.loss"])
    return _context


@dataclass
class CollectiveCounter:
    """Calls and bytes sent per collective kind, counted by wrapping torch.distributed."""

    calls: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {name: {"calls": self.calls[name], "bytes": self.bytes[name]} for name in sorted(self.calls)}

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """Collectives of the block are not counted (the harness's own reference calls)."""
        calls, sent = Counter(self.calls), Counter(self.bytes)
        try:
            yield
        finally:
            self.calls, self.bytes = calls, sent


_COUNTED = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "all_to_all_single",
    "all_gather_object",
    "broadcast_object_list",
)


def _install_counter(counter: CollectiveCounter) -> None:
    import torch
    import torch.distributed as dist

    def size_of(value: Any) -> int:
        if isinstance(value, torch.Tensor):
            return value.numel() * value.element_size()
        if isinstance(value, (list, tuple)):
            return sum(size_of(v) for v in value)
        return 0

    for name in _COUNTED:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counted(*args: Any, _original: Callable = original, _name: str = name, **kwargs: Any) -> Any:
            counter.calls[_name] += 1
            # Bytes this rank contributes: the input tensor of the collective.
            sent = (
                args[1]
                if _name in ("all_gather", "all_gather_into_tensor", "all_to_all_single") and len(args) > 1
                else (args[0] if args else None)
            )
            counter.bytes[_name] += size_of(sent)
            return _original(*args, **kwargs)

        setattr(dist, name, counted)


@dataclass
class RankContext:
    """What a handler gets in its rank."""

    rank: int
    topology: Topology
    coords: RankCoords
    groups: dict[str, Any]  # kind -> this rank's ProcessGroup of that kind
    backend: str
    device: str
    counter: CollectiveCounter


def make_context(rank: int, topology: Topology, backend: str, device: str) -> RankContext:
    """Build every Megatron-order group (collectively: all ranks must call this) and install
    the collective counter, in an initialised process group."""
    import torch.distributed as dist

    groups: dict[str, Any] = {}
    for kind in GROUP_KINDS:  # every rank creates every group, in the same order
        for ranks in topology.groups(kind):
            group = dist.new_group(ranks)
            if rank in ranks:
                groups[kind] = group
    for other in range(topology.world_size):  # one-rank groups: the same step as one rank (dp=1), for the split-invariance check
        group = dist.new_group([other])
        if other == rank:
            groups["self"] = group
    counter = CollectiveCounter()
    _install_counter(counter)
    return RankContext(rank, topology, topology.coords(rank), groups, backend, device, counter)


def _rank_main(rank: int, topology: Topology, backend: str, store_path: str, stack_path: str, connection: Any, timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # ranks share two cores: oversubscription makes gloo crawl
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it closes the world
    with open(stack_path, "w") as stack_file:
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
        try:
            store = dist.FileStore(store_path, topology.world_size)
            device = "cpu"
            if backend == "nccl":
                device = f"cuda:{rank % torch.cuda.device_count()}"
                torch.cuda.set_device(device)
            dist.init_process_group(backend, store=store, rank=rank, world_size=topology.world_size, timeout=timedelta(seconds=timeout_s))
            context = make_context(rank, topology, backend, device)
            counter = context.counter
            connection.send(("ready", None))
        except BaseException:
            connection.send(("error", traceback.format_exc()))
            return
        while True:
            try:
                request = connection.recv()
            except EOFError:
                break
            if request is None:
                break
            handler, payload = request
            counter.reset()
            try:
                connection.send(("ok", (handler(context, payload), counter.snapshot())))
            except BaseException:
                connection.send(("error", traceback.format_exc()))
        try:
            dist.destroy_process_group()
        except Exception:
            pass


@dataclass(frozen=True)
class RankOutcome:
    rank: int
    coords: RankCoords
    value: Any = None
    collectives: dict[str, dict[str, int]] = field(default_factory=dict)
    error: str | None = None  # traceback of a rank that raised
    stack: str | None = None  # stack dump of a rank still running at the deadline


class WorldError(RuntimeError):
    """A request failed on some ranks; ``outcomes`` holds every rank's error or stack."""

    def __init__(self, message: str, outcomes: list[RankOutcome]) -> None:
        super().__init__(message)
        self.outcomes = outcomes


class World:
    """``dp x cp x tp`` ranks kept warm across requests."""

    def __init__(self, topology: Topology, *, backend: str = "gloo", timeout_s: float = 60.0) -> None:
        if not isinstance(topology, Topology):
            raise ValueError(f"topology: expected a Topology, got {type(topology).__name__}")
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s: expected a number of seconds > 0, got {timeout_s!r}")
        self.topology, self.backend, self.timeout_s = topology, backend, float(timeout_s)
        self._processes: list[Any] = []
        self._connections: list[Any] = []
        self._directory: str | None = None

    @property
    def started(self) -> bool:
        return bool(self._processes)

    def start(self) -> None:
        context = _forkserver()
        self._directory = tempfile.mkdtemp(prefix="m2po-world-")
        store = os.path.join(self._directory, "store")
        for rank in range(self.topology.world_size):
            parent, child = context.Pipe()
            process = context.Process(
                target=_rank_main,
                name=f"m2po-rank:{rank}",
                daemon=True,
                args=(rank, self.topology, self.backend, store, self._stack_path(rank), child, self.timeout_s),
            )
            process.start()
            child.close()
            self._processes.append(process)
            self._connections.append(parent)
        replies = self._collect("start")
        failed = [r for r in replies if r.error or r.stack]
        if failed:
            self.close()
            raise WorldError(_describe("starting the world", failed, self.topology), replies)

    def run(self, handler: Callable[[RankContext, Any], Any], payload: Any = None) -> list[RankOutcome]:
        """Run ``handler(ctx, payload)`` on every rank (a module-level function)."""
        if not self.started:
            self.start()
        for connection in self._connections:
            connection.send((handler, payload))
        outcomes = self._collect(getattr(handler, "__name__", "request"))
        # The ranks that raised come first: the others are usually only stuck waiting for them.
        failed = sorted((o for o in outcomes if o.error or o.stack), key=lambda o: (o.error is None, o.rank))
        if failed:
            self.close()  # a rank that failed mid-collective leaves the others stuck
            raise WorldError(_describe(f"running {getattr(handler, '__name__', handler)!r}", failed, self.topology), outcomes)
        return outcomes

    def _collect(self, what: str) -> list[RankOutcome]:
        deadline = time.monotonic() + self.timeout_s
        replies: dict[int, tuple[str, Any]] = {}
        pending = dict(enumerate(self._connections))
        first_error_at: float | None = None
        while pending:
            now = time.monotonic()
            # After one rank fails, its peers are usually stuck in a collective: give them a
            # short grace to report their own errors, not the full deadline.
            limit = min(deadline, first_error_at + 3.0) if first_error_at else deadline
            if now >= limit:
                break
            ready = cast(
                "list[multiprocessing.connection.Connection]", multiprocessing.connection.wait(list(pending.values()), timeout=limit - now)
            )  # of the Connections given
            for connection in ready:
                rank = next(r for r, c in pending.items() if c is connection)
                try:
                    replies[rank] = connection.recv()
                except (EOFError, OSError):
                    code = self._processes[rank].exitcode
                    replies[rank] = ("error", f"rank {rank} died (exit code {code}) during {what}")
                del pending[rank]
                if replies[rank][0] == "error" and first_error_at is None:
                    first_error_at = time.monotonic()
        for rank in pending:  # still running: ask for a stack dump before killing
            process = self._processes[rank]
            if process.is_alive() and process.pid:
                os.kill(process.pid, signal.SIGUSR1)
        if pending:
            time.sleep(0.5)
        outcomes = []
        for rank in range(self.topology.world_size):
            coords = self.topology.coords(rank)
            if rank in pending:
                stack = Path(self._stack_path(rank)).read_text() if Path(self._stack_path(rank)).exists() else ""
                outcomes.append(
                    RankOutcome(
                        rank,
                        coords,
                        stack=stack or f"rank {rank}: no stack dump (process {'alive' if self._processes[rank].is_alive() else 'dead'})",
                    )
                )
                continue
            kind, value = replies[rank]
            if kind == "error":
                outcomes.append(RankOutcome(rank, coords, error=value))
            elif kind == "ready":
                outcomes.append(RankOutcome(rank, coords))
            else:
                outcomes.append(RankOutcome(rank, coords, value=value[0], collectives=value[1]))
        return outcomes

    def _stack_path(self, rank: int) -> str:
        assert self._directory is not None
        return os.path.join(self._directory, f"stack-{rank}.txt")

    def close(self) -> None:
        for connection in self._connections:
            try:
                connection.send(None)
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 3.0
        for process in self._processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self._processes:
            if process.is_alive():
                process.kill()
                process.join(5)
        self._processes, self._connections = [], []
        if self._directory:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _describe(what: str, failed: list[RankOutcome], topology: Topology) -> str:
    lines = [f"{what} failed on {len(failed)} of {topology.world_size} ranks ({topology}):"]
    for outcome in failed:
        c = outcome.coords
        where = f"rank {outcome.rank} (dp={c.dp}, cp={c.cp}, tp={c.tp})"
        if outcome.error:
            lines.append(f"--- {where} raised:\n{outcome.error.rstrip()}")
        else:
            lines.append(f"--- {where} did not finish in time; its stack:\n{(outcome.stack or '').rstrip()}")
    return "\n".join(lines)


# --- handlers used by the harness's own checks (must be importable module-level functions) ---


def smoke(ctx: RankContext, payload: Any) -> dict[str, Any]:
    """all_reduce(rank + 1) over the world and every group kind: the values prove the groups."""
    import torch
    import torch.distributed as dist

    out: dict[str, Any] = {}
    for kind in (None, *GROUP_KINDS):
        value = torch.tensor([float(ctx.rank + 1)], device=ctx.device)
        dist.all_reduce(value, group=ctx.groups.get(kind) if kind else None)
        out[kind or "world"] = float(value.item())
    return out


def fail_on(ctx: RankContext, payload: Any) -> None:
    """Test handler: ``payload = {"raise": [ranks], "hang": [ranks]}``; the others all-reduce."""
    import torch
    import torch.distributed as dist

    if ctx.rank in payload.get("raise", ()):
        raise RuntimeError(f"planted failure on rank {ctx.rank}")
    if ctx.rank in payload.get("hang", ()):
        time.sleep(3600)
    dist.all_reduce(torch.ones(1), group=None)
