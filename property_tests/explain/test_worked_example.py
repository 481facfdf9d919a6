"""The diagnosis page's worked example states what the diagnosis computed: its figures are
recomputed here from the same run (the tutorial's kept-count port, 100 batches, seed 0)."""

from __future__ import annotations

from pathlib import Path

import pytest

from m2po_oracle.call.resolve import load_implementation
from m2po_oracle.compare.search import run_compare
from m2po_oracle.explain import diagnosis
from m2po_oracle.explain.deviations import ALGORITHM_1, variant

ROOT = Path(__file__).parents[2]
PAGE = ROOT / "docs" / "explanation" / "diagnosis.md"
PORT = f"{ROOT / 'docs' / 'tutorial' / 'my_port.py'}:m2po_loss_kept_mean"


@pytest.fixture(scope="module")
def judged(monkeypatch_module):
    seen = {}
    search = diagnosis.search

    def spy(judge, candidates):
        seen["judge"] = judge
        return search(judge, candidates)

    monkeypatch_module.setattr(diagnosis, "search", spy)
    report = run_compare(load_implementation(PORT), PORT, examples=100)
    return report, seen["judge"]


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_the_worked_example_states_what_the_diagnosis_computed(judged):
    report, judge = judged
    sample = list(judge.sample)
    held_out = [i for i in range(len(judge.observations)) if i not in sample]
    failing_held_out = [i for i in held_out if judge.differences(ALGORITHM_1, i)]
    areal = variant("areal").deviation
    breaks = sum(1 for i in sample if "keep" in judge.differences(areal, i) and "keep" not in judge.differences(ALGORITHM_1, i))
    failing_pairs = judge.total - judge.score(ALGORITHM_1)
    figures = {
        "search sample* (51 batches: 153": (len(sample), judge.total) == (51, 153),
        "*held-out* set (49 batches, 18 of them failing)": (len(held_out), len(failing_held_out)) == (49, 18),
        "reproduces 115 of the 153 pairs": judge.score(ALGORITHM_1) == 115,
        "other 32 sample batches": len(sample) - failing_pairs // 2 == 32,
        "| `kept_count_denominator` | 38 of 38 | 0 | 153 of 153 |": failing_pairs == 38
        and judge.score(variant("kept_count_denominator").deviation) == 153,
        "| 38 of 38 | 23 masks | 130 of 153 |": (breaks, judge.score(areal)) == (23, 130),
        "(held out: 18 of 18)": all(
            (h.explained, h.failing, h.contradicted) == (18, 18, 0)
            for h in (report.diagnosis.shares[c].held_out for c in ("loss", "gradient"))
            if h is not None
        )
        and None not in (report.diagnosis.shares[c].held_out for c in ("loss", "gradient")),
    }
    text = " ".join(PAGE.read_text().split())
    wrong = [figure for figure, holds in figures.items() if " ".join(figure.split()) not in text or not holds]
    assert not wrong, f"the worked example of {PAGE.name} no longer says what the diagnosis computes: {wrong}"
    assert report.diagnosis.components == ("kept_count_denominator",)
