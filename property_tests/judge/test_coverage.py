"""How hard a run looked (m2po_oracle.judge.coverage): each exercise rule on hand-built batches,
the Clopper-Pearson bound, the features and families, and the new report columns."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import re
import warnings

import numpy as np
import pytest
from hypothesis.errors import NoSuchExample
from scipy.stats import beta

from m2po_oracle import strategies
from m2po_oracle.call.resolve import load_implementation
from m2po_oracle.cli.main import EXIT_EQUIVALENT, main
from m2po_oracle.compare.database import search_settings, seeded_find
from m2po_oracle.judge import coverage
from m2po_oracle.judge.battery import BatteryOutcome, run_battery
from m2po_oracle.judge.checks import CHECKS
from m2po_oracle.judge.contract import Measurement
from m2po_oracle.judge.coverage import EXERCISED, FEATURES, CoverageTally, Rule, failure_rate_upper, rate_text
from m2po_oracle.oracle.batch import Batch
from m2po_oracle.oracle.encoding import to_builtins
from m2po_oracle.report.html import render_html


def make(d, advantages=None, valid=None, tau=0.04, padding=0.0) -> Batch:
    """A batch with log ratio ``d`` (behaviour log-probs -1), advantages +1 by default."""
    d = np.atleast_2d(np.asarray(d, dtype=np.float64))
    advantages = np.ones_like(d) if advantages is None else np.atleast_2d(np.asarray(advantages, dtype=np.float64))
    valid = np.ones(d.shape, dtype=bool) if valid is None else np.atleast_2d(np.asarray(valid, dtype=bool))
    behavior = np.full(d.shape, -1.0)
    fill = lambda a: np.where(valid, a, padding)  # noqa: E731
    return Batch(fill(behavior + d), fill(behavior), fill(advantages), valid, tau)


# Hand-built batches: M2 = d^2, all dyadic, so every prefix mean is exact.
NO_CUT = make([0.5, 0.125], tau=1.0)  # P_2 = 17/128 <= 1: both kept
CUT = make([0.5, 0.125], tau=0.04)  # P_1 = 1/64 <= tau < P_2: the 0.5 token removed, one kept
CUT_ALL = make([0.5], tau=0.01)  # P_1 = 1/4 > tau: the only candidate removed, none kept
EMPTY_TRUST = make([0.5, -0.25], advantages=[-1.0, 1.0], tau=0.04)  # A opposes d everywhere
PADDED = make([[0.5, 0.25], [0.125, 0.0]], valid=[[1, 1], [1, 0]], tau=1.0)
OUTSIDE = make([0.5, 0.25], advantages=[1.0, -1.0], tau=1.0)  # the second token is outside the trust region
TIED = make([0.5, -0.5, 0.5], tau=0.04)  # three equal M2: keep all or none
ZERO_A = make([0.5, 0.25], advantages=[0.0, 0.0], tau=1.0)
ALL_MASKED = make([0.5, 0.25], valid=[0, 0])

#: Per check with a rule other than "every example": a batch that exercises it, and one
#: that cannot fail it.
PAIRS: dict[str, tuple[Batch, Batch]] = {
    "selection.keep_only_valid": (PADDED, NO_CUT),
    "selection.only_trust_region_masked": (OUTSIDE, NO_CUT),
    "selection.budget": (CUT, NO_CUT),
    "selection.minimal": (NO_CUT, EMPTY_TRUST),  # needs no cut: removing anything there is not minimal
    "selection.largest_removed_first": (CUT, TIED),
    "loss": (NO_CUT, ZERO_A),
    "gradient": (CUT, ZERO_A),
    "metrics.m2_before": (CUT, EMPTY_TRUST),
    "metrics.m2_after": (NO_CUT, EMPTY_TRUST),
    "metrics.masked_fraction": (CUT, NO_CUT),
    "metrics.trust_region_fraction": (NO_CUT, EMPTY_TRUST),
    "metrics.trust_region_count": (CUT, EMPTY_TRUST),
    "metrics.kept_trust_region_count": (NO_CUT, EMPTY_TRUST),
    "padding_immunity": (PADDED, NO_CUT),
}
#: More batches that must not exercise a check (the edges of each rule).
ALSO_NOT: dict[str, tuple[Batch, ...]] = {
    "selection.minimal": (CUT_ALL, ALL_MASKED),  # a cut that removes every candidate cannot remove too many
    "selection.budget": (EMPTY_TRUST, make([0.125], tau=0.04)),
    "selection.largest_removed_first": (make([0.5]), EMPTY_TRUST),
    "loss": (ALL_MASKED,),
}

# Algorithm 1 removes both candidates (M2 4/64 and 9/64 > tau); a port reading the advantage
# sign off each row's first token keeps the larger and removes the smaller.
REMOVES_ALL_TWO = make([[0.0, -0.375], [-0.25, 0.0]], advantages=[[1.0, -1.0], [-1.0, 0.0]], valid=[[1, 1], [1, 0]], tau=1 / 64)
#: More batches that must exercise a check (a failure can show there though Algorithm 1 makes no cut).
ALSO: dict[str, tuple[Batch, ...]] = {
    "selection.largest_removed_first": (NO_CUT, REMOVES_ALL_TWO),
    "selection.minimal": (CUT,),
    "selection.budget": (make([0.5, 0.25, 0.125], tau=0.02),),
}


def _violations(rules: dict[str, Rule]) -> list[str]:
    """The checks whose rule misjudges a hand-built batch (empty: every rule is right)."""
    wrong = []
    for check, (exercises, cannot) in PAIRS.items():
        holds = rules[check].holds
        if (
            not all(holds(coverage.facts(b)) for b in (exercises, *ALSO.get(check, ())))
            or holds(coverage.facts(cannot))
            or any(holds(coverage.facts(b)) for b in ALSO_NOT.get(check, ()))
        ):
            wrong.append(check)
    return wrong


def test_a_wrong_order_where_algorithm_1_removes_everything_is_exercised():
    outcome = run_battery(load_implementation("control:first_token_advantage_sign"), REMOVES_ALL_TWO)
    assert "selection.largest_removed_first" in outcome.failed_checks
    facts = coverage.facts(outcome.batch)
    assert facts.kept == 0 and "selection.largest_removed_first" in coverage.exercised_by(facts)


def test_every_check_of_the_battery_has_a_rule():
    assert set(EXERCISED) == set(CHECKS)
    assert set(PAIRS) == {n for n, rule in EXERCISED.items() if rule is not coverage.EVERY}


def test_each_rule_exercises_what_can_fail_and_not_what_cannot():
    assert _violations(EXERCISED) == []


def test_the_hand_built_batches_are_what_they_say():
    f = coverage.facts
    assert (f(NO_CUT).kept, f(NO_CUT).candidates) == (2, 2)
    assert (f(CUT).kept, f(CUT).candidates) == (1, 2)
    assert (f(CUT_ALL).kept, f(CUT_ALL).candidates, f(CUT_ALL).k_min) == (0, 1, 0)
    assert f(EMPTY_TRUST).candidates == 0 and f(TIED).kept in (0, 3)


@pytest.mark.parametrize("check", sorted(PAIRS))
def test_a_rule_that_always_says_true_is_caught(check):
    planted = {**EXERCISED, check: Rule("always", lambda _: True)}
    assert _violations(planted) == [check]


def test_a_rule_that_never_holds_is_caught():
    planted = {**EXERCISED, "selection.minimal": Rule("never", lambda _: False)}
    assert _violations(planted) == ["selection.minimal"]


@pytest.mark.parametrize(
    "check, narrower",
    [
        ("selection.largest_removed_first", lambda f: 0 < f.kept < f.candidates),  # "one kept and one removed" misses wrong counts
        ("selection.minimal", lambda f: f.candidates > 0 and f.kept < f.candidates),  # "a cut" misses no-cut batches and counts CUT_ALL
    ],
)
def test_a_narrower_rule_is_caught(check, narrower):
    assert _violations({**EXERCISED, check: Rule("narrower", narrower)}) == [check]


def test_every_example_rules_hold_even_on_an_all_masked_batch():
    facts = coverage.facts(ALL_MASKED)
    for name in ("call", "determinism", "inputs_not_mutated", "metrics.valid_count"):
        assert EXERCISED[name].holds(facts), name


# --- features and families ------------------------------------------------------------------

TIE_AT_CUT = make([0.125, 0.5, -0.5], advantages=[1.0, 1.0, -1.0], tau=0.15)  # M2 1/64, 1/4, 1/4: P_2 = 17/128 <= tau < P_3 = 11/64
EXACT = make([0.125, 0.5, -0.5], advantages=[1.0, 1.0, -1.0], tau=17 / 128)  # P_2 == tau exactly: <= keeps two


@pytest.mark.parametrize(
    "feature, has, has_not",
    [
        ("cut", CUT, NO_CUT),
        ("ties_at_cut", TIE_AT_CUT, CUT),
        ("exact_boundary", EXACT, TIE_AT_CUT),
        ("empty_trust_region", EMPTY_TRUST, CUT),
        ("all_masked", ALL_MASKED, PADDED),
        ("empty_row", make([[0.5, 0.25], [0.125, 0.0]], valid=[[1, 1], [0, 0]]), PADDED),
        ("tiny_log_ratio", make([0.5, 1e-11]), make([0.5, 1e-9])),
        ("extreme_log_ratio", make([0.5, 20.5]), make([0.5, 19.5])),
    ],
)
def test_features(feature, has, has_not):
    assert FEATURES[feature].holds(coverage.facts(has)) and not FEATURES[feature].holds(coverage.facts(has_not))


def test_exact_boundary_is_exact_not_close():
    assert coverage.facts(EXACT).kept == 2
    near = make([0.125, 0.5, -0.5], advantages=[1.0, 1.0, -1.0], tau=math.nextafter(17 / 128, 1.0))
    assert coverage.facts(near).kept == 2 and not FEATURES["exact_boundary"].holds(coverage.facts(near))


def test_nan_padding_is_read_from_the_drawn_batch_not_the_zeroed_one():
    drawn = make([[0.5, 0.25], [0.125, 0.0]], valid=[[1, 1], [1, 0]], padding=float("nan"))
    assert FEATURES["nan_padding"].holds(coverage.facts(drawn.with_padding(0.0), drawn=drawn))
    assert not FEATURES["nan_padding"].holds(coverage.facts(drawn.with_padding(0.0), drawn=drawn.with_padding(float("inf"))))
    assert not FEATURES["nan_padding"].holds(coverage.facts(drawn.with_padding(0.0)))


def _draw(strategy, n=25):
    found = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            seeded_find(strategy, lambda b: found.append(b) and False, search_settings(n), random.Random(0))
        except NoSuchExample:
            pass
    return found


@pytest.mark.parametrize(
    "strategy, family",
    [
        (strategies.grpo_batches(), "grpo"),
        (strategies.token_advantage_batches(), "token_advantage"),
        (strategies.dyadic_batches(), "dyadic"),
        (strategies.tie_batches(), "ties"),
        (strategies.extreme_batches(), "extreme"),
        (strategies.degenerate_batches(), "degenerate"),
        (strategies.scope_batches(), "scope"),
    ],
)
def test_each_family_tags_its_batches_without_touching_their_json(strategy, family):
    drawn = _draw(strategy, 10)
    assert drawn and {strategies.family_of(b) for b in drawn} == {family}
    for batch in drawn:
        text = batch.to_json()
        assert "family" not in text and strategies.family_of(Batch.from_json(text)) is None
        assert [f.name for f in dataclasses.fields(batch)] == ["logp", "behavior_logp", "advantages", "valid", "tau"]


def test_a_fixed_tau_keeps_the_family():
    from m2po_oracle.call.loss_function import batch_strategy

    drawn = _draw(batch_strategy(0.25), 20)
    assert all(b.tau == 0.25 for b in drawn) and all(strategies.family_of(b) is not None for b in drawn)


# --- counting -------------------------------------------------------------------------------


def test_failures_outside_a_rule_still_count_and_checks_that_did_not_run_do_not():
    tally = CoverageTally()
    batch = EMPTY_TRUST
    result = coverage.facts(batch).expected
    from m2po_oracle.judge.equivalence import Mismatch

    outcome = BatteryOutcome(
        batch,
        Measurement(batch, "float64", result),
        (Mismatch("metrics.m2_before", "planted"),),
        checked=("call", "selection.minimal", "metrics.m2_before", "loss"),
    )
    exercised = tally.add(batch, outcome)
    # minimal cannot fail on an empty trust region; m2_before failed there (a wrong trust region shows so); loss has
    # non-zero terms; padding_immunity did not run.
    assert exercised == {"call", "metrics.m2_before", "loss"} and tally.features["empty_trust_region"] == 1
    failed_call = BatteryOutcome(batch, Measurement(batch, "float64", None), (Mismatch("call", "raised"),))
    assert tally.add(batch, failed_call) == {"call"} and tally.judged == 1 and tally.examples == 2


def test_step_outcomes_never_crash_the_count():
    tally = CoverageTally()
    batch = CUT
    result = coverage.facts(batch).expected
    distributed = BatteryOutcome(
        batch,
        Measurement(batch, "float64", result),
        ranks=({"rank": 0},),
        checked=("call", "distributed.global_selection", "distributed.loss_sum"),
    )
    assert tally.add(batch, distributed) == {"call", "distributed.global_selection", "distributed.loss_sum"}

    class Case:
        def to_dict(self):
            return {"kind": "trainer_case"}

    trainer = BatteryOutcome(
        batch,
        Measurement(batch, "float64", result),
        case={"kind": "trainer_case"},
        checked=("call", "selection.budget", "selection.keep_only_valid", "trainer.optimizer_step"),
    )
    assert tally.add(Case(), trainer) == {"call", "selection.budget", "trainer.optimizer_step"}
    broken = BatteryOutcome(
        Batch(np.zeros((1, 1)), np.zeros((1, 1)), np.zeros((1, 1)), np.zeros((1, 1), bool)),
        Measurement(batch, "float64", dataclasses.replace(result, keep=np.zeros((3, 3), bool))),
        checked=("call", "loss"),
    )
    tally.add(object(), broken)  # whatever the facts make of it, it counts without raising
    assert tally.families == {"untagged": 1, "trainer_case": 1, "object": 1}
    assert json.dumps(to_builtins(tally.record(["call", "trainer.optimizer_step"])))


SELECTION_CONTROLS = (
    "first_token_advantage_sign",
    "per_sequence_selection",
    "strict_stop",
    "one_extra_removed",
    "mean_over_valid",
    "all_valid_candidates",
    "swapped_quadrants",
)


@pytest.mark.parametrize("control", SELECTION_CONTROLS)
def test_a_selection_check_fails_only_where_its_rule_holds(control):
    """The selection rules are necessary conditions: no failure falls outside them."""
    fn = load_implementation(f"control:{control}")
    outside, failed = [], 0

    def look(drawn: Batch) -> bool:
        nonlocal failed
        outcome = run_battery(fn, drawn)
        exercised = coverage.exercised_by(coverage.facts(outcome.batch, drawn=drawn))
        for check in outcome.failed_checks:
            if check.startswith("selection."):
                failed += 1
                if check not in exercised:
                    outside.append((check, drawn.to_json()))
        return False

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            seeded_find(strategies.batches(), look, search_settings(60), random.Random(0))
        except NoSuchExample:
            pass
    assert failed and not outside, outside[:2]


# --- the bound ------------------------------------------------------------------------------


def test_clopper_pearson_upper_bound():
    assert failure_rate_upper(0, 59) == pytest.approx(0.0495, abs=5e-4)  # the "59 examples for 5% at 95%" rule
    assert failure_rate_upper(0, 59) == pytest.approx(1 - 0.05 ** (1 / 59), rel=1e-12)
    assert failure_rate_upper(0, 500) == pytest.approx(beta.ppf(0.95, 1, 500))
    assert failure_rate_upper(5, 100) == pytest.approx(beta.ppf(0.95, 6, 95)) and 0.05 < failure_rate_upper(5, 100) < 0.11
    assert failure_rate_upper(3, 3) == 1.0 and failure_rate_upper(0, 0) is None
    assert rate_text(0, 59, failure_rate_upper(0, 59)) == "< 5.0%"
    assert rate_text(5, 100, failure_rate_upper(5, 100)) == f"5.0% (< {coverage.percent(failure_rate_upper(5, 100))})"
    assert rate_text(0, 0, None) == "-"
    assert rate_text(7, 7, failure_rate_upper(7, 7)) == "100%"  # not "100% (< 100%)"


# --- the reports ----------------------------------------------------------------------------


def test_json_console_and_html_show_exercised_and_the_bound(tmp_path, capsys):
    path = tmp_path / "core.json"
    assert main(["compare", "--impl", "core", "--in-process", "--examples", "30", "--json", str(path)]) == EXIT_EQUIVALENT
    data = json.loads(path.read_text())
    checks = {c["name"]: c for c in data["checks"]}
    for c in checks.values():
        assert 0 <= c["failures"] <= c["exercised"] <= c["ran"], c
        bound = c["failure_rate_upper_95"]
        assert (bound is None) if not c["exercised"] else bound == pytest.approx(beta.ppf(0.95, 1, c["exercised"]))
    assert checks["call"]["exercised"] == checks["determinism"]["exercised"] == 30
    assert checks["selection.minimal"]["exercised"] < checks["call"]["exercised"]
    cov = data["coverage"]
    assert cov["examples"] == sum(cov["families"].values()) == 30 and set(cov["families"]) <= {
        "grpo",
        "token_advantage",
        "dyadic",
        "ties",
        "extreme",
        "degenerate",
        "scope",
    }
    assert set(cov["features"]) == set(FEATURES) and all(0 <= n <= cov["judged"] for n in cov["features"].values())
    assert set(cov["exercised_when"]) == set(checks) and cov["confidence"] == 0.95
    out = capsys.readouterr().out
    assert "exercised" in out and "failure rate (95%)" in out and "families:" in out and "features (of 30 judged)" in out
    row = next(line for line in out.splitlines() if "selection.minimal" in line)
    assert str(checks["selection.minimal"]["exercised"]) in row and re.search(r"< \d", row)

    html = render_html(data)
    table = re.search(r'<table class="checks">.*?</table>', html, re.DOTALL).group(0)
    assert '<th class="num">exercised</th>' in table and "failure rate (95%)" in table
    assert re.search(r'<h3 id="coverage">.*?<table class="coverage">', html, re.DOTALL)
    for name, count in cov["families"].items():
        assert f'<td class="mono">{name}</td><td class="num">{count}</td>' in html
    old = {**data, "checks": [{k: v for k, v in c.items() if k not in ("exercised", "failure_rate_upper_95")} for c in data["checks"]]}
    del old["coverage"]
    assert 'id="coverage"' not in render_html(old)  # an older report renders, with dashes
