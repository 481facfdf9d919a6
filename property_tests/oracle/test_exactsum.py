"""The vectorised exact sum is math.fsum, bit for bit, including its special cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from m2po_oracle.oracle.exactsum import fsum

TINY, HUGE = 5e-324, 1.7976931348623157e308


def _same(values: np.ndarray) -> None:
    try:
        expected, expected_error = math.fsum(values), None
    except (OverflowError, ValueError) as error:
        expected, expected_error = None, type(error)
    if expected_error is not None:
        with pytest.raises(expected_error):
            fsum(values)
        return
    actual = fsum(values)
    assert (actual == expected and math.copysign(1.0, actual) == math.copysign(1.0, expected)) or (
        math.isnan(actual) and math.isnan(expected)
    ), (actual, expected)


@given(st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=0, max_size=300), st.integers(1, 4))
def test_equals_math_fsum_on_any_floats(values, repeat):
    _same(np.array(values * repeat, dtype=np.float64))


@given(
    st.lists(
        st.sampled_from([0.0, -0.0, TINY, -TINY, 1e-310, -2.2250738585072014e-308, 1.0, -1.0, 0.1, 2.0**52, HUGE / 4]),
        min_size=64,
        max_size=400,
    )
)
def test_subnormals_zeros_cancellation_and_the_sign_of_zero(values):
    _same(np.array(values))


@pytest.mark.parametrize("seed", range(3))
def test_many_chunks_of_mixed_magnitudes(seed):
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(700_001) * 10.0 ** rng.integers(-300, 300, 700_001)
    _same(values)
    _same(np.concatenate([values, -values]))  # exactly zero
    _same(rng.standard_normal(600_000))


def test_what_fsum_decides_itself():
    _same(np.array([HUGE] * 100 + [-HUGE] * 100))  # intermediate overflow: OverflowError
    _same(np.array([HUGE / 2] * 70 + [-HUGE / 2] * 69))
    _same(np.array([1.0] * 100 + [math.inf, -math.inf]))  # ValueError
    _same(np.array([1.0] * 100 + [math.nan]))
    _same(np.array([0.0] * 100))
    _same(np.array([-0.0] * 100))
