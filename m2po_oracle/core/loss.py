"""The production M2PO loss in torch: vectorised, device-agnostic, fail-closed.

Selection arithmetic (log ratio, M2, prefix means) runs in float64 whatever the input
dtype; the objective runs in at least float32. Follows the implementation contract
(``m2po_oracle.judge.contract``): ``m2po_loss(logp, behavior_logp, advantages, mask, *, tau)``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from m2po_oracle.core import fused
from m2po_oracle.core.agreement import validate_across, validate_across_ranks
from m2po_oracle.core.inputs import check_group, selection_inputs, validate_finite, validate_micro_batches, validate_structure
from m2po_oracle.core.scratch import Scratch
from m2po_oracle.core.selection import Selection, select_across, select_local


@dataclass(frozen=True)
class CoreResult:
    """``loss`` is 0-d and differentiable w.r.t. ``logp``; ``keep`` is bool like ``logp``.

    Metrics are 0-d float64 tensors and counts 0-d int64 tensors, on the input device, so
    that reading them never forces a host synchronisation inside the training step.
    """

    loss: torch.Tensor
    keep: torch.Tensor
    m2_before: torch.Tensor
    m2_after: torch.Tensor
    masked_fraction: torch.Tensor
    trust_region_fraction: torch.Tensor
    valid_count: torch.Tensor
    trust_region_count: torch.Tensor
    kept_trust_region_count: torch.Tensor


def select_tokens(
    logp: torch.Tensor, behavior_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, tau: float = 0.04, group: Any = None
) -> Selection:
    """Algorithm 1's selection for one optimizer batch.

    With ``group`` (a pure data-parallel ProcessGroup) every rank passes its own tokens and
    all ranks agree on one global cut over the union; N and the metrics are global.
    Tensor- and context-parallel replicas must not be in ``group`` (they would be counted
    twice): select over the pure DP group on CP-reconstructed tensors.
    """
    if group is not None:
        validate_across_ranks(logp, behavior_logp, advantages, mask, tau=tau, group=group)
        d, a = selection_inputs(logp, behavior_logp, advantages, mask)
        with torch.no_grad():
            flat = select_across(d.reshape(-1), a.reshape(-1), mask.reshape(-1), float(tau), group)
        return replace(flat, keep=flat.keep.reshape(mask.shape))
    validate_structure(logp, behavior_logp, advantages, mask, tau)
    with torch.no_grad():
        # mypy: an unpacked iterable of unknown length may fill every parameter (it holds four here)
        flat = select_local(  # type: ignore[call-arg]
            *(x.detach().reshape(-1) for x in (logp, behavior_logp, advantages, mask)),  # type: ignore[arg-type]
            float(tau),
            lambda: validate_finite(logp, behavior_logp, advantages, mask),
        )
    return replace(flat, keep=flat.keep.reshape(mask.shape))


def _first_logp(micro_batches: Any) -> Any:
    """The first micro-batch's logp, when there is one (it only picks the record's device)."""
    try:
        return micro_batches[0][0]
    except Exception:  # invalid input: that rank's own check reports it
        return None


def select_micro_batches(micro_batches: Sequence[Sequence[torch.Tensor]], *, tau: float = 0.04, group: Any = None) -> list[Selection]:
    """One selection over every micro-batch of an optimizer step (each ``(logp,
    behavior_logp, advantages, mask)``, shapes may differ, empty ones allowed).

    Returns one :class:`Selection` per micro-batch; all share the optimizer batch's counts,
    so ``loss_from_selection`` on each and summing gives the full-batch loss whatever the
    split.
    """
    if group is None:
        try:
            validate_micro_batches(micro_batches, tau, finite=False)
        except ValueError:
            # An earlier micro-batch's non-finite value is the first failure, as before.
            validate_micro_batches(micro_batches, tau)
            raise
        # One selection over the concatenation (torch.cat promotes mixed dtypes exactly).
        flats = [torch.cat([parts[i].detach().reshape(-1) for parts in micro_batches]) for i in range(4)]
        with torch.no_grad():
            whole = select_local(*flats, float(tau), lambda: validate_micro_batches(micro_batches, tau))  # type: ignore[call-arg, arg-type]  # mypy: an unpacked iterable of unknown length may fill every parameter (it holds four here)
    else:
        check_group(group)  # local: a broken group cannot carry an agreement
        validate_across(lambda: validate_micro_batches(micro_batches, tau), tau, _first_logp(micro_batches), group)
        flats_d, flats_a = [], []
        for logp, behavior_logp, advantages, mask in micro_batches:
            d, a = selection_inputs(logp, behavior_logp, advantages, mask)
            flats_d.append(d.reshape(-1))
            flats_a.append(a.reshape(-1))
        with torch.no_grad():
            whole = select_across(
                torch.cat(flats_d), torch.cat(flats_a), torch.cat([parts[3].reshape(-1) for parts in micro_batches]), float(tau), group
            )
    parts, start = [], 0
    for shape in (parts[3].shape for parts in micro_batches):
        end = start + math.prod(shape)
        parts.append(replace(whole, keep=whole.keep[start:end].reshape(shape)))
        start = end
    return parts


class _KeptRatioLoss(torch.autograd.Function):
    """``-(1/N) * sum(keep * exp(logp - behavior_logp) * advantages)`` on flat tensors,
    forward and backward by hand: the values and gradient autograd gives for the same
    expression (dropped tokens' log-ratio zeroed, then exp, times A zeroed off ``keep``),
    bit masks instead of ``where`` (on CPU a pass over a bool tensor costs 4-10x an
    arithmetic pass), and on CPU chunk by chunk, so that each chunk's passes run in cache.
    The sum adds the chunks' sums: over more than CPU_CHUNK tokens it rounds in another
    order than one sum. The backward recomputes each chunk's terms from the inputs rather
    than keeping two token-sized buffers alive from the forward (fresh memory for them was
    a page fault per 4 KiB: half the forward's time at 16M tokens)."""

    @staticmethod
    def forward(
        ctx: Any, logp: torch.Tensor, behavior_logp: torch.Tensor, advantages: torch.Tensor, keep: torch.Tensor, denominator: torch.Tensor
    ) -> torch.Tensor:
        total = torch.zeros((), dtype=denominator.dtype, device=keep.device)
        for _, _, ratio, weight in _kept_terms(logp, behavior_logp, advantages, keep, denominator.dtype):
            total += ratio.mul_(weight).sum()
        ctx.save_for_backward(logp, behavior_logp, advantages, keep, denominator)
        return -total / denominator

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logp, behavior_logp, advantages, keep, denominator = ctx.saved_tensors
        gradient = torch.empty(keep.numel(), dtype=denominator.dtype, device=keep.device)
        scale = -(grad / denominator)
        for start, end, ratio, weight in _kept_terms(logp, behavior_logp, advantages, keep, denominator.dtype):
            # In autograd's order (division, negation, A, then exp's result): the same bits.
            torch.mul(scale, weight, out=gradient[start:end]).mul_(ratio)
        return gradient.to(logp.dtype), None, None, None, None


def _kept_terms(
    logp: torch.Tensor, behavior_logp: torch.Tensor, advantages: torch.Tensor, keep: torch.Tensor, compute_dtype: torch.dtype
) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """The loss's terms chunk by chunk (the whole batch in one chunk off the CPU): each
    chunk's bounds, exp of the log-ratio where kept (exp(+0) = 1 elsewhere) and A where kept
    (+0 elsewhere), in the compute dtype, in the thread's scratch (valid until the next chunk)."""
    n = keep.numel()
    bits_dtype = torch.int64 if compute_dtype == torch.float64 else torch.int32
    scratch = Scratch.for_device(keep.device, n)
    # The scratch's float64 and int64 buffers seen as chunk-sized buffers of the compute width.
    ratios, weights = (buffer.view(compute_dtype)[: scratch.chunk] for buffer in (scratch.d, scratch.other))
    bits = scratch.bits.view(bits_dtype)[: scratch.chunk]
    fuse = fused.applies(logp, behavior_logp, advantages, keep)
    for start in range(0, n, scratch.chunk):
        end = min(start + scratch.chunk, n)
        r, w = ratios[: end - start], weights[: end - start]
        if fuse:  # the chunk's masked terms in one pass
            fused.loss_terms(logp[start:end], behavior_logp[start:end], advantages[start:end], keep[start:end], r, w)
        else:
            if logp.dtype == behavior_logp.dtype == compute_dtype:
                torch.sub(logp[start:end], behavior_logp[start:end], out=r)
            else:
                r.copy_(logp[start:end]).sub_(behavior_logp[start:end].to(compute_dtype))
            # All-ones bits where kept, 0 where dropped: ANDed into a float, it keeps the
            # value or makes it +0, so padding NaN/inf never meets the loss or the backward.
            kept_bits = bits[: end - start].copy_(keep[start:end].view(torch.uint8)).neg_()
            r.view(bits_dtype).bitwise_and_(kept_bits)
            w.copy_(advantages[start:end]).view(bits_dtype).bitwise_and_(kept_bits)
        yield start, end, r.exp_(), w


def loss_from_selection(
    logp: torch.Tensor, behavior_logp: torch.Tensor, advantages: torch.Tensor, keep: torch.Tensor, valid_count: torch.Tensor | int
) -> torch.Tensor:
    """``-(1/N) * sum(keep * exp(logp - behavior_logp) * advantages)`` with the given global N.

    ``keep`` may be a part of a selection (a micro-batch, a context-parallel shard): only
    its kept tokens carry gradient, and padding never meets the backward pass. Computed in
    float64 for float64 logp, else in float32.
    """
    compute_dtype = torch.float64 if logp.dtype == torch.float64 else torch.float32
    denominator = torch.as_tensor(valid_count, device=logp.device).clamp(min=1).to(compute_dtype)
    flat = [x.reshape(-1) for x in (logp, behavior_logp.detach(), advantages.detach(), torch.broadcast_to(keep, logp.shape))]
    return _KeptRatioLoss.apply(*flat, denominator)


def m2po_loss(
    logp: torch.Tensor,
    behavior_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    tau: float = 0.04,
    group: Any = None,
) -> CoreResult:
    """M2PO loss for one optimizer batch (Algorithm 1).

    ``loss = -(1/N) * sum(keep * exp(logp - behavior_logp) * advantages)`` with N the valid
    token count before masking. Values at positions where ``mask`` is False may be NaN or
    inf: they reach neither the loss nor its gradient. With ``group`` (pure data-parallel)
    the selection and N are global and each rank's loss is its share: the rank losses sum
    to the global loss (under DDP, which averages gradients, scale by the group size).
    """
    selection = select_tokens(logp, behavior_logp, advantages, mask, tau=tau, group=group)
    loss = loss_from_selection(logp, behavior_logp, advantages, selection.keep, selection.valid_count)
    return CoreResult(loss=loss, **{f.name: getattr(selection, f.name) for f in fields(selection)})
