"""The benchmark command runs and reports; it asserts correctness, never speed."""

from __future__ import annotations

import json

import pytest

from m2po_oracle.bench.core import run_bench
from m2po_oracle.cli.main import EXIT_EQUIVALENT, EXIT_UNUSABLE, main
from m2po_oracle.core import fused
from m2po_oracle.report.bench_html import render_bench_html


def test_bench_reports_medians_ratios_and_identical_results(tmp_path):
    assert (
        main(["bench", "--sizes", "12,13", "--repeats", "2", "--json", str(tmp_path / "b.json"), "--html", str(tmp_path / "b.html")])
        == EXIT_EQUIVALENT
    )
    record = json.loads((tmp_path / "b.json").read_text())
    assert record["schema"] == "m2po-oracle/bench/4" and [r["tokens"] for r in record["rows"]] == [4096, 8192]
    for row in record["rows"]:
        assert row["identical"] and set(row["median_ms"]) == set(row["best_ms"]) == {
            "sort",
            "radix",
            "floor",
            "forward",
            "unfused",
            "passes",
        }
        assert row["sort_over_radix"] > 0 and row["unfused_over_forward"] > 0
        # 4096 tokens take the small-batch path (no first level); 8192 the fused passes where built.
        assert row["fused"] == (row["tokens"] > 4096 and fused.built())
        assert row["forward_over_selection"] > 0 and row["sort_over_forward"] > 0 and row["forward_over_floor"] > 0
        assert row["forward_over_passes"] > 0 and row["passes_over_selection"] > 0
        # The torch operators (a GPU's forward) read the verdict once; the fused passes hand
        # their numbers to the host from C, where no dispatch mode sees a read.
        assert row["syncs_per_unfused_forward"] == 1 and row["unfused_syncs"] == {"aten::_local_scalar_dense": 1}
        assert row["syncs_per_forward"] == (0 if row["fused"] else 1)
    # "fused" says what the forward did: with the passes off, it ran none.
    with fused.disabled():
        assert run_bench([8192], repeats=1)["rows"][0]["fused"] is False
    html = (tmp_path / "b.html").read_text()
    assert html.count("<polyline") == 6 and "http" not in html
    assert ("fused CPU passes: built" in html) == fused.built()


def test_bench_html_escapes_and_renders_a_single_size():
    record = run_bench([256], repeats=1)
    record["environment"]["platform"] = "<script>alert(1)</script>"
    html = render_bench_html(record)
    assert "&lt;script&gt;" in html and "<script>" not in html


def test_bench_audit_times_a_correct_and_a_planted_capture_in_fresh_processes(tmp_path):
    path = tmp_path / "audit.json"
    assert main(["bench", "--audit", "--tokens", "65536", "--json", str(path)]) == EXIT_EQUIVALENT
    record = json.loads(path.read_text())
    assert record["schema"] == "m2po-oracle/bench-audit/1" and record["target"] == {"wall_s": 30.0, "peak_rss_bytes": 4 << 30}
    step = record["step"]
    assert (step["dp"], step["micro_batches"], step["T"], step["tokens"]) == (4, 2, 4096, 65536)
    assert (
        0 < step["kept_trust_region_count"] < step["trust_region_count"] < step["valid_count"] < step["tokens"]
    )  # it masks; ~10 % padding
    assert step["planted_micro_batch"]["tokens_changed"] > 0
    cases = {c["case"]: c for c in record["cases"]}
    assert (cases["correct"]["verdict"], cases["planted"]["verdict"]) == ("equivalent", "divergent")
    assert "audit.selection" in cases["planted"]["steps"][0]["failing"]  # one micro-batch alone: no scope diagnosis fits every block
    for case in cases.values():
        assert case["as_expected"] and case["wall_s"] > 0 and case["disk_bytes"] > 65536 * 4 * 4
        assert case["peak_rss_bytes"] >= case["rss_after_imports_bytes"] > 0 and isinstance(case["within_target"], bool)


@pytest.mark.parametrize(
    "argv", [["bench", "--sizes", "x"], ["bench", "--sizes", "40"], ["bench", "--device", "cuda:9"], ["bench", "--audit", "--tokens", "4"]]
)
def test_bench_bad_arguments_exit_2(argv):
    assert main(argv) == EXIT_UNUSABLE
