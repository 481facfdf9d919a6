"""The shrink falls back to the unshrunk example only where Hypothesis finds none (or the
check does not fail again); any other error is the tool's own and surfaces."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from hypothesis import strategies as st

from m2po_oracle.compare.shrink import shrink_to_minimal


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
    example, outcome = shrink_to_minimal(runner, {"loss"}, fallback=123, strategy=st.integers())
    assert example == 123 and outcome == Outcome(())


def test_a_check_that_fails_once_only_falls_back_to_the_unshrunk_one():
    runner = FakeRunner(lambda runner, example: Outcome(("loss",) if runner.calls == 1 else ()))
    example, _ = shrink_to_minimal(runner, {"loss"}, fallback=123, strategy=st.integers())
    assert example == 123


def test_a_failing_example_is_shrunk():
    runner = FakeRunner(lambda runner, example: Outcome(("loss",) if example >= 7 else ()))
    example, outcome = shrink_to_minimal(runner, {"loss"}, fallback=1000, strategy=st.integers(min_value=0))
    assert example == 7 and outcome.failed_checks == ("loss",)


def test_an_error_of_the_tool_itself_is_not_swallowed():
    def broken(runner, example):
        if example != "unshrunk":  # only the search's own examples: the fallback's battery runs fine
            raise RuntimeError("a bug in the battery")
        return Outcome(("loss",))

    with pytest.raises(RuntimeError, match="a bug in the battery"):
        shrink_to_minimal(FakeRunner(broken), {"loss"}, fallback="unshrunk", strategy=st.integers())
