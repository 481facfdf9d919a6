"""The frameworks' loss aggregations (algorithm.md §5), margins, a kernel handed no mask and a
clip bound rounded through float32: golden cases in fixtures/golden/frameworks/, derived by
hand, that both realisations of each deviation (the torch control and the NumPy variant)
reproduce, and that Algorithm 1 does not (each case is a planted bug's witness)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_clip_family import deviation_of, golden_mismatches, load, run_planted

from m2po_oracle.explain import variants
from m2po_oracle.explain.deviations import ALGORITHM_1
from m2po_oracle.oracle.batch import Batch

CASES = sorted((Path(__file__).parents[2] / "fixtures" / "golden" / "frameworks").glob("*.json"))


def _numpy(batch: Batch, knobs) -> dict:
    result = variants.m2po(batch, knobs)
    return {"keep": result.keep, "loss": result.loss, "grad": result.grad, **result.reported()}


def test_every_case_has_its_derivation_and_a_deviation():
    assert len(CASES) >= 9
    for path in CASES:
        case = load(path)
        assert case["derivation"] and case["source"], path.name
        assert deviation_of(case["deviation"]) != ALGORITHM_1, path.name


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.stem)
def test_the_torch_control_matches_the_golden_case(path):
    case = load(path)
    got = run_planted(Batch.from_dict(case["batch"]), deviation_of(case["deviation"]))
    assert not golden_mismatches(case["expected"], got), f"{path.stem}: {golden_mismatches(case['expected'], got)}"


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.stem)
def test_the_numpy_variant_matches_the_golden_case(path):
    case = load(path)
    got = _numpy(Batch.from_dict(case["batch"]).with_padding(0.0), deviation_of(case["deviation"]))
    expected = {k: v for k, v in case["expected"].items() if k != "cap_squared"}
    assert not golden_mismatches(expected, got), f"{path.stem}: {golden_mismatches(expected, got)}"


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.stem)
def test_algorithm_1_fails_the_golden_case(path):
    """Each case witnesses its deviation: Algorithm 1 (the planted bug here) does not match it."""
    case = load(path)
    got = run_planted(Batch.from_dict(case["batch"]), ALGORITHM_1)
    assert golden_mismatches(case["expected"], got), f"{path.stem}: Algorithm 1 matches the case, so it shows nothing"


def test_a_clip_kind_without_the_ports_no_clip_range_fails_its_case():
    """The witness is the bound itself, not the clip kind: the release's clip with no range
    where the budget holds keeps the extreme token's gradient."""
    case = load(next(p for p in CASES if p.stem == "ratio_bound_when_unconstrained"))
    got = run_planted(Batch.from_dict(case["batch"]), deviation_of({"selection_kind": "clip_below"}))
    assert golden_mismatches(case["expected"], got)
