"""The core's inputs: every argument check, in the order the core makes them, and the
float64 selection inputs (d and A, zero on padding)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

_FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


MISSING_BEHAVIOR_LOGP = (
    "behavior_logp: required (the rollout engine's log-probs of the sampled tokens); "
    "M2PO fails closed rather than fall back to a recomputed policy"
)


def validate_inputs(logp, behavior_logp, advantages, mask, tau) -> None:
    """Every input check, in order: the structure, then finite values on valid tokens."""
    validate_structure(logp, behavior_logp, advantages, mask, tau)
    validate_finite(logp, behavior_logp, advantages, mask)


def validate_structure(logp, behavior_logp, advantages, mask, tau) -> None:
    """Types, shapes, devices, dtypes and tau: checks that read no tensor value."""
    if behavior_logp is None:
        raise ValueError(MISSING_BEHAVIOR_LOGP)
    tensors = {"logp": logp, "behavior_logp": behavior_logp, "advantages": advantages, "mask": mask}
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    for name in ("behavior_logp", "advantages", "mask"):
        if tensors[name].shape != logp.shape:
            raise ValueError(f"{name}: expected shape {tuple(logp.shape)} (the shape of logp), got {tuple(tensors[name].shape)}")
        if tensors[name].device != logp.device:
            raise ValueError(f"{name}: expected device {logp.device} (the device of logp), got {tensors[name].device}")
    for name in ("logp", "behavior_logp", "advantages"):
        if tensors[name].dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name}: expected a floating dtype (float64/32, bfloat16, float16), got {tensors[name].dtype}")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask: expected dtype torch.bool, got {mask.dtype} (convert explicitly, e.g. mask.bool())")
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) or tau < 0:
        raise ValueError(f"tau: expected a finite Python number >= 0, got {tau!r}")


def validate_finite(logp, behavior_logp, advantages, mask) -> None:
    """Raises naming the first argument with a non-finite value on a valid token."""
    names = ("logp", "behavior_logp", "advantages")
    tensors = dict(zip(names, (logp, behavior_logp, advantages)))
    finite = [torch.isfinite(tensors[name].detach()) for name in names]
    # One host synchronisation in the common case; the per-argument detail only on failure.
    if not bool((mask & ~(finite[0] & finite[1] & finite[2])).any()):
        return
    for name, ok in zip(names, finite):
        bad = mask & ~ok
        if bool(bad.any()):
            index = tuple(int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"{name}: expected finite values on valid tokens (mask True), "
                f"got {tensors[name].detach()[index].item()} at index {index} ({int(bad.sum())} such tokens)"
            )


def check_group(group: Any) -> None:
    if group is None:
        return
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialised; pass group=None for single-process selection")
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(
            f"group: expected a torch.distributed.ProcessGroup (the pure data-parallel group) or None, got {type(group).__name__}"
        )


def validate_micro_batches(micro_batches: Any, tau: Any, *, finite: bool = True) -> None:
    """Every local check of :func:`select_micro_batches`, in its order (first failure raised);
    ``finite=False`` leaves out the finite-values checks (the only ones that read values)."""
    if not isinstance(micro_batches, Sequence) or not micro_batches:
        raise ValueError(
            f"micro_batches: expected a non-empty sequence of (logp, behavior_logp, advantages, mask), got {type(micro_batches).__name__}"
        )
    for i, parts in enumerate(micro_batches):
        if len(parts) != 4:
            raise ValueError(f"micro_batches[{i}]: expected (logp, behavior_logp, advantages, mask), got {len(parts)} items")
        (validate_inputs if finite else validate_structure)(*parts, tau)  # type: ignore[call-arg]  # mypy: an unpacked iterable of unknown length may fill every parameter (it holds four here)
    devices = {parts[3].device for parts in micro_batches}
    if len(devices) > 1:
        raise ValueError(f"micro_batches: expected every micro-batch on one device, got {sorted(map(str, devices))}")


def selection_inputs(logp, behavior_logp, advantages, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """d = logp - behavior_logp and A in float64, zero on padding: one conversion each, in place after it."""
    padding = ~mask
    # behavior_logp's float64 copy becomes A's buffer once subtracted (a mixed-dtype sub_
    # would allocate that copy anyway, and a fresh token-sized buffer costs page faults).
    buffer = behavior_logp.detach().to(torch.float64, copy=True)
    d = logp.detach().to(torch.float64, copy=True).sub_(buffer).masked_fill_(padding, 0.0)
    return d, buffer.copy_(advantages.detach()).masked_fill_(padding, 0.0)
