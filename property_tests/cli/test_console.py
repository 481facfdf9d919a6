"""The console report is a renderer of the JSON record alone, as the HTML is: a record read back
from its file prints the run's table, diagnosis, counterexample and verdict."""

from __future__ import annotations

import io
import json
from functools import partial

from rich.console import Console

from m2po_oracle.call.planted import planted
from m2po_oracle.cli.console import print_quiet, print_report
from m2po_oracle.compare.search import run_compare
from m2po_oracle.explain.deviations import variant


def _printed(render, record) -> str:
    out = io.StringIO()
    render(Console(file=out, width=400, color_system=None), record)
    return out.getvalue()


def test_the_console_report_reads_the_json_record_alone(tmp_path):
    report = run_compare(partial(planted, deviation=variant("strict_stop").deviation), "strict", examples=40)
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report.to_json()))
    record = json.loads(path.read_text())  # nothing of the run but its file
    text = _printed(lambda console, r: print_report(console, r, "strict"), record)
    assert "strict vs Algorithm 1 (40 batches, float64, seed 0)" in text
    assert "selection.minimal" in text and "FAIL" in text and "strict_stop" in text
    assert f"diagnosis: {record['diagnosis']['summary']}" in text
    (counterexample,) = [c for c in record["counterexamples"] if c["cause"] == "strict_stop"]
    assert "(minimal batch for strict_stop: " in text and f"replay: {counterexample['replay']}" in text
    assert "minimal batch:" in text  # the batch itself, read back from the record
    assert text.rstrip().splitlines()[-1].startswith("verdict: divergent in ")
    quiet = _printed(print_quiet, record)
    assert "FAIL selection.minimal: " in quiet and "(strict_stop)" in quiet and "verdict: divergent" in quiet


def test_a_non_finite_value_reads_back_as_a_float():
    from m2po_oracle.compare.report import mismatch_from_json, mismatch_record
    from m2po_oracle.judge.equivalence import Mismatch
    from m2po_oracle.oracle.encoding import to_builtins

    m = Mismatch("loss", "loss differs", "loss", None, float("nan"), 1.5, ("d",))
    back = mismatch_from_json(json.loads(json.dumps(to_builtins(mismatch_record(m)))))
    assert repr(back.actual) == "nan" and back.expected == 1.5 and back.details == ("d",)


def test_a_pass_on_a_handful_of_examples_says_so_beside_the_verdict():
    """A run too short to exercise a check says which checks its pass rests on a handful of
    examples for; a run that exercised them says nothing of the kind."""
    from m2po_oracle.core.loss import m2po_loss
    from m2po_oracle.judge.coverage import THINLY_EXERCISED, thinly_exercised
    from m2po_oracle.report.html import render_html

    short, long = (run_compare(m2po_loss, "core", examples=n, shrink=False).to_json() for n in (8, 150))
    thin = thinly_exercised(short["checks"])
    assert thin and all(c["exercised"] < THINLY_EXERCISED for c in short["checks"] if f"{c['name']} ({c['exercised']})" in thin)
    out = io.StringIO()
    print_quiet(Console(file=out, width=400), json.loads(json.dumps(short)))
    assert "thinly exercised" in out.getvalue() and thin[0] in out.getvalue()
    assert 'id="thinly-exercised"' in render_html(short)
    assert not thinly_exercised(long["checks"]) and 'id="thinly-exercised"' not in render_html(long)


def test_a_counterexample_the_shrinker_left_early_says_so_in_both_renderers():
    from m2po_oracle.report.html import render_html

    report = run_compare(partial(planted, deviation=variant("strict_stop").deviation), "strict", examples=40)
    record = json.loads(json.dumps(report.to_json()))
    assert [c["shrink_stopped"] for c in record["counterexamples"]] == [None] * len(record["counterexamples"])
    assert "not minimal for certain" not in _printed(lambda console, r: print_report(console, r, "strict"), record)
    stopped = "the reduction stopped after 400 calls (60 s): a smaller batch may show it too"
    record["counterexamples"][0]["shrink_stopped"] = stopped
    assert f"not minimal for certain: {stopped}" in _printed(lambda console, r: print_report(console, r, "strict"), record)
    assert f"Not minimal for certain: {stopped}." in render_html(record)


def test_a_residual_beside_nothing_explained_shows_no_empty_comparison():
    from m2po_oracle.report.html import render_html

    report = run_compare(partial(planted, deviation=variant("strict_stop").deviation), "strict", examples=40)
    record = json.loads(json.dumps(report.to_json()))
    feature = {"feature": "cut", "residual": 80, "of": 117, "explained": 0, "explained_of": 0, "description": "a cut"}
    residual = {"checks": ["metrics.m2_before"], "unexplained": True, "count": 117, "contradicted": 0, "features": [feature]}
    residual.update(shared=[], float32_fits=0, explanation=[], counterexample=None)
    record["diagnosis"]["residuals"] = [residual]
    text = _printed(lambda console, r: print_report(console, r, "strict"), record)
    assert "features: cut 80/117" in text and "0/0" not in text
    assert "where explained" not in render_html(record)
    residual["features"] = [{**feature, "explained": 3, "explained_of": 40}]
    assert "cut 80/117 (vs 3/40 explained)" in _printed(lambda console, r: print_report(console, r, "strict"), record)
    assert "where explained" in render_html(record)
