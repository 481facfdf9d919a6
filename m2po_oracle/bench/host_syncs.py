"""Operators that would stall a GPU stream, counted on any device (CPU included).

A CUDA operator whose output size or value must reach the host (``nonzero``, ``.item()``,
boolean indexing, ...) makes the host wait for every kernel queued before it. On CPU
nothing waits, but the same operators are dispatched, so a ``TorchDispatchMode`` that
counts them measures on CPU what a GPU step would stall on, and a test can hold a budget.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: Operators that read a device value or a data-dependent size on the host. ``nonzero_static``
#: is absent: its size is given, so it needs no read.
WOULD_SYNC = frozenset(
    {
        "aten::_local_scalar_dense",  # .item(), int(t), float(t), bool(t)
        "aten::nonzero",
        "aten::masked_select",
        "aten::unique",
        "aten::_unique",
        "aten::_unique2",
        "aten::unique_consecutive",
        "aten::unique_dim",
        "aten::repeat_interleave",
        "aten::bincount",
        "aten::histc",
        "aten::masked_scatter",
        "aten::_assert_async",
        "aten::equal",
        "aten::allclose",
        "aten::is_nonzero",
    }
)
#: Indexing operators that sync when an index is boolean (its True count is the output size).
_INDEXING = frozenset({"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"})


def _boolean_index(args: tuple[Any, ...]) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return isinstance(indices, (list, tuple)) and any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


def _device_to_host(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """A copy from an accelerator to the CPU (``.cpu()``, ``.tolist()`` of a CUDA tensor)."""
    name = func._schema.name
    if name == "aten::_to_copy":
        source, target = args[0], kwargs.get("device")
        return (
            isinstance(source, torch.Tensor) and source.device.type != "cpu" and target is not None and torch.device(target).type == "cpu"
        )
    if name == "aten::copy_":
        target, source = args[0], args[1]
        return (
            isinstance(source, torch.Tensor)
            and source.device.type != "cpu"
            and target.device.type == "cpu"
            and not kwargs.get("non_blocking", False)
        )
    return False


class HostSyncCounter(TorchDispatchMode):
    """``with HostSyncCounter() as counter: ...``; then ``counter.syncs`` (name -> count),
    ``counter.total`` and ``counter.operators`` (every dispatched operator)."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: Counter[str] = Counter()
        self.operators: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        name = func._schema.name
        self.operators[name] += 1
        if name in WOULD_SYNC:
            self.syncs[name] += 1
        elif name in _INDEXING and _boolean_index(args):
            self.syncs[f"{name} (boolean index)"] += 1
        elif _device_to_host(func, args, kwargs):
            self.syncs[f"{name} (device to host)"] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.syncs.values())


def count_host_syncs(fn: Callable[[], Any]) -> tuple[Any, HostSyncCounter]:
    """``fn()``'s result and the would-sync operators it dispatched."""
    with HostSyncCounter() as counter:
        result = fn()
    return result, counter
