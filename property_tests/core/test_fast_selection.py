"""The sort-free exact selection equals the sort-and-prefix-sum one, edge cases included.

``small=0`` forces the radix levels on every input (by default they only run above 4096
candidates, which Hypothesis-sized batches never reach).
"""

from __future__ import annotations

import math
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from m2po_oracle import oracle, strategies
from m2po_oracle.bench.baselines import kept_candidates_by_sorting
from m2po_oracle.core import fast_selection
from m2po_oracle.core.fast_selection import cut_without_sync, kept_candidates

SMALLS = [0, 1, 7, 4096]


def kept_candidates_without_sync(m2: torch.Tensor, tau: float, candidates: torch.Tensor | None = None) -> torch.Tensor:
    """The kept set of :func:`kept_candidates` with no host synchronisation (any device), from the
    core's device-side cut: what the core runs on an accelerator, reduced to the kept set.

    With ``candidates`` (a bool mask over ``m2``) only those compete and only they can be
    kept, so callers need no ``nonzero`` either.
    """
    values = m2 if candidates is None else m2.masked_fill(~candidates, math.inf)
    return cut_without_sync(values, tau).kept


def _candidates(batch) -> torch.Tensor:
    d = oracle.log_ratio(batch.logp, batch.behavior_logp, batch.valid)
    trust = oracle.trust_region(d, batch.advantages, batch.valid)
    return torch.from_numpy(oracle.second_moment(d)[trust].copy())


@pytest.mark.parametrize("small", SMALLS)
@given(batch=strategies.batches())
def test_equals_the_sorting_baseline_on_every_strategy(small, batch):
    m2 = _candidates(batch)
    fast, baseline = kept_candidates(m2, batch.tau, small=small), kept_candidates_by_sorting(m2, batch.tau)
    if not torch.equal(fast, baseline):
        # Only a decision within float64 rounding of tau may differ: both must be Algorithm 1's.
        values = np.sort(m2.numpy())
        k = int(fast.sum())
        assert int(baseline.sum()) in (k - 1, k, k + 1)
        boundary = values[: max(int(fast.sum()), int(baseline.sum()))].mean()
        assert math.isclose(boundary, batch.tau, rel_tol=1e-12, abs_tol=1e-300), (
            f"fast kept {k}, baseline {int(baseline.sum())} far from the boundary"
        )


EDGE_VALUES = {
    "all equal": [0.0625] * 50,
    "all equal above tau": [0.25] * 50,
    "zeros": [0.0] * 10 + [1.0] * 5,
    "subnormals": [5e-324, 1e-310, 2.2250738585072014e-308, 0.5, 0.7],
    "straddling a bucket edge": [np.nextafter(0.5, 0.0), 0.5, np.nextafter(0.5, 1.0), 0.25, np.nextafter(0.25, 0.0), 1.0, 2.0],
    "one inf": [0.01, 0.02, math.inf],
    "huge": [1e300, 1e300, 1e-3],
    "exact boundary": [0.0625, 0.0625, 0.140625, 0.25, 0.25],
    "empty": [],
}


@pytest.mark.parametrize("small", SMALLS)
@pytest.mark.parametrize("case", EDGE_VALUES)
@pytest.mark.parametrize("tau", [0.0, 0.04, 0.0625, 0.140625, 1.0, 1e308])
def test_edge_values(case, tau, small):
    m2 = torch.tensor(EDGE_VALUES[case], dtype=torch.float64)
    for order in (torch.arange(m2.numel()), torch.arange(m2.numel() - 1, -1, -1)):
        values = m2[order]
        assert torch.equal(kept_candidates(values, tau, small=small), kept_candidates_by_sorting(values, tau)), f"{case}, tau {tau}"


