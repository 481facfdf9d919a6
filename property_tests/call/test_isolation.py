"""An implementation that hangs or kills its process is a finding; nothing is left behind."""

from __future__ import annotations

import multiprocessing
import textwrap
import time

import numpy as np
import pytest

from m2po_oracle.call.isolation import ImplementationLoadError, Isolated
from m2po_oracle.cli.main import EXIT_UNUSABLE, main
from m2po_oracle.judge.battery import run_battery
from m2po_oracle.oracle.batch import Batch

BATCH = Batch(np.array([[0.1, 0.3], [0.2, 0.4]]), np.zeros((2, 2)), np.ones((2, 2)), np.ones((2, 2), bool), 0.04)


@pytest.fixture(scope="module")
def misbehaving(tmp_path_factory):
    path = tmp_path_factory.mktemp("impls") / "misbehaving.py"
    path.write_text(
        textwrap.dedent("""
        import os, time
        def hang(*args, **kwargs):
            time.sleep(600)
        def die(*args, **kwargs):
            os._exit(3)
        def hang_sometimes(logp, behavior_logp, advantages, mask, *, tau):
            if logp.shape[0] > 1:
                time.sleep(600)
            from m2po_oracle.core.loss import m2po_loss
            return m2po_loss(logp, behavior_logp, advantages, mask, tau=tau)
    """)
    )
    return path


def _children() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("m2po-impl:")]


def test_the_core_passes_in_a_worker():
    with Isolated("core", timeout_s=30) as runner:
        assert run_battery(runner, BATCH).passed
    assert not _children()


def test_a_hang_is_a_timeout_finding_and_the_worker_is_replaced(misbehaving):
    with Isolated(f"{misbehaving}:hang_sometimes", timeout_s=1.0) as runner:
        started = time.monotonic()
        outcome = run_battery(runner, BATCH)
        assert time.monotonic() - started < 10, "the timeout did not cut the call short"
        assert [m.check for m in outcome.mismatches] == ["call"] and "timeout" in outcome.mismatches[0].summary
        one_row = Batch(BATCH.logp[:1], BATCH.behavior_logp[:1], BATCH.advantages[:1], BATCH.valid[:1], 0.04)
        assert run_battery(runner, one_row).passed, "a fresh worker should serve the next call"
        assert runner.timeouts == 1
    assert not _children(), "a worker process was left behind"


def test_a_dying_process_is_a_crash_finding(misbehaving):
    with Isolated(f"{misbehaving}:die", timeout_s=10) as runner:
        outcome = run_battery(runner, BATCH)
    assert "crashed" in outcome.mismatches[0].summary and "exit code 3" in outcome.mismatches[0].summary
    assert not _children()


def test_a_spec_that_cannot_load_is_a_load_error(misbehaving):
    with pytest.raises(ImplementationLoadError, match="has no attribute 'nope'"):
        Isolated(f"{misbehaving}:nope").start()
    with pytest.raises(ValueError, match="timeout_s: expected a number > 0"):
        Isolated("core", timeout_s=0)


def test_compare_on_a_hanging_implementation_stops_early_and_exits_2(misbehaving, tmp_path):
    started = time.monotonic()
    assert main(["compare", "--impl", f"{misbehaving}:hang", "--timeout", "1", "--json", str(tmp_path / "r.json")]) == EXIT_UNUSABLE
    assert time.monotonic() - started < 30, "compare kept waiting on a hanging implementation"
    assert "timeout" in (tmp_path / "r.json").read_text()
