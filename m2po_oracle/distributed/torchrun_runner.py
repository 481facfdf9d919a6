"""The runner under torchrun: rank 0 drives ``compare``; every rank serves its requests.

Each request (a step, a collective probe) is broadcast from rank 0, run in every rank and
gathered back on rank 0, so the checks, validation and replay are a
:class:`~m2po_oracle.distributed.runner.DistributedRunner`'s over torchrun's process group.
"""

from __future__ import annotations

from typing import Any

from m2po_oracle.call.runner import RunOptions
from m2po_oracle.distributed.runner import DistributedRunner
from m2po_oracle.distributed.world import RankOutcome, WorldError


class TorchrunRunner(DistributedRunner):
    """On rank 0: one step = broadcast the request, run this rank's share, gather every rank's.

    The same checks, validation and replay as a :class:`DistributedRunner`; the ranks are
    torchrun's processes instead of a world this tool starts."""

    world: _TorchrunWorld  # always: the world given to DistributedRunner

    def __init__(self, context: Any, spec: str, options: RunOptions) -> None:
        self.context = context
        super().__init__(
            spec, context.topology, backend=context.backend, timeout_s=options.timeout, options=options, world=_TorchrunWorld(context)
        )


class _TorchrunWorld:
    """The world interface (``run``, ``start``, ``close``) over torchrun's process group."""

    def __init__(self, context: Any) -> None:
        self.context, self.backend, self.topology = context, context.backend, context.topology
        self.timeout_s = float("inf")  # the backend's collective timeout ends a hung job

    def run(self, handler: Any, payload: Any) -> list[Any]:
        outcomes = serve(self.context, (handler, payload))
        assert outcomes is not None  # None answers the stop request only
        failed = sorted((o for o in outcomes if o.error), key=lambda o: o.rank)
        if failed:
            raise WorldError(f"running {getattr(handler, '__name__', handler)!r} failed on {len(failed)} ranks", outcomes)
        return outcomes

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    def stop(self) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list([None], src=0)


def serve(context: Any, request: Any) -> list[Any] | None:
    """Every rank: receive a request from rank 0, run it, gather the values on rank 0."""
    import traceback

    import torch.distributed as dist

    box = [request]
    dist.broadcast_object_list(box, src=0)
    if box[0] is None:
        return None
    handler, payload = box[0]
    context.counter.reset()
    value, error = None, None
    try:
        value = handler(context, payload)
    except Exception:
        error = traceback.format_exc()
    collectives = context.counter.snapshot()
    gathered: list[Any] | None = [None] * context.topology.world_size if context.rank == 0 else None
    dist.gather_object((value, collectives, error), gathered, dst=0)
    if context.rank != 0:
        return []
    assert gathered is not None  # rank 0 gathers
    return [RankOutcome(r, context.topology.coords(r), v, c, error=e) for r, (v, c, e) in enumerate(gathered)]
