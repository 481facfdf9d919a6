"""Meta-tests of the equivalence semantics: the checker itself is shown to accept exactly
the outcomes Algorithm 1 allows and to reject the rest."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from m2po_oracle import oracle
from m2po_oracle.judge.equivalence import (
    FORMATS,
    Mismatch,
    Tolerance,
    check_selection,
    compare_to_oracle,
    compare_values,
    format_mismatches,
    representable,
    selection_bounds,
    tolerance,
)
from m2po_oracle.oracle.batch import Batch


def _batch(d, advantages=None, tau=0.04, valid=None, behavior=-1.0):
    d = np.array([d], dtype=np.float64)
    advantages = np.ones_like(d) if advantages is None else np.array([advantages], dtype=np.float64)
    valid = np.ones(d.shape, bool) if valid is None else np.array([valid], dtype=bool)
    return Batch(behavior + d, np.full(d.shape, behavior), advantages, valid, tau)


def _checks(batch, keep, compute_dtype="float64"):
    return [m.check for m in check_selection(batch, np.array([keep], dtype=bool), compute_dtype)]


# d = 0.5, 0.5, 0.125 -> M2 0.25, 0.25, 0.015625; prefix means 0.015625, 0.1328125, 0.171875.
TIE = _batch([0.5, 0.5, 0.125], tau=0.140625)


@pytest.mark.parametrize("keep", [[True, False, True], [False, True, True]], ids=["first of tie", "second of tie"])
def test_any_choice_among_ties_at_the_cut_is_admissible(keep):
    assert _checks(TIE, keep) == []


@pytest.mark.parametrize(
    "keep, violation",
    [
        ([False, False, True], "selection.minimal"),
        ([True, True, True], "selection.budget"),
        ([True, True, False], "selection.largest_removed_first"),
    ],
)
def test_wrong_cuts_are_named(keep, violation):
    assert violation in _checks(TIE, keep)


@pytest.mark.parametrize("compute_dtype", list(FORMATS))
def test_exact_boundary_is_decided_exactly_in_every_dtype(compute_dtype):
    # Every quantity is dyadic: the prefix mean equals tau exactly, so `<=` must keep all.
    batch = _batch([0.25, 0.25, 0.25], tau=0.0625)
    assert _checks(batch, [True, True, True], compute_dtype) == []
    assert _checks(batch, [True, True, False], compute_dtype) == ["selection.minimal"]


def test_exact_decision_just_above_tau_removes():
    batch = _batch([0.25, 0.25, 0.375], tau=0.0625)  # P_3 = 0.0885... > tau, exact
    assert _checks(batch, [True, True, False]) == []
    assert _checks(batch, [True, True, True]) == ["selection.budget"]


def test_a_decision_within_rounding_of_tau_may_go_either_way():
    # 0.2**2 is 0.04000000000000001 in float64: one ulp above tau, not exactly representable.
    batch = _batch([0.2], tau=0.04)
    assert oracle.second_moment(np.array([0.2]))[0] > 0.04
    assert _checks(batch, [True]) == [] and _checks(batch, [False]) == []


def test_far_from_tau_there_is_no_band():
    batch = _batch([0.3], tau=0.04)
    assert _checks(batch, [True], "bfloat16") == ["selection.budget"]


def test_near_ties_count_as_ties_only_in_reduced_precision():
    batch = _batch([0.5, 0.5 * (1 + 1e-9), 0.125], tau=0.140625)
    keep_smaller_removed = [False, True, True]  # keeps the (slightly) larger of the pair
    assert _checks(batch, keep_smaller_removed, "float32") == []
    assert _checks(batch, keep_smaller_removed, "float64") == ["selection.largest_removed_first"]


def test_non_candidates_and_padding():
    # token 1: A > 0, d < 0 (not a candidate); token 2: A == 0; token 3: padding.
    batch = _batch([0.5, -0.5, 0.5, 0.5], advantages=[1.0, 1.0, 0.0, 1.0], valid=[True, True, True, False])
    assert _checks(batch, [False, True, True, False]) == []
    assert _checks(batch, [False, False, True, False]) == ["selection.only_trust_region_masked"]
    assert _checks(batch, [False, True, True, True]) == ["selection.keep_only_valid"]


def test_loss_and_gradient_are_judged_on_the_implementations_own_mask():
    keep = np.array([[False, True, True]])
    expected = oracle.evaluate_with_mask(TIE, keep)
    assert compare_to_oracle(TIE, expected, "float64") == []
    wrong = oracle.evaluate_with_mask(TIE, np.array([[True, False, True]]))
    shifted = type(wrong)(loss=wrong.loss, keep=keep, grad=wrong.grad)  # mask of one choice, values of the other
    assert {m.check for m in compare_to_oracle(TIE, shifted, "float64")} == {"gradient"}


@pytest.mark.parametrize(
    "value, fmt, expected",
    [
        (0.0625, "bfloat16", True),
        (0.04, "float32", False),
        (1 + 2**-10, "float16", True),
        (1 + 2**-11, "float16", False),
        (70000.0, "float16", False),
        (2.0**-130, "float32", False),
        (0.1, "float64", True),
        (math.inf, "float64", False),
    ],
)
def test_representable(value, fmt, expected):
    assert representable(value, FORMATS[fmt]) is expected


def test_compare_values_reports_the_worst_element_like_assert_close():
    mismatch = compare_values(
        "gradient", "grad", np.array([[1.0, 2.0], [3.0, 4.5]]), np.array([[1.0, 2.0], [3.0, 4.0]]), Tolerance(1e-6, 0.0)
    )
    assert mismatch is not None
    assert "mismatched elements 1 / 4" in mismatch.summary
    assert mismatch.index == (1, 1) and mismatch.actual == 4.5 and mismatch.expected == 4.0
    assert any("greatest absolute difference 0.5 at index (1, 1)" in d for d in mismatch.details)
    assert compare_values("loss", "loss", float("nan"), 1.0, Tolerance(1e-3, 1e-3)) is not None, "NaN must never compare close"
    assert compare_values("loss", "loss", 1.0000001, 1.0, Tolerance(1e-6, 0.0)) is None


def test_the_failure_message_is_self_sufficient():
    mismatches = check_selection(TIE, np.array([[False, False, True]]))
    text = format_mismatches(mismatches, batch=TIE, where="for 'x'", replay="m2po-oracle replay --impl x --batch '{}'")
    for needle in (
        "[selection.minimal]",
        "kept 1 of 3",
        "kept trust-region tokens: actual 1, expected 2",
        "tau=0.140625",
        "logp=",
        "replay: m2po-oracle replay",
    ):
        assert needle in text, f"{needle!r} missing from:\n{text}"


def test_the_failure_message_counts_checks_not_mismatch_lines():
    first, second = Mismatch("loss", "loss differs"), Mismatch("loss", "loss differs again")
    assert format_mismatches([first, second]).startswith("this batch fails 1 check(s) (2 mismatches):")
    assert format_mismatches([first, Mismatch("gradient", "gradient differs")]).startswith("this batch fails 2 check(s):")


def test_tolerance_lookup_names_what_is_known():
    with pytest.raises(ValueError, match="tolerance: no entry for dtype 'int8'"):
        tolerance("int8", "loss")
    assert tolerance("float32", "gradient").rtol > tolerance("float64", "gradient").rtol


def test_selection_bounds_sort_values_and_order_candidates_only_on_demand():
    rng = np.random.default_rng(0)
    d = rng.choice([-0.5, -0.25, 0.125, 0.25, 0.5], size=(6, 40))
    batch = Batch(d - 1.0, np.full(d.shape, -1.0), np.where(rng.random(d.shape) < 0.5, 1.0, -1.0), rng.random(d.shape) < 0.9, 0.0625)
    bounds = selection_bounds(batch)
    m2 = oracle.second_moment(oracle.log_ratio(batch.logp, batch.behavior_logp, batch.valid))
    trust = oracle.trust_region(oracle.log_ratio(batch.logp, batch.behavior_logp, batch.valid), batch.advantages, batch.valid)
    assert np.array_equal(bounds.order, oracle.sorted_candidates(m2, trust))
    assert np.array_equal(bounds.sorted_m2, m2.ravel()[bounds.order])


def test_a_drawn_padding_failure_lists_the_padding_it_ran_with():
    """The battery judges with zero padding and prints that batch; a failure "with the
    drawn padding (instead of 0)" must show the padding values its probe ran with, or the
    message holds no trace of the NaN/inf that broke the port."""
    from m2po_oracle.call.controls import control
    from m2po_oracle.judge.battery import run_battery
    from m2po_oracle.judge.equivalence import format_mismatches

    nan, inf = float("nan"), float("inf")
    batch = Batch(
        np.array([[-0.5, nan, -1.0]]), np.array([[-0.6, -1e30, -1.0]]), np.array([[1.0, inf, -1.0]]), np.array([[True, False, True]]), 0.04
    )
    outcome = run_battery(control("nan_padding_leak").fn, batch)
    drawn = [m for m in outcome.mismatches if "with the drawn padding" in m.summary]
    assert drawn, [m.summary for m in outcome.mismatches]
    message = format_mismatches(drawn, batch=outcome.batch)
    for line in (
        "the probe's padding logp: (0, 1): nan",
        "the probe's padding behavior_logp: (0, 1): -1e+30",
        "the probe's padding advantages: (0, 1): inf",
    ):
        assert line in message, message
    # Probes with one fill for every padding value say it in their label; they list nothing.
    filled = [m for m in outcome.mismatches if "with padding set to" in m.summary]
    assert filled and not any(d.startswith("the probe's padding") for m in filled for d in m.details)


def test_a_replay_names_a_port_file_by_its_absolute_path(tmp_path, monkeypatch):
    """A report's replay command is pasted in another directory than the run's: a port
    given as a relative ``file.py:function`` is named by its absolute path there."""
    from m2po_oracle.judge.battery import replay_command

    (tmp_path / "port.py").write_text("def loss(*args, **kwargs): ...\n")
    monkeypatch.chdir(tmp_path)
    command = replay_command("port.py:loss", "{}")
    assert f"--impl {os.path.join(os.getcwd(), 'port.py')}:loss " in command, command
    assert "--impl core " in replay_command("core", "{}") and "--impl trainer:trl " in replay_command("trainer:trl", "{}")
