"""The benchmark command runs and reports; it asserts correctness, never speed."""

from __future__ import annotations

import json

import pytest

from m2po_oracle.bench import render_bench_html, run_bench
from m2po_oracle.cli import EXIT_EQUIVALENT, EXIT_UNUSABLE, main


def test_bench_reports_medians_ratios_and_identical_results(tmp_path):
    assert main(["bench", "--sizes", "12,13", "--repeats", "2", "--json", str(tmp_path / "b.json"), "--html", str(tmp_path / "b.html")]) == EXIT_EQUIVALENT
    record = json.loads((tmp_path / "b.json").read_text())
    assert record["schema"] == "m2po-oracle/bench/1" and [r["tokens"] for r in record["rows"]] == [4096, 8192]
    for row in record["rows"]:
        assert row["identical"] and set(row["median_ms"]) == {"sort", "radix", "floor"} and row["sort_over_radix"] > 0
    html = (tmp_path / "b.html").read_text()
    assert html.count("<polyline") == 3 and "http" not in html


def test_bench_html_escapes_and_renders_a_single_size():
    record = run_bench([256], repeats=1)
    record["environment"]["platform"] = "<script>alert(1)</script>"
    html = render_bench_html(record)
    assert "&lt;script&gt;" in html and "<script>" not in html


@pytest.mark.parametrize("argv", [["bench", "--sizes", "x"], ["bench", "--sizes", "40"], ["bench", "--device", "cuda:9"]])
def test_bench_bad_arguments_exit_2(argv):
    assert main(argv) == EXIT_UNUSABLE
