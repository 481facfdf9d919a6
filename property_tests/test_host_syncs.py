"""The core's forward waits for the device once: the fail-closed verdict.

Counted on CPU with a dispatch mode (``m2po_oracle.host_syncs``): the operators that would
make a GPU stream's host wait are dispatched on every device, so a new ``.item()``,
``nonzero`` or boolean index anywhere in the forward fails here, without a GPU.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from m2po_oracle import fast_selection
from m2po_oracle.core import m2po_loss, select_micro_batches, select_tokens
from m2po_oracle.host_syncs import HostSyncCounter, count_host_syncs

#: The single-process forward's budget: the verdict that must reach the host to raise.
SINGLE_RANK_BUDGET = 1


def _batch(shape: tuple[int, int], seed: int = 0, dtype: torch.dtype = torch.float32, staleness: float = 0.3):
    generator = torch.Generator().manual_seed(seed)
    behavior = -torch.empty(shape).exponential_(0.5, generator=generator)
    logp = (behavior + staleness * torch.randn(shape, generator=generator)).to(dtype).requires_grad_(True)
    advantages = torch.where(torch.rand(shape, generator=generator) < 0.5, 1.0, -1.0).to(dtype)
    mask = torch.rand(shape, generator=generator) < 0.9
    return logp, behavior.to(dtype), advantages, mask


SHAPES = [(64, 512), (4, 2), (0, 3)]


@pytest.mark.parametrize("finish", ["sorted", "radix levels"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_the_forward_synchronises_once(shape, dtype, finish):
    """Both finishes (sorted, or the remaining radix levels: forced by sorting at most 0
    values), tiny and empty batches."""
    logp, behavior, advantages, mask = _batch(shape, dtype=dtype)
    at_most = fast_selection.SMALL if finish == "sorted" else 0
    with mock.patch.object(fast_selection, "SMALL", at_most), mock.patch.object(fast_selection, "SORT_AT_MOST", at_most):
        result, counter = count_host_syncs(lambda: m2po_loss(logp, behavior, advantages, mask, tau=0.04))
    assert counter.total <= SINGLE_RANK_BUDGET, f"{shape} {dtype}: {dict(counter.syncs)} (budget {SINGLE_RANK_BUDGET})"
    # Reading the metrics stays on the device too: they are tensors, not Python numbers.
    assert all(isinstance(getattr(result, name), torch.Tensor) for name in ("m2_before", "valid_count", "kept_trust_region_count"))


def test_select_tokens_and_micro_batches_synchronise_once():
    parts = [_batch((8, 64), seed=s) for s in range(3)] + [_batch((0, 64), seed=9)]
    _, counter = count_host_syncs(lambda: select_micro_batches(parts, tau=0.04))
    assert counter.total <= SINGLE_RANK_BUDGET, dict(counter.syncs)
    _, counter = count_host_syncs(lambda: select_tokens(*parts[0], tau=0.04))
    assert counter.total <= SINGLE_RANK_BUDGET, dict(counter.syncs)


def test_the_backward_does_not_synchronise():
    logp, behavior, advantages, mask = _batch((64, 512))
    loss = m2po_loss(logp, behavior, advantages, mask, tau=0.04).loss
    _, counter = count_host_syncs(lambda: loss.backward())
    assert counter.total == 0, dict(counter.syncs)


# The counter's own negative controls: each planted operator must be seen.
PLANTED = {
    ".item()": lambda x: x.sum().item(),
    "bool()": lambda x: bool(x.any()),
    "int()": lambda x: int(x.argmax()),
    "nonzero": lambda x: torch.nonzero(x > 0),
    "boolean index": lambda x: x[x > 0],
    "boolean index_put_": lambda x: x.clone().index_put_((x > 0,), torch.tensor(0.0)),
    "masked_select": lambda x: torch.masked_select(x, x > 0),
    "unique": lambda x: torch.unique(x),
    ".tolist()": lambda x: x.sum(0, keepdim=True).tolist(),
}


@pytest.mark.parametrize("plant", PLANTED)
def test_the_counter_sees_a_planted_synchronisation(plant):
    x = torch.randn(16)
    _, counter = count_host_syncs(lambda: PLANTED[plant](x))
    if plant == ".tolist()":
        # On CPU .tolist() reads memory without dispatching: only a CUDA tensor's copy to the
        # host is an operator. Counted there (aten::_to_copy to cpu); here it must be 0.
        assert counter.total == 0
    else:
        assert counter.total >= 1, f"{plant}: not counted"


def test_the_counter_passes_through_results():
    with HostSyncCounter() as counter:
        value = torch.arange(4.0).sum()
    assert float(value) == 6.0 and counter.total == 0 and counter.operators["aten::sum"] == 1