@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(5000, 60000),
    scale=st.sampled_from([0.05, 0.3, 3.0]),
    tau=st.sampled_from([0.0, 0.04, 0.5]),
)
def test_large_random_batches_take_the_radix_path_and_agree(seed, n, scale, tau):
    rng = np.random.default_rng(seed)
    d = scale * rng.standard_t(3, size=n)
    d[rng.integers(0, n, size=n // 10)] = 0.125  # a block of exact ties
    m2 = torch.from_numpy(d * d)
    assert torch.equal(kept_candidates(m2, tau), kept_candidates_by_sorting(m2, tau))


def test_ties_keep_the_lowest_indices():
    m2 = torch.tensor([0.25, 0.0, 0.25, 0.25, 0.0], dtype=torch.float64)  # tau 0.1: 0, 0, then one 0.25 fits
    assert kept_candidates(m2, 0.1, small=0).tolist() == [True, True, False, False, True]


@given(batch=strategies.batches())
def test_the_sync_free_variant_equals_the_radix_one_on_every_strategy(batch):
    m2 = _candidates(batch)
    assert torch.equal(kept_candidates_without_sync(m2, batch.tau), kept_candidates(m2, batch.tau, small=0))


@pytest.mark.parametrize("case", EDGE_VALUES)
@pytest.mark.parametrize("tau", [0.0, 0.04, 0.0625, 0.140625, 1.0, 1e308])
def test_the_sync_free_variant_on_edge_values(case, tau):
    m2 = torch.tensor(EDGE_VALUES[case], dtype=torch.float64)
    assert torch.equal(kept_candidates_without_sync(m2, tau), kept_candidates_by_sorting(m2, tau)), f"{case}, tau {tau}"


def test_the_sync_free_variant_on_a_large_batch_with_ties():
    rng = np.random.default_rng(3)
    d = 0.3 * rng.standard_t(3, size=50000)
    d[::7] = 0.25
    m2 = torch.from_numpy(d * d)
    for tau in (0.0, 0.04, 0.0625, 0.5):
        assert torch.equal(kept_candidates_without_sync(m2, tau), kept_candidates_by_sorting(m2, tau))


def _core_selection(batch, small, sort_at_most=None):
    """The core's single-process selection with every candidate sorted up to ``small`` of
    them, and the crossing bucket finished by sorting up to ``sort_at_most`` values
    (default ``small``; 0: always by the remaining radix levels)."""
    from m2po_oracle.core.inputs import selection_inputs
    from m2po_oracle.core.selection import select_local
    from m2po_oracle.judge.contract import to_tensors

    t = to_tensors(batch, "float64")
    d, a = selection_inputs(t["logp"], t["behavior_logp"], t["advantages"], t["mask"])
    d, a, mask = d.reshape(-1), a.reshape(-1), t["mask"].reshape(-1)
    trust = ((a > 0) & (d > 0)) | ((a < 0) & (d < 0))
    m2 = d * d
    flats = [t[name].reshape(-1) for name in ("logp", "behavior_logp", "advantages", "mask")]
    with (
        mock.patch.object(fast_selection, "SMALL", small),
        mock.patch.object(fast_selection, "SORT_AT_MOST", small if sort_at_most is None else sort_at_most),
    ):
        selection = select_local(*flats, batch.tau, _valid_batches_only)
    return selection, m2, trust, mask


def _valid_batches_only() -> None:
    raise AssertionError("the strategies draw valid batches: the verdict must pass")


@given(batch=strategies.batches())
def test_the_core_selection_is_main_s_to_the_last_bit_on_few_candidates(batch):
    """Up to SMALL candidates the core sorts them all, as ``kept_candidates`` (the core's
    selection before the one-sync forward) does: keep, counts and metrics bit for bit."""
    selection, m2, trust, mask = _core_selection(batch, fast_selection.SMALL)
    candidates = m2[trust]
    kept = kept_candidates(candidates, batch.tau)
    expected = mask.clone()
    expected[trust] = kept
    assert torch.equal(selection.keep, expected)
    assert (int(selection.valid_count), int(selection.trust_region_count), int(selection.kept_trust_region_count)) == (
        int(mask.sum()),
        int(trust.sum()),
        int(kept.sum()),
    )
    trust_count, kept_count = torch.tensor(candidates.numel()).clamp(min=1), kept.sum().clamp(min=1)
    assert torch.equal(selection.m2_before, candidates.sum() / trust_count)
    assert torch.equal(selection.m2_after, torch.where(kept, candidates, torch.zeros_like(candidates)).sum() / kept_count)


@pytest.mark.parametrize("small", [0, 3])
@given(batch=strategies.batches())
def test_the_core_selection_through_the_radix_levels_is_algorithm_1(small, batch):
    """Forced through the first level over every token and the remaining levels on the
    crossing bucket, the kept set is an outcome of Algorithm 1 under the project's one
    selection policy (``check_selection``: exact, up to float64 rounding at tau; bucket
    sums add in another order than a sorted prefix, so near-ties at tau may split
    differently from ``kept_candidates``), and counts and metrics describe it."""
    from m2po_oracle.judge.equivalence import check_selection

    selection, m2, trust, mask = _core_selection(batch, small)
    keep = selection.keep.reshape(batch.shape)
    assert check_selection(batch, keep.numpy()) == []
    candidates, core_kept = m2[trust], selection.keep[trust]
    assert torch.equal(selection.keep[~trust], mask[~trust])
    assert int(selection.kept_trust_region_count) == int(core_kept.sum())
    count = max(int(core_kept.sum()), 1)
    assert float(selection.m2_after) == pytest.approx(float(candidates[core_kept].sum()) / count, rel=1e-12, abs=1e-300)
    assert float(selection.m2_before) == pytest.approx(float(candidates.sum()) / max(int(trust.sum()), 1), rel=1e-12, abs=1e-300)


@pytest.mark.parametrize(
    "small, sort_at_most", [(0, 0), (4096, 4096), (0, fast_selection.SORT_AT_MOST)], ids=["radix levels", "main's", "bucket sorted"]
)
@pytest.mark.parametrize("tau", [0.0, 0.04, 0.0625, 0.5])
def test_the_core_selection_on_a_large_batch_with_ties_and_padding(small, sort_at_most, tau):
    """18,753 candidates with a block of exact ties and runs of padding (crossing buckets of
    1 to 186 values); the crossing bucket finished by the radix levels or sorted."""
    from m2po_oracle.oracle.batch import Batch

    rng = np.random.default_rng(5)
    shape = (16, 4096)
    behavior = -rng.exponential(2.0, size=shape)
    d = 0.3 * rng.standard_t(3, size=shape)
    d[:, ::9] = 0.25
    valid = np.arange(shape[1])[None, :] < rng.integers(1000, shape[1], size=(shape[0], 1))
    batch = Batch(behavior + d, behavior, np.where(rng.random(shape) < 0.5, 1.0, -1.0), valid, tau)
    selection, m2, trust, mask = _core_selection(batch, small, sort_at_most)
    expected = mask.clone()
    expected[trust] = kept_candidates_by_sorting(m2[trust], tau)
    assert torch.equal(selection.keep, expected)


@pytest.mark.parametrize("case", EDGE_VALUES)
@pytest.mark.parametrize("tau", [0.0, 0.04, 0.0625, 0.140625, 1.0, 1e308])
def test_the_device_cut_counts_and_sums_what_it_keeps(case, tau):
    m2 = torch.tensor(EDGE_VALUES[case], dtype=torch.float64)
    cut = cut_without_sync(m2, tau)
    assert torch.equal(cut.kept, kept_candidates_by_sorting(m2, tau)), f"{case}, tau {tau}"
    assert int(cut.kept_count) == int(cut.kept.sum())
    assert float(cut.kept_sum) == pytest.approx(float(m2[cut.kept].sum()), rel=1e-12, abs=0.0)
