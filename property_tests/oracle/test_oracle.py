"""The oracle against itself and against the paper's definitions."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
from hypothesis import given, note
from hypothesis import strategies as st

from m2po_oracle import oracle, strategies
from m2po_oracle.judge.equivalence import check_selection
from m2po_oracle.oracle.batch import Batch


def _parts(batch: Batch):
    d = oracle.log_ratio(batch.logp, batch.behavior_logp, batch.valid)
    m2 = oracle.second_moment(d)
    trust = oracle.trust_region(d, batch.advantages, batch.valid)
    return d, m2, trust


def test_importing_the_oracle_does_not_import_torch():
    code = "import sys, m2po_oracle.oracle.algorithm, m2po_oracle.judge.equivalence, m2po_oracle.strategies; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False", "importing the oracle pulled in torch: the oracle must stay NumPy-only"


@given(strategies.batches())
def test_loop_equals_vectorised(batch):
    _, m2, trust = _parts(batch)
    loop = oracle.select_loop(m2, trust, batch.tau)
    vectorised = oracle.select_sorted(m2, trust, batch.tau)
    # The loop sums exactly (fsum), the sorted form by cumsum: they may differ only inside
    # the float64 rounding band, and both must then still be admissible outcomes.
    if not np.array_equal(loop, vectorised):
        note(f"loop {loop}, vectorised {vectorised}")
        assert check_selection(batch, batch.valid & ~vectorised) == []
        assert check_selection(batch, batch.valid & ~loop) == []


@given(
    st.lists(st.sampled_from([0.0, 0.0625, 0.125, 0.25, 0.5, 1.0]), min_size=1, max_size=60),
    st.integers(0, 2**32 - 1),
    st.sampled_from([0.0, 0.01, 0.04, 0.0625, 0.25]),
)
def test_select_sorted_is_the_cut_of_sorted_candidates_ties_included(levels, seed, tau):
    """select_sorted sorts values only; it must remove exactly sorted_candidates(m2, trust)[k*:]
    (M2 ascending, equal M2 by descending index), however many ties sit at the cut."""
    rng = np.random.default_rng(seed)
    m2 = np.array(levels) ** 2
    trust = rng.random(m2.size) < 0.8
    order = oracle.sorted_candidates(m2, trust)
    kept_count = int(np.count_nonzero(oracle.prefix_means(m2[order]) <= tau))
    expected = np.zeros(m2.size, dtype=bool)
    expected[order[kept_count:]] = True
    assert np.array_equal(oracle.select_sorted(m2, trust, tau), expected)


@given(strategies.batches())
def test_loop_output_is_admissible(batch):
    result = oracle.m2po(batch)
    assert check_selection(batch, result.keep) == []


@given(strategies.batches())
def test_budget_holds_and_only_trust_region_is_masked(batch):
    _, m2, trust = _parts(batch)
    masked = oracle.select_loop(m2, trust, batch.tau)
    assert not (masked & ~trust).any(), f"masked a non-trust-region token at {np.argwhere(masked & ~trust)[0]}"
    kept = trust & ~masked
    if kept.any():
        assert m2[kept].mean() <= batch.tau * (1 + 1e-12), f"kept mean M2 {m2[kept].mean()} exceeds tau {batch.tau}"


@given(strategies.batches())
def test_mask_is_minimal(batch):
    _, m2, trust = _parts(batch)
    masked = oracle.select_loop(m2, trust, batch.tau)
    if masked.any():
        # Un-mask the smallest removed token: the budget must then be broken.
        smallest = np.unravel_index(np.argmin(np.where(masked, m2, np.inf)), m2.shape)
        kept = trust & ~masked
        kept[smallest] = True
        assert m2[kept].mean() > batch.tau * (1 - 1e-12), f"keeping {smallest} (M2 {m2[smallest]}) stays within tau {batch.tau}"


@given(strategies.batches(), st.randoms(use_true_random=False))
def test_permuting_tokens_permutes_the_mask(batch, rng):
    permutation = np.arange(batch.logp.size)
    rng.shuffle(permutation)
    shuffle = lambda a: a.ravel()[permutation].reshape(a.shape)  # noqa: E731
    shuffled = Batch(shuffle(batch.logp), shuffle(batch.behavior_logp), shuffle(batch.advantages), shuffle(batch.valid), batch.tau)
    keep_shuffled = oracle.m2po(shuffled).keep
    unshuffled = np.empty(batch.logp.size, dtype=bool)
    unshuffled[permutation] = keep_shuffled.ravel()
    # Equal up to ties: the un-permuted mask is an admissible outcome on the original batch.
    assert check_selection(batch, unshuffled.reshape(batch.shape)) == []


@given(strategies.batches())
def test_analytic_gradient_matches_finite_differences_of_the_objective(batch):
    result = oracle.m2po(batch)
    d, _, _ = _parts(batch)
    n = int(batch.valid.sum())
    step = 1e-6
    for index in np.argwhere(result.keep)[:4]:
        index = tuple(index)
        if abs(d[index]) > 30:
            continue  # exp(d) so large that a central difference loses every digit
        # The objective is a sum over tokens: difference this token's term alone, or another
        # token's exp(50) would swallow the perturbation.
        only = np.zeros_like(result.keep)
        only[index] = True
        bumped = [d.copy(), d.copy()]
        bumped[0][index] += step
        bumped[1][index] -= step
        numeric = (oracle.objective(bumped[0], batch.advantages, only, n) - oracle.objective(bumped[1], batch.advantages, only, n)) / (
            2 * step
        )
        assert np.isclose(result.grad[index], numeric, rtol=1e-5, atol=1e-9), (
            f"at {index}: analytic {result.grad[index]}, numeric {numeric}"
        )


@given(strategies.batches())
def test_gradient_is_zero_on_masked_and_invalid_tokens(batch):
    result = oracle.m2po(batch)
    assert np.all(result.grad[~result.keep] == 0.0)
    assert np.isfinite(result.grad).all(), "NaN/inf padding reached the oracle's gradient"
    assert np.isfinite(result.loss)


def test_equality_stops_the_loop():
    # Spec: "Equality stops the loop (<= tau is satisfied)": dyadic, so exact.
    batch = Batch(np.array([[-0.25, -0.25, -0.25]]), np.array([[-0.5, -0.5, -0.5]]), np.ones((1, 3)), np.ones((1, 3), bool), tau=0.0625)
    assert oracle.m2po(batch).keep.all()
    assert oracle.m2po(batch, vectorised=True).keep.all()


def test_finite_differences_survive_a_huge_term_elsewhere():
    # Found by the thorough profile: a non-candidate with d = 50 makes the sum ~5e21.
    batch = Batch(
        np.array([[-1.35986381, 47.9608058]]), np.array([[-1.35986381, -2.0391942]]), -np.ones((1, 2)), np.ones((1, 2), bool), 0.04
    )
    test_analytic_gradient_matches_finite_differences_of_the_objective.hypothesis.inner_test(batch)


def test_the_literal_loop_handles_a_hundred_thousand_tokens():
    from m2po_oracle.strategies import random_grpo_batch

    batch = random_grpo_batch(np.random.default_rng(1), 400, 250, staleness=0.3)
    _, m2, trust = _parts(batch)
    loop = oracle.select_loop(m2, trust, batch.tau)
    assert loop.any() and np.array_equal(loop, oracle.select_sorted(m2, trust, batch.tau))


@given(st.lists(st.floats(0, 1e6, allow_subnormal=True), min_size=1, max_size=30), st.floats(0, 1e6), st.data())
def test_exact_sum_decides_like_exact_rational_arithmetic(values, tau, data):
    from fractions import Fraction

    total = oracle.ExactSum(np.array(values))
    removed = data.draw(st.integers(0, len(values) - 1), label="removed")
    for v in values[:removed]:
        total.remove(v)
    rest = values[removed:]
    exact = sum(Fraction(v) for v in rest) / len(rest) > Fraction(tau)
    assert total.mean_exceeds(tau, len(rest)) is exact


def test_exact_sum_handles_inf():
    assert oracle.ExactSum(np.array([1.0, np.inf])).mean_exceeds(1e308, 2) is True
