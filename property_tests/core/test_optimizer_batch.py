"""One selection per optimizer batch: the result does not depend on the micro-batch split."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from m2po_oracle import oracle, strategies
from m2po_oracle.core.loss import loss_from_selection, m2po_loss, select_micro_batches
from m2po_oracle.judge.contract import to_tensors
from m2po_oracle.judge.equivalence import check_selection, compare_values, tolerance
from m2po_oracle.oracle.batch import Batch


@st.composite
def _splits(draw, rows: int) -> list[int]:
    """Cut points of ``rows`` into up to 5 contiguous micro-batches (empty ones allowed)."""
    cuts = sorted(draw(st.lists(st.integers(0, rows), min_size=0, max_size=4), label="cuts"))
    return [0, *cuts, rows]


@given(data=st.data())
def test_selection_and_loss_do_not_depend_on_the_split(data):
    batch = data.draw(strategies.batches(), label="batch")
    bounds = data.draw(_splits(batch.shape[0]), label="split")
    trim = data.draw(st.booleans(), label="trim each micro-batch to its longest row")
    tensors = to_tensors(batch, "float64")
    micro = []
    for start, end in itertools.pairwise(bounds):
        rows = slice(start, end)
        width = int(batch.valid[rows].any(axis=0).nonzero()[0].max()) + 1 if trim and batch.valid[rows].any() else batch.shape[1]
        micro.append(tuple(t[rows, :width] for t in (tensors["logp"], tensors["behavior_logp"], tensors["advantages"], tensors["mask"])))
    selections = select_micro_batches(micro, tau=batch.tau)
    keep = np.zeros(batch.shape, dtype=bool)
    for (start, end), part, selection in zip(itertools.pairwise(bounds), micro, selections):
        keep[start:end, : part[0].shape[1]] = selection.keep.numpy()
        assert int(selection.valid_count) == int(batch.valid.sum()), "each micro-batch must carry the optimizer batch's N"
    # The same admissible outcome as one whole-batch selection (trimming may change the tie order).
    assert check_selection(batch, keep) == []
    total = sum(loss_from_selection(p[0], p[1], p[2], s.keep, s.valid_count) for p, s in zip(micro, selections))
    total.backward()
    expected = oracle.evaluate_with_mask(batch, keep)
    assert (
        compare_values(
            "loss", "loss", total.detach().item(), expected.loss, tolerance("float64", "loss"), scale=float(np.abs(expected.grad).sum())
        )
        is None
    )
    assert compare_values("gradient", "grad", tensors["logp"].grad.numpy(), expected.grad, tolerance("float64", "gradient")) is None
    if not trim:
        whole = m2po_loss(*(tensors[k].detach() for k in ("logp", "behavior_logp", "advantages", "mask")), tau=batch.tau)
        assert np.array_equal(keep, whole.keep.numpy()), "untrimmed contiguous splits keep the flat order: the mask must be identical"


def test_a_per_micro_batch_selection_differs_from_the_optimizer_batch_one():
    """Negative control for the property: selecting each micro-batch on its own is caught."""
    batch = Batch(np.array([[0.3, 0.3], [0.05, 0.05]]), np.zeros((2, 2)), np.ones((2, 2)), np.ones((2, 2), bool), 0.04)
    tensors = to_tensors(batch, "float64")
    parts = [
        tuple(t[i : i + 1] for t in (tensors["logp"], tensors["behavior_logp"], tensors["advantages"], tensors["mask"])) for i in range(2)
    ]
    per_micro_batch = np.concatenate([select_micro_batches([p], tau=0.04)[0].keep.numpy() for p in parts])
    assert check_selection(batch, per_micro_batch) != []
    together = np.concatenate([s.keep.numpy() for s in select_micro_batches(parts, tau=0.04)])
    assert check_selection(batch, together) == []


@pytest.mark.parametrize(
    "bad, message",
    [
        ([], "micro_batches: expected a non-empty sequence"),
        ([(torch.zeros(1, 2),)], r"micro_batches\[0\]: expected \(logp, behavior_logp, advantages, mask\), got 1 items"),
    ],
)
def test_micro_batch_arguments_are_checked(bad, message):
    with pytest.raises(ValueError, match=message):
        select_micro_batches(bad)


def test_the_first_failing_micro_batch_is_reported_first():
    """A non-finite value in micro-batch 0 is reported before micro-batch 1's wrong shape
    (validation reads no value until the structure is checked, but keeps the order)."""
    good = (torch.tensor([[-0.5, -1.0]]), torch.tensor([[-0.6, -1.0]]), torch.tensor([[1.0, -1.0]]), torch.tensor([[True, True]]))
    non_finite = (torch.tensor([[float("nan"), -1.0]]), *good[1:])
    wrong_shape = (*good[:2], torch.ones(1, 3), good[3])
    with pytest.raises(ValueError, match="logp: expected finite values on valid tokens"):
        select_micro_batches([non_finite, wrong_shape], tau=0.04)
    with pytest.raises(ValueError, match=r"advantages: expected shape \(1, 2\)"):
        select_micro_batches([good, wrong_shape], tau=0.04)
    with pytest.raises(ValueError, match="logp: expected finite values on valid tokens"):
        select_micro_batches([good, non_finite], tau=0.04)
