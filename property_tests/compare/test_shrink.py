"""The shrink falls back to the unshrunk example only where Hypothesis finds none (or the
check does not fail again); any other error is the tool's own and surfaces."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import strategies as st

from m2po_oracle.compare.shrink import reduce_batch, shrink_to_minimal
from m2po_oracle.oracle.algorithm import m2po
from m2po_oracle.oracle.batch import Batch


@dataclass
class Outcome:
    failed_checks: tuple[str, ...]


class FakeRunner:
    def __init__(self, battery):
        self.options = SimpleNamespace(examples=20, seed=0)
        self.battery = battery
        self.calls = 0

    def run_battery(self, example):
        self.calls += 1
        return self.battery(self, example)


def test_no_failing_example_falls_back_to_the_unshrunk_one():
    runner = FakeRunner(lambda runner, example: Outcome(()))
    example, outcome, _ = shrink_to_minimal(runner, {"loss"}, fallback=123, strategy=st.integers())
    assert example == 123 and outcome == Outcome(())


def test_a_check_that_fails_once_only_falls_back_to_the_unshrunk_one():
    runner = FakeRunner(lambda runner, example: Outcome(("loss",) if runner.calls == 1 else ()))
    example, _, _ = shrink_to_minimal(runner, {"loss"}, fallback=123, strategy=st.integers())
    assert example == 123


def test_a_failing_example_is_shrunk():
    runner = FakeRunner(lambda runner, example: Outcome(("loss",) if example >= 7 else ()))
    example, outcome, _ = shrink_to_minimal(runner, {"loss"}, fallback=1000, strategy=st.integers(min_value=0))
    assert example == 7 and outcome.failed_checks == ("loss",)


def test_an_error_of_the_tool_itself_is_not_swallowed():
    def broken(runner, example):
        if example != "unshrunk":  # only the search's own examples: the fallback's battery runs fine
            raise RuntimeError("a bug in the battery")
        return Outcome(("loss",))

    with pytest.raises(RuntimeError, match="a bug in the battery"):
        shrink_to_minimal(FakeRunner(broken), {"loss"}, fallback="unshrunk", strategy=st.integers())


def _batch(rows: int, tokens: int, tau: float = 18.516576328819006) -> Batch:
    rng = np.random.default_rng(0)
    logp = rng.normal(-1.0, 0.7, (rows, tokens))
    # In each row one small log-ratio and larger ones: under a small tau the small stays, the rest go.
    d = np.where(np.arange(tokens) == 0, rng.uniform(0.1, 0.3, (rows, tokens)), rng.uniform(2.0, 4.0, (rows, tokens)))
    return Batch(logp, logp - d, np.full((rows, tokens), 1.0), np.ones((rows, tokens), dtype=bool), tau)


def test_a_batch_is_reduced_to_its_fewest_rows_and_tokens_and_simple_values():
    # The failure a kept-count denominator shows: some valid token removed, some kept.
    def removes_one_of_several(batch: Batch) -> bool:
        keep = m2po(batch).keep
        return bool(keep.any() and (batch.valid & ~keep).any())

    big = _batch(4, 2, tau=0.5)
    assert removes_one_of_several(big)
    small, stopped = reduce_batch(big, removes_one_of_several)
    assert stopped is None
    assert small.shape == (1, 2) and removes_one_of_several(small)
    values = np.concatenate([small.logp.ravel(), small.behavior_logp.ravel(), small.advantages.ravel(), [small.tau]])
    assert all(v * 8 == int(v * 8) for v in values), f"values not simplified: {small}"


def test_a_reduction_that_runs_out_of_calls_says_so():
    big = _batch(3, 3)
    small, stopped = reduce_batch(big, lambda batch: True, calls=2)
    assert small.valid.sum() == 8  # flattened to one row, one token made padding, then the budget is spent
    assert stopped is not None and "stopped after 2 calls" in stopped
    whole, stopped = reduce_batch(big, lambda batch: True)
    assert whole.shape == (1, 1) and stopped is None


def test_an_error_of_the_tool_during_the_reduction_is_not_swallowed():
    big = _batch(2, 1)

    def broken_on_one_row(batch: Batch) -> bool:
        if batch.shape[0] < 2:
            raise RuntimeError("a bug in the battery")
        return True

    with pytest.raises(RuntimeError, match="a bug in the battery"):
        reduce_batch(big, broken_on_one_row)
