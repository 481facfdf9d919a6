"""Hand-checked cases in fixtures/golden/: each file carries its derivation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from m2po_oracle import oracle
from m2po_oracle.core.loss import m2po_loss
from m2po_oracle.judge.contract import measure
from m2po_oracle.oracle.batch import Batch
from m2po_oracle.oracle.record import COUNT_FIELDS, METRIC_FIELDS

GOLDEN = sorted((Path(__file__).parents[2] / "fixtures" / "golden").glob("*.json"))


def _computed(source: str, batch: Batch):
    if source == "oracle loop":
        return oracle.m2po(batch)
    if source == "oracle vectorised":
        return oracle.m2po(batch, vectorised=True)
    return measure(m2po_loss, batch).result


def test_there_are_golden_cases():
    assert len(GOLDEN) >= 5


@pytest.mark.parametrize("source", ["oracle loop", "oracle vectorised", "core"])
@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.stem)
def test_golden_case(path, source):
    case = json.loads(path.read_text())
    assert case["derivation"], f"{path.name}: a golden case needs its derivation"
    batch = Batch.from_dict(case["batch"])
    expected = case["expected"]
    result = _computed(source, batch)
    admissible = [np.array(k, dtype=bool) for k in expected["keep_any_of"]]
    assert any(np.array_equal(result.keep, k) for k in admissible), (
        f"{path.stem} ({source}): keep {result.keep.astype(int).tolist()} not in {expected['keep_any_of']}"
    )
    assert result.loss == pytest.approx(expected["loss"], rel=1e-12, abs=1e-15), f"{path.stem} ({source}): loss"
    if "grad" in expected:
        np.testing.assert_allclose(result.grad, np.array(expected["grad"]), rtol=1e-12, atol=1e-15, err_msg=f"{path.stem} ({source}): grad")
    for name in METRIC_FIELDS:
        assert getattr(result, name) == pytest.approx(expected[name], rel=1e-12, abs=1e-15), f"{path.stem} ({source}): {name}"
    for name in COUNT_FIELDS:
        assert getattr(result, name) == expected[name], f"{path.stem} ({source}): {name}"
