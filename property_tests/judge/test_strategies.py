"""The public strategies produce what they promise (else the suite tests less than it says)."""

from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, find, given, settings

from m2po_oracle import oracle, strategies
from m2po_oracle.judge.equivalence import selection_bounds

SEARCH = settings(max_examples=400, database=None, deadline=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck))
#: Features in under 1 % of draws (a tie at the cut: about 3 in 400); 2000 draws miss one
#: with probability below 1e-6, where 400 missed it under pytest's random stream.
RARE = {"tie at the cut"}
RARE_SEARCH = settings(SEARCH, max_examples=2000)


def _d(batch):
    return oracle.log_ratio(batch.logp, batch.behavior_logp, batch.valid)


def _trust(batch):
    return oracle.trust_region(_d(batch), batch.advantages, batch.valid)


def _tie_at_cut(batch):
    bounds = selection_bounds(batch)
    k = bounds.k_min
    return 0 < k < bounds.sorted_m2.size and bounds.sorted_m2[k - 1] == bounds.sorted_m2[k]


def _exact_boundary(batch):
    means = selection_bounds(batch).prefix_means
    return bool((means == batch.tau).any())


def _partial_removal(batch):
    bounds = selection_bounds(batch)
    return 0 < bounds.k_min < bounds.sorted_m2.size


FEATURES = {
    "GRPO group with A == 0": (strategies.grpo_batches(), lambda b: (b.valid & (b.advantages == 0)).any()),
    "GRPO sequence-constant advantages with both signs": (
        strategies.grpo_batches(),
        lambda b: (b.advantages[b.valid] > 0).any() and (b.advantages[b.valid] < 0).any(),
    ),
    "partial removal (0 < kept < |T|)": (strategies.batches(), _partial_removal),
    "token with d == 0": (strategies.token_advantage_batches(), lambda b: (b.valid & (_d(b) == 0)).any()),
    "both advantage signs in one row": (
        strategies.token_advantage_batches(),
        lambda b: any((r[v] > 0).any() and (r[v] < 0).any() for r, v in zip(b.advantages, b.valid)),
    ),
    "tie at the cut": (strategies.tie_batches(), _tie_at_cut),
    "prefix mean exactly tau": (strategies.dyadic_batches(), _exact_boundary),
    "|d| > 20": (strategies.extreme_batches(), lambda b: (np.abs(_d(b)) > 20).any()),
    "NaN padding": (strategies.batches(), lambda b: np.isnan(b.logp[~b.valid]).any()),
    "inf padding": (strategies.batches(), lambda b: np.isinf(b.advantages[~b.valid]).any()),
    "all-padding row": (strategies.batches(), lambda b: b.valid.any() and (~b.valid.any(axis=1)).any()),
    "empty trust region with valid tokens": (strategies.degenerate_batches(), lambda b: b.valid.any() and not _trust(b).any()),
    "everything masked": (strategies.degenerate_batches(), lambda b: not b.valid.any()),
    "single token": (strategies.degenerate_batches(), lambda b: b.shape == (1, 1)),
    "tau == 0": (strategies.batches(), lambda b: b.tau == 0.0 and _trust(b).any()),
}


@pytest.mark.parametrize("feature", FEATURES)
def test_strategy_produces(feature):
    strategy, has_feature = FEATURES[feature]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        find(strategy, has_feature, settings=RARE_SEARCH if feature in RARE else SEARCH, random=random.Random(0))


@given(strategies.batches())
def test_valid_values_are_finite(batch):
    for name in ("logp", "behavior_logp", "advantages"):
        assert np.isfinite(getattr(batch, name)[batch.valid]).all(), f"{name} has non-finite values on valid tokens"


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: strategies.grpo_batches(max_groups=0), "max_groups: expected an int >= 1"),
        (lambda: strategies.token_advantage_batches(max_len=1.5), "max_len: expected an int >= 1"),
        (lambda: strategies.random_grpo_batch(np.random.default_rng(0), rows=10, length=4), "rows: expected a multiple of group_size=8"),
        (lambda: strategies.scope_batches(max_shards=1), "max_shards: expected an int >= 2"),
    ],
)
def test_strategy_arguments_are_checked(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def _selects_differently_when_split(batch, parts):
    """Whether Algorithm 1 on each part alone keeps another mask than on the whole batch."""
    from m2po_oracle.judge.equivalence import same_up_to_ties, valid_m2
    from m2po_oracle.oracle.batch import Batch

    keep = np.zeros(batch.shape, dtype=bool)
    for rows in parts:
        keep[rows] = oracle.m2po(
            Batch(batch.logp[rows], batch.behavior_logp[rows], batch.advantages[rows], batch.valid[rows], batch.tau)
        ).keep
    return not same_up_to_ties(keep, oracle.m2po(batch).keep, valid_m2(batch))


def test_scope_batches_make_splits_matter_on_most_draws():
    """The split-scope family exists to make per-rank / per-micro-batch / per-sequence
    selection visible: most of its batches must select differently when split in halves
    (two DP ranks or micro-batches) and per row. Measured on the derandomized stream: 96 and
    126 of 200 draws (48 % and 63 %)."""
    halves, per_row, drawn = 0, 0, 0

    # Derandomized: a share measured on one fixed stream, not on whichever stream the run draws
    # (an unseeded stream once gave 79 of 200, just under the bar).
    @settings(SEARCH, max_examples=200, derandomize=True)
    @given(strategies.scope_batches())
    def count(batch):
        nonlocal halves, per_row, drawn
        drawn += 1
        middle = batch.shape[0] // 2
        halves += _selects_differently_when_split(batch, [slice(0, middle), slice(middle, None)])
        per_row += _selects_differently_when_split(batch, [slice(i, i + 1) for i in range(batch.shape[0])])

    count()
    assert halves >= 0.4 * drawn and per_row >= 0.5 * drawn, (halves, per_row, drawn)


def test_the_default_mix_includes_split_scope_batches():
    """Measured on 100 draws: 13-19 such batches in the mix, 4 without the split-scope family."""
    seen = []

    @settings(
        SEARCH, max_examples=200, derandomize=True
    )  # its own seed: a test before it may reseed the global random (transformers.set_seed)
    @given(strategies.batches())
    def count(batch):
        seen.append(batch.shape[0] >= 2 and _selects_differently_when_split(batch, [slice(i, i + 1) for i in range(batch.shape[0])]))

    count()
    assert sum(seen) >= 18, f"only {sum(seen)} of {len(seen)} default batches select differently per row"
