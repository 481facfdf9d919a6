"""The HTML report: drawn only from the JSON report, escaped, self-contained, robust, and
actually displayed by a browser (headless Chromium, skipped cleanly where it is missing)."""

from __future__ import annotations

import copy
import json
import pathlib
import re
import struct
import subprocess
import sys
import zlib
from html.parser import HTMLParser
from typing import Any

import markupsafe
import pytest

from m2po_oracle.call.resolve import load_implementation
from m2po_oracle.compare.search import run_compare
from m2po_oracle.distributed.runner import DistributedRunner
from m2po_oracle.distributed.topology import Topology
from m2po_oracle.report import html as html_module
from m2po_oracle.report import values
from m2po_oracle.report.environment import environment
from m2po_oracle.report.html import render_html, write_html

SCRIPT = "<script>alert(1)</script>"
BREAKOUT = '"><img src=x onerror=alert(1)>'
PAYLOAD = SCRIPT + BREAKOUT
ATTRIBUTE = '" onmouseover="alert(1)'


# --- reports from the real pipeline ------------------------------------------------------


@pytest.fixture(scope="module")
def divergent() -> dict[str, Any]:
    spec = "control:one_extra_removed"
    return run_compare(load_implementation(spec), spec, examples=60).to_json()


@pytest.fixture(scope="module")
def equivalent() -> dict[str, Any]:
    return run_compare(load_implementation("core"), "core", examples=30).to_json()


@pytest.fixture(scope="module")
def hostile() -> dict[str, Any]:
    """An implementation named like an XSS payload that raises with the payload as its message."""

    def explode(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(PAYLOAD)

    return run_compare(explode, PAYLOAD, examples=5).to_json()


def _with_optional_sections(report: dict[str, Any]) -> dict[str, Any]:
    report = copy.deepcopy(report)
    report["diagnosis"] = {
        "status": "matched",
        "examples_compared": 60,
        "matches": [{"variant": "one_extra_removed", "description": "removes one token too many", "source": "controls.py"}],
        "closest": [
            {"variant": "strict_stop", "description": "stops on < tau", "agreed": 58, "of": 60, "first_difference": "keep at (0, 1)"}
        ],
    }
    report["validation"] = {
        "strict": True,
        "probes": [
            {"probe": "nan_logp", "description": "NaN in a valid logp", "status": "rejected", "message": "ValueError: logp is not finite"},
            {"probe": "shape_mismatch", "description": "advantages of another shape", "status": "accepted", "message": ""},
            {"probe": "huge_batch", "description": "a 1e9-token batch", "status": "hung", "message": "timed out after 30 s"},
        ],
    }
    return report


def _poison(report: dict[str, Any]) -> dict[str, Any]:
    """Put hostile text in every kind of string field the implementation or a hand-edited file could reach."""
    report = _with_optional_sections(report)
    report["implementation"] = PAYLOAD
    report["verdict"] = ATTRIBUTE  # lands in a class attribute: must not break out of it
    report["options"]["dtype"] = PAYLOAD
    report["duration_s"] = PAYLOAD
    report["checks"][0]["description"] = PAYLOAD
    report["checks"][0]["status"] = ATTRIBUTE
    report["tolerances"][0]["dtype"] = PAYLOAD
    report["environment"][PAYLOAD] = PAYLOAD
    cx = report["counterexamples"][0]
    cx["check"] = ATTRIBUTE
    cx["summary"] = PAYLOAD
    cx["replay"] = "m2po-oracle replay --impl " + PAYLOAD
    cx["mismatches"][0]["details"] = [PAYLOAD]
    cx["mismatches"][0]["field"] = PAYLOAD
    cx["mismatches"][0]["actual"] = PAYLOAD
    cx["tokens"][0]["log_ratio"] = PAYLOAD
    cx["tokens"][0]["actual_grad"] = PAYLOAD
    cx["expected"]["loss"] = PAYLOAD
    cx["actual"][PAYLOAD] = 1.0
    cx["removal_curve"]["tau"] = PAYLOAD
    cx["removal_curve"]["prefix_means"] = [PAYLOAD, 0.5]
    report["diagnosis"]["status"] = ATTRIBUTE
    report["diagnosis"]["matches"][0]["variant"] = PAYLOAD
    report["diagnosis"]["closest"][0]["first_difference"] = PAYLOAD
    report["diagnosis"].update(
        summary=PAYLOAD,
        components=[PAYLOAD, "float32_metrics"],
        by_check={report["checks"][1]["name"]: [PAYLOAD, ATTRIBUTE]},
        unexplained=[PAYLOAD],
        alternatives=[[PAYLOAD, ATTRIBUTE]],
        findings=[{"kind": PAYLOAD, "checks": [PAYLOAD], "summary": PAYLOAD}],
        hints=[{"checks": [PAYLOAD], "text": PAYLOAD, "option": PAYLOAD}],
    )
    report["checks"][1]["status"] = "fail"  # so the explained-by cell shows the hostile names
    cx["cause"], cx["checks"] = PAYLOAD, [PAYLOAD, ATTRIBUTE]
    report["counterexamples"].append({**copy.deepcopy(cx), "cause": ATTRIBUTE})  # a cause group heading below
    report["validation"]["probes"][0]["message"] = PAYLOAD
    report["validation"]["probes"][1]["status"] = ATTRIBUTE
    return report


def _assert_no_injection(html: str) -> None:
    lowered = html.lower()
    assert "<script" not in lowered, "a script element reached the page"
    assert "<img" not in lowered, "an img element reached the page"
    assert 'onmouseover="' not in lowered, "an attribute broke out of its quotes"
    assert str(markupsafe.escape(PAYLOAD)) in html, "the payload should be shown, escaped"


# --- helpers -------------------------------------------------------------------------------


class _Tables(HTMLParser):
    """Rows of every <table>, keyed by its class: [(row class, [(cell class, text)])]."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[tuple[str, list[tuple[str, str]]]]] = {}
        self._table: str | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        cls = dict(attrs).get("class") or ""
        if tag == "table":
            self._table = cls
            self.tables.setdefault(cls, [])
        elif tag == "tr" and self._table is not None:
            self.tables[self._table].append((cls, []))
        elif tag in ("td", "th") and self._table is not None and self.tables[self._table]:
            self.tables[self._table][-1][1].append((cls, ""))
            self._cell = []

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None and self._table is not None:
            cls, _ = self.tables[self._table][-1][1][-1]
            self.tables[self._table][-1][1][-1] = (cls, "".join(self._cell).strip())
            self._cell = None
        elif tag == "table":
            self._table = None


def _tables(html: str) -> dict[str, list[tuple[str, list[tuple[str, str]]]]]:
    parser = _Tables()
    parser.feed(html)
    return parser.tables


def _attr(html: str, cls: str, attribute: str) -> list[str]:
    return re.findall(rf'class="{re.escape(cls)}"[^>]*?\s{attribute}="([^"]*)"', html)


def _curve_report(base: dict[str, Any], **curve: Any) -> dict[str, Any]:
    report = copy.deepcopy(base)
    report["counterexamples"][0]["removal_curve"].update(curve)
    return report


# --- content -------------------------------------------------------------------------------


def test_divergent_report_shows_verdict_checks_replay_and_counterexample(divergent):
    html = render_html(divergent)
    assert html.startswith("<!DOCTYPE html>") and html.rstrip().endswith("</html>")
    assert re.search(r'<div id="verdict" class="verdict bad" data-verdict="divergent">\s*<span class="word">divergent</span>', html)
    for check in divergent["checks"]:
        assert f">{check['name']}<" in html, check["name"]
    (cx,) = divergent["counterexamples"]
    assert str(markupsafe.escape(cx["replay"])) in html
    assert str(markupsafe.escape(cx["summary"])) in html
    rows = _tables(html)["checks"][1:]
    failing = [row for row in rows if row[0] == "fail"]
    assert [cells[0][1] for _, cells in failing] == [c["name"] for c in divergent["checks"] if c["status"] == "fail"]
    assert all(cells[3][1] != "0" for _, cells in failing)
    assert len(_tables(html)["tokens"]) - 1 == len(cx["tokens"])
    # Optional sections appear exactly when the report carries them.
    assert ('id="explanation"' in html) == ("diagnosis" in divergent) and ('id="validation"' in html) == ("validation" in divergent)


def test_equivalent_report_is_green_with_no_counterexamples(equivalent):
    html = render_html(equivalent)
    assert 'class="verdict ok" data-verdict="equivalent"' in html
    assert "no check failed" in html
    assert 'class="tokens"' not in html and "<svg" not in html
    assert not [row for row in _tables(html)["checks"] if row[0] == "fail"]


def test_page_references_no_external_resource(divergent, equivalent, hostile):
    for report in (divergent, equivalent, hostile, _with_optional_sections(divergent)):
        html = render_html(report)
        assert not re.search(r"\b(?:src|href|action|poster|xlink:href)\s*=\s*[\"']?\s*(?:[a-z][a-z0-9+.-]*:)?//", html, re.I)
        assert not re.search(r"url\s*\(", html, re.I)
        assert "@import" not in html and "<link" not in html.lower() and "<script" not in html.lower()
        assert not re.search(r"https?://", html), "an absolute URL on an offline page"


def test_hostile_strings_are_escaped_everywhere(divergent):
    _assert_no_injection(render_html(_poison(divergent)))


def test_a_raising_implementation_with_a_hostile_name_renders_escaped_and_unusable(hostile):
    assert hostile["verdict"] == "unusable" and hostile["counterexamples"][0]["actual"] == {}
    html = render_html(hostile)
    _assert_no_injection(html)
    assert 'data-verdict="unusable"' in html and 'class="verdict bad"' in html
    assert "returned no result" in html
    if hostile["counterexamples"][0]["removal_curve"]["candidates"] == 0:  # shrinking usually ends on one padding token
        assert "No trust-region tokens" in html
    ((_, header), *rows) = _tables(html)["tokens"]
    assert [text for _, text in header][7] == "actual keep"
    assert all("diff" in cells[7][0] and cells[7][1] == "\u2014" for _, cells in rows), "a missing actual keep is flagged"


def test_diagnosis_and_validation_sections_render_when_present(divergent):
    html = render_html(_with_optional_sections(divergent))
    assert 'id="explanation"' in html and "one_extra_removed" in html and "agreed on 58 of 60" in html and "keep at (0, 1)" in html
    assert 'id="validation"' in html
    rows = {cells[0][1]: (row_cls, cells) for row_cls, cells in _tables(html)["probes"][1:]}
    assert rows["shape_mismatch"][0] == "warn" and "badge warn" in rows["shape_mismatch"][1][2][0] + html
    assert "WARNING" in rows["shape_mismatch"][1][2][1]
    assert rows["nan_logp"][0] == "" and rows["huge_batch"][0] == "fail"
    assert "1 invalid input(s) were silently accepted" in html


# --- the explanation (diagnosis schema with components, by_check, unexplained, ...) ----------

FAILING = ("loss", "gradient", "metrics.m2_before", "metrics.m2_after", "padding_immunity")
COMPONENTS = {
    "clamped_log_ratio": ("straight-through clamp of d to +-20", "algorithm.md §3 (ms-swift, Trinity-RFT guard)"),
    "float32_metrics": ("logged metrics computed in float32", "algorithm.md §4"),
    "nan_padding_leak": ("padding zeroed by multiplying with the mask: 0 * nan = nan", "plausible port bug"),
}
BY_CHECK = {
    "loss": ["clamped_log_ratio"],
    "gradient": ["clamped_log_ratio"],
    "metrics.m2_before": ["float32_metrics"],
    "padding_immunity": ["nan_padding_leak"],
}
# (check, cause, checks it demonstrates) of each counterexample, in report order: the first is shown at the top.
CAUSES = [
    ("loss", "clamped_log_ratio", ["loss", "gradient"]),
    ("metrics.m2_after", None, ["metrics.m2_after"]),
    ("padding_immunity", "nan_padding_leak", ["padding_immunity"]),
    ("metrics.m2_before", "float32_metrics", ["metrics.m2_before"]),
    ("gradient", "clamped_log_ratio", ["gradient"]),
]


def _explained(base: dict[str, Any], status: str = "partly_explained") -> dict[str, Any]:
    """A divergent report (a real one, its diagnosis replaced) whose failures three deviations explain but one."""
    report = copy.deepcopy(base)
    for check in report["checks"]:
        failing = check["name"] in FAILING
        check.update(status="fail" if failing else "pass", failures=7 if failing else 0)
    report["diagnosis"] = {
        "status": status,
        "examples_compared": 60,
        "summary": "partly explained: loss, gradient by clamped_log_ratio; metrics.m2_before by float32_metrics; "
        "padding_immunity by nan_padding_leak; metrics.m2_after unexplained",
        "components": list(COMPONENTS),
        "by_check": {**BY_CHECK, "call": ["clamped_log_ratio"]},  # "call" passes: it shows nothing
        "unexplained": ["metrics.m2_after"],
        "matches": [
            {"variant": name, "description": description, "source": source, "evidence": f"reproduces {name} on all 60 examples"}
            for name, (description, source) in COMPONENTS.items()
        ],
        "alternatives": [["slime_pr"], ["hard_clamped_log_ratio", "float32_metrics"]],
        "closest": [
            {
                "variant": "all_valid_candidates",
                "description": "every valid token is a candidate",
                "source": "algorithm.md §3",
                "agreed": 0,
                "of": 60,
                "first_difference": "keep differs at (1, 1)",
            },
            {
                "variant": "hard_clamped_log_ratio",
                "description": "hard clamp of d to +-20",
                "source": "algorithm.md §4",
                "agreed": 12,
                "of": 60,
                "first_difference": "gradient at (0, 1): variant 0.0, implementation 1.5",
            },
        ],
        "findings": [
            {
                "kind": "non_finite_result",
                "checks": ["loss"],
                "summary": "the loss is NaN on 12 batches whose inputs are finite on every valid token",
            }
        ],
        "hints": [
            {
                "checks": ["metrics.m2_before"],
                "text": "every failure of metrics.m2_before fits float32 rounding",
                "option": "--compute-dtype float32",
            }
        ],
    }
    cx = base["counterexamples"][0]
    report["counterexamples"] = [{**copy.deepcopy(cx), "check": check, "cause": cause, "checks": checks} for check, cause, checks in CAUSES]
    return report


def _section(html: str, section_id: str) -> str:
    """The markup of ``<section id=...>`` (sections are not nested on this page)."""
    match = re.search(rf'<section id="{section_id}"[^>]*>.*?</section>', html, re.DOTALL)
    assert match, f"no section {section_id}"
    return match.group(0)


def test_check_table_says_what_explains_each_failing_check(divergent):
    report = _explained(divergent)
    html = render_html(report)
    ((_, header), *rows) = _tables(html)["checks"]
    assert [text for _, text in header][-1] == "explained by"
    cells = {row[0][1]: row for _, row in rows}
    for name, row in cells.items():
        expected = ", ".join(BY_CHECK[name]) if name in BY_CHECK else "unexplained" if name == "metrics.m2_after" else ""
        assert row[-1][1] == expected, name
    # Each name links to its row in the explanation, which carries its description.
    table = re.search(r'<table class="checks">.*?</table>', html, re.DOTALL).group(0)
    links = dict(re.findall(r'<a class="deviation mono" href="#([^"]+)">([^<]+)</a>', table))
    assert set(links.values()) == {"clamped_log_ratio", "float32_metrics", "nan_padding_leak"}
    explanation = _section(html, "explanation")
    for anchor, name in links.items():
        row = re.search(rf'<tr id="{anchor}" class="deviation">.*?</tr>', explanation, re.DOTALL)
        assert row and name in row.group(0) and str(markupsafe.escape(COMPONENTS[name][0])) in row.group(0), name
    # "unexplained" is a warning, on the unexplained check only.
    m2_after = re.search(r'<tr class="fail">\s*<td class="mono"><a href="#cx-\d+">metrics\.m2_after</a>.*?</tr>', table, re.DOTALL).group(0)
    assert '<span class="badge warn">unexplained</span>' in m2_after and table.count("badge warn") == 1


def test_an_old_report_without_the_new_keys_has_an_empty_explained_by_column(divergent):
    report = _with_optional_sections(divergent)  # the diagnosis schema before by_check and components
    for key in ("cause", "checks"):
        report["counterexamples"][0].pop(key, None)
    html = render_html(report)
    ((_, header), *rows) = _tables(html)["checks"]
    assert [text for _, text in header][-1] == "explained by" and all(row[-1][1] == "" for _, row in rows)
    explanation = _section(html, "explanation")
    # Its matches are still shown, as variants that reproduce the failures; the old table of closest variants too.
    assert "Known variants that reproduce the failing examples" in explanation and "one_extra_removed" in explanation
    assert "removes one token too many" in explanation and "agreed on 58 of 60" in explanation
    assert '<p class="cause' not in html and 'class="cause-heading"' not in html


def test_an_unexplained_check_with_a_residual_is_said_unexplained_once(divergent):
    """Planted: the residual paragraph of an unexplained check already says that no known
    deviation explains it; the bare line repeats only checks without such a paragraph."""
    report = _explained(divergent)
    residual = {
        "checks": ["metrics.m2_after"],
        "unexplained": True,
        "count": 7,
        "contradicted": 0,
        "features": [],
        "shared": [],
        "float32_fits": None,
        "explanation": [],
        "counterexample": {"difference": "m2_after: variant 0.5, implementation 0.6", "replay": None},
    }
    report["diagnosis"]["residuals"] = [residual]
    explanation = _section(render_html(report), "explanation")
    assert "no known deviation explains this check, and these are what its failing examples share" in explanation
    assert "no known deviation reproduces this failure" not in explanation
    report["diagnosis"]["residuals"] = [{**residual, "checks": ["loss"]}]  # another check's residual leaves the line
    assert "metrics.m2_after</span>: no known deviation reproduces this failure" in _section(render_html(report), "explanation")


def test_explanation_box_comes_first_with_components_findings_hints_and_the_first_counterexample(divergent):
    report = _explained(divergent)
    html = render_html(report)
    explanation = _section(html, "explanation")
    # Right after the verdict header, before every other section.
    sections = re.findall(r'<section id="([^"]+)"', html)
    assert sections[0] == "explanation" and html.index('id="verdict"') < html.index('<section id="explanation"')
    assert {"checks", "validation", "counterexamples"} <= set(sections[1:])
    assert "loss, gradient by clamped_log_ratio; metrics.m2_before by float32_metrics" in explanation
    ((_, header), *rows) = _tables(explanation)["explanation-components"]
    assert [text for _, text in header] == ["deviation", "what it does", "source", "explains", "evidence"]
    assert [(cells[0][1], cells[1][1], cells[2][1], cells[3][1]) for _, cells in rows] == [
        ("clamped_log_ratio", *COMPONENTS["clamped_log_ratio"], "loss, gradient"),
        ("float32_metrics", *COMPONENTS["float32_metrics"], "metrics.m2_before"),
        ("nan_padding_leak", *COMPONENTS["nan_padding_leak"], "padding_immunity"),
    ]
    assert "metrics.m2_after</span>: no known deviation reproduces this failure" in explanation
    alternatives = re.search(r'<p class="alternatives">(.*?)</p>', explanation, re.DOTALL).group(1)
    assert re.sub(r"<[^>]+>", "", alternatives).split(":")[1].split() == [
        "slime_pr;",
        "hard_clamped_log_ratio",
        "+",
        "float32_metrics",
        "(the",
        "examples",
        "do",
        "not",
        "tell",
        "them",
        "apart).",
    ]
    assert (
        "the loss is NaN on 12 batches whose inputs are finite on every valid token" in explanation and "non_finite_result" in explanation
    )
    assert "every failure of metrics.m2_before fits float32 rounding: try <code>--compute-dtype float32</code>" in explanation
    # The first counterexample, with its cause linked to the component; the others stay below.
    assert explanation.count('<article class="cx"') == 1 and '<article class="cx" id="cx-1">' in explanation
    top = re.search(r'<article class="cx" id="cx-1">.*?</article>', explanation, re.DOTALL).group(0)
    assert re.search(
        r'<p class="cause" data-cause="clamped_log_ratio">cause:\s*<a class="deviation mono" href="#deviation-1">clamped_log_ratio</a>', top
    )
    assert "also shows gradient" in top
    assert len(_tables(top)["tokens"]) - 1 == len(report["counterexamples"][0]["tokens"])


def test_remaining_counterexamples_are_grouped_by_cause(divergent):
    html = render_html(_explained(divergent))
    below = _section(html, "counterexamples")
    assert 'id="cx-1"' not in below and "Counterexample 1 is shown at the top" in below
    groups = re.findall(
        r'<div class="cause-group" data-kind="(\w+)" data-cause="([^"]*)">(.*?)</div>\s*(?=<div class="cause-group"|</section>)',
        below,
        re.DOTALL,
    )
    # The explanation's component order, the unexplained last; report order within a group.
    assert [(kind, cause, re.findall(r'<article class="cx" id="(cx-\d+)"', body)) for kind, cause, body in groups] == [
        ("cause", "clamped_log_ratio", ["cx-5"]),
        ("cause", "float32_metrics", ["cx-4"]),
        ("cause", "nan_padding_leak", ["cx-3"]),
        ("unexplained", "", ["cx-2"]),
    ]
    assert re.search(r'<h3 class="cause-heading">Caused by <a class="deviation mono" href="#deviation-2">float32_metrics</a></h3>', below)
    assert re.search(r'<p class="cause" data-cause="">cause:\s*<span class="badge warn">unexplained</span>', below)


def test_counterexamples_without_a_cause_keep_one_flat_list(divergent):
    report = _explained(divergent)
    for cx in report["counterexamples"]:
        del cx["cause"], cx["checks"]
    below = _section(render_html(report), "counterexamples")
    assert 'class="cause-heading"' not in below and '<p class="cause' not in below
    assert re.findall(r'<article class="cx" id="(cx-\d+)"', below) == ["cx-2", "cx-3", "cx-4", "cx-5"]


@pytest.mark.parametrize(
    ("status", "word"),
    [("matched", "explained"), ("partly_explained", "partly explained"), ("no_known_variant", "no known deviation explains it")],
)
def test_diagnosis_status_wording(divergent, status, word):
    explanation = _section(render_html(_explained(divergent, status)), "explanation")
    assert re.search(rf'<p class="status-line"><span class="badge \w+">{word}</span>', explanation)
    assert f'data-status="{status}"' in explanation
    if status == "partly_explained":  # the summary's own lead is not repeated after the badge
        assert "partly explained: loss" not in explanation


@pytest.mark.parametrize("status", ["not_needed", "not_run"])
def test_nothing_to_explain_shows_one_line(divergent, status):
    html = render_html(_explained(divergent, status))  # even with content under the other keys
    assert '<section id="explanation"' not in html and '<a href="#explanation">Explanation</a>' not in html
    (note,) = re.findall(r'<p class="note [^"]*explanation-note" id="explanation" data-status="([^"]+)">([^<]*)</p>', html)
    assert note[0] == status and note[1] == html_module.DIAGNOSIS_NOTE[status] and "\n" not in note[1]
    for absent in ("explanation-components", "slime_pr", "the loss is NaN", "--compute-dtype float32", "hard_clamped_log_ratio"):
        assert absent not in html, absent
    assert html.index('<section id="counterexamples"') < html.index('id="cx-1"'), "the first counterexample stays in its section"
    assert all(row[-1][1] == "" for _, row in _tables(html)["checks"][1:]), "nothing links to a box that is not drawn"
    assert '<p class="cause' not in html and 'class="cause-heading"' not in html, "no cause, not even 'unexplained', without a diagnosis"


def test_closest_lists_only_variants_that_agree_somewhere(divergent):
    report = _explained(divergent, "no_known_variant")
    report["diagnosis"].update(components=[], by_check={}, matches=[])
    report["diagnosis"]["closest"] += [
        {"variant": v, "agreed": a, "of": 60}
        for v, a in (("agreed_none", None), ("agreed_junk", "many"), ("agreed_nan", "nan"), ("agreed_negative", -1))
    ]
    html = render_html(report)
    closest = _tables(_section(html, "explanation"))["diagnosis-closest"][1:]
    assert [(cells[0][1], cells[3][1]) for _, cells in closest] == [("hard_clamped_log_ratio", "agreed on 12 of 60")]
    assert "all_valid_candidates" not in html and "agreed_" not in html
    assert re.search(r'<details class="closest" open>', html), "with nothing explained, the closest variants are the lead: open"
    # The template filters too, whatever the view model hands it.
    view = html_module.view(report)
    view["diagnosis"]["closest"].append({**view["diagnosis"]["closest"][0], "variant": "sneaked_in", "agreed_n": 0})
    assert "sneaked_in" not in environment().get_template(html_module.TEMPLATE).render(r=view)
    view["diagnosis"]["closest"] = view["diagnosis"]["closest"][1:]
    assert "No known variant agrees" in environment().get_template(html_module.TEMPLATE).render(r=view)


def test_removed_tokens_are_labelled_removed_not_mask(divergent):
    report = copy.deepcopy(divergent)
    base = {"valid": True, "log_ratio": 0.5, "advantage": 1.0, "m2": 0.125, "trust_region": True, "expected_grad": 0.0, "actual_grad": 0.0}
    report["counterexamples"][0]["tokens"] = [
        {**base, "index": [0, 0], "expected_keep": True, "actual_keep": False},
        {**base, "index": [0, 1], "m2": 0.25, "expected_keep": False, "actual_keep": True},
    ]  # not a tie
    rows = _tables(render_html(report))["tokens"][1:]
    assert [(cells[6], cells[7][1]) for _, cells in rows] == [(("keep-keep", "keep"), "removed"), (("keep-removed", "removed"), "keep")]
    assert all(text != "mask" for _, cells in rows for _, text in cells)


def test_negative_zero_is_printed_as_zero(divergent):
    fmt, short = values.fmt, values.fmt_short
    assert fmt(-0.0) == fmt(0.0) == "0" and short(-0.0) == short(0.0) == "0"
    assert fmt([-0.0, [0.0, -0.0]]) == "[0, [0, 0]]" and values.index_text([-0.0, 1]) == "(0, 1)"
    assert values.duration_text(-0.0) == values.duration_text(-0.04) == "0.0 s" and values.rounded(-0.0) == 0.0
    assert str(values.rounded(-0.001)) == "0.0"
    assert fmt(-1e-300) == "-1e-300" and short(-2.5e-7) == "-2.5e-07", "a small negative number keeps its sign"
    report = _explained(divergent)
    report["duration_s"] = -0.0
    report["options"]["tau"] = -0.0
    report["tolerances"][0]["atol"] = -0.0
    cx = report["counterexamples"][0]
    for token in cx["tokens"]:
        token.update(log_ratio=-0.0, advantage=-0.0, m2=-0.0, expected_grad=-0.0, actual_grad=-0.0)
    for side in ("expected", "expected_on_actual_mask", "actual"):
        cx[side] = {**cx[side], "loss": -0.0, "m2_before": -0.0}
    cx["mismatches"][0].update(actual=-0.0, expected=[-0.0, 0.0], index=[-0.0, 0])
    cx["removal_curve"].update(tau=-0.0, prefix_means=[-0.0, 0.0, 0.5], candidates=3)
    cx["trainer_case"] = {"seed": -0.0, "lags": [-0.0, 1], "split": [[-0.0, 2]], "trainer": {"loss": -0.0, "rewards": [-0.0, 1.0]}}
    cx["ranks"] = [_dist_rank(0, 0, 0, 0, MASK, loss=-0.0)]
    report["diagnosis"]["closest"][1].update(agreed=12.0, of=-0.0)
    html = render_html(report)
    body = re.sub(
        r'<pre class="replay">.*?</pre>', "", html[html.index("<body>") :], flags=re.DOTALL
    )  # the replay is a command, kept verbatim
    assert "-0.0" not in body
    assert not re.search(r"(?<![\w.\-])-0(?![\w.])", body), re.search(r".{40}(?<![\w.\-])-0(?![\w.]).{40}", body)
    assert not re.search(r'="-0(?:\.0)?"', html), "an SVG coordinate or attribute is -0"


def test_token_table_highlights_differences_and_greys_padding(divergent):
    report = copy.deepcopy(divergent)
    base = {
        "valid": True,
        "log_ratio": 0.5,
        "advantage": 1.0,
        "m2": 0.125,
        "trust_region": True,
        "expected_keep": True,
        "actual_keep": True,
        "expected_grad": -0.25,
        "actual_grad": -0.25,
    }
    variants = [
        {},  # agrees
        {"actual_keep": False},  # keep differs
        {"actual_grad": -0.25 * (1 + 1e-12)},  # rounding: not a difference
        {"actual_grad": -0.25 * (1 + 1e-6)},  # a real difference
        {"actual_grad": None},  # missing
        {"actual_grad": "nan"},  # non-finite
        {
            "valid": False,
            "log_ratio": None,
            "m2": None,
            "trust_region": False,
            "expected_keep": False,
            "actual_keep": False,
            "expected_grad": 0.0,
            "actual_grad": 0.0,
        },  # padding
    ]
    report["counterexamples"][0]["tokens"] = [{**base, "index": [0, t], **v} for t, v in enumerate(variants)]
    rows = _tables(render_html(report))["tokens"][1:]
    keep_diff = ["diff" in cells[7][0] for _, cells in rows]
    grad_diff = ["diff" in cells[9][0] for _, cells in rows]
    assert keep_diff == [False, True, False, False, False, False, False]
    assert grad_diff == [False, False, False, True, True, True, False]
    assert [cls for cls, _ in rows] == ["valid"] * 6 + ["padding"]
    assert rows[4][1][9][1] == "\u2014" and rows[5][1][9][1] == "nan"


def test_token_table_prints_m2_values_apart_in_the_last_bits_apart(divergent):
    """Six digits made four tokens whose M2 differ in the last bits (Trinity-RFT's float32
    sort put the cut between them) read 0.729454 each: a column takes as many digits as
    its distinct values need, and stays at six where they do not."""
    report = copy.deepcopy(divergent)
    base = {
        "valid": True,
        "advantage": 1.0,
        "trust_region": True,
        "expected_keep": True,
        "actual_keep": True,
        "expected_grad": -0.25,
        "actual_grad": -0.25,
    }
    close = [(0.8540811, 0.7294538172817457), (0.8540811, 0.729453817281745), (0.5, 0.25), (None, None)]
    report["counterexamples"][0]["tokens"] = [{**base, "index": [0, t], "log_ratio": r, "m2": m} for t, (r, m) in enumerate(close)]
    rows = _tables(render_html(report))["tokens"][1:]
    m2_texts = [cells[4][1] for _, cells in rows]
    assert m2_texts[0] != m2_texts[1] and m2_texts[2:] == ["0.25", "\u2014"], m2_texts
    assert abs(float(m2_texts[0]) - close[0][1]) < abs(float(m2_texts[0]) - close[1][1]), "the digits shown tell which is larger"
    assert [cells[2][1] for _, cells in rows] == ["0.854081", "0.854081", "0.5", "\u2014"], "equal values keep six digits"
    assert values.column_texts([1.0 + 2**-40, 1.0, -0.0, float("nan")]) == ["1.000000000001", "1", "0", "nan"]


@pytest.mark.parametrize("lost_m2, swapped", [(0.125, True), (0.25, False)])
def test_a_mask_that_keeps_another_of_equal_m2_tokens_is_a_tie_not_a_difference(divergent, lost_m2, swapped):
    """Algorithm 1 keeps the lowest-index of tied tokens; a port that keeps another one of
    equal M2 made an admissible choice: marked "tie", not highlighted, not counted as a row
    that differs (seen on Trinity-RFT's mask, whose float32 sort ordered a tie otherwise).
    Unequal M2 stays a difference."""
    report = copy.deepcopy(divergent)
    base = {
        "valid": True,
        "log_ratio": 0.5,
        "advantage": 1.0,
        "m2": 0.125,
        "trust_region": True,
        "expected_keep": True,
        "actual_keep": True,
        "expected_grad": -0.25,
        "actual_grad": -0.25,
    }
    report["counterexamples"][0]["tokens_truncated"] = False
    report["counterexamples"][0]["tokens"] = [
        {**base, "index": [0, 0]},
        {**base, "index": [0, 1], "expected_keep": False, "actual_keep": True},  # kept instead
        {**base, "index": [0, 2], "m2": lost_m2, "actual_keep": False},  # of this one
    ]
    page = render_html(report)
    rows = _tables(page)["tokens"][1:]
    assert [("diff" in cells[7][0]) for _, cells in rows] == [False, not swapped, not swapped]
    assert ("(tie)" in page) == swapped and (("0 row(s) differ; 2 row(s) keep another" in page) == swapped)


def test_metrics_table_compares_actual_with_expected_on_the_implementations_mask(divergent):
    report = copy.deepcopy(divergent)
    cx = report["counterexamples"][0]
    cx["actual"] = dict(cx["expected_on_actual_mask"], loss=123.0)
    rows = {cells[0][1]: cells for _, cells in _tables(render_html(report))["metrics"][1:]}
    assert "diff" in rows["loss"][3][0] and rows["loss"][3][1] == "123.0"
    assert not any("diff" in cells[3][0] for name, cells in rows.items() if name != "loss")


# --- removal curve -------------------------------------------------------------------------


def test_removal_curve_marks_where_the_oracle_and_the_implementation_stop(divergent):
    html = render_html(divergent)
    curve = divergent["counterexamples"][0]["removal_curve"]
    n = curve["candidates"]
    assert n >= 1 and _attr(html, "removal-curve", "data-candidates") == [str(n)]
    assert curve["oracle_kept_min"] == curve["oracle_kept_max"]
    assert _attr(html, "oracle-stop", "data-removed") == [str(n - curve["oracle_kept_max"])]
    assert _attr(html, "impl-stop", "data-removed") == [str(n - curve["implementation_kept"])]
    assert len(re.findall(r'<line class="tau"', html)) == 1
    # One vertex per removal count r = 0..n-1, left to right, at P_{n-r}: higher mean, higher on the page (smaller y).
    (points,) = _attr(html, "curve", "points")
    xy = [tuple(map(float, p.split(","))) for p in points.split()]
    means = [curve["prefix_means"][n - 1 - r] for r in range(n)]
    assert len(xy) == n and [x for x, _ in xy] == sorted(x for x, _ in xy)
    # Means closer than the plot resolves (a millionth of their range) may share a pixel row.
    resolution = 1e-6 * (max(means) - min(means))
    for (_, y1), (_, y2), m1, m2 in zip(xy, xy[1:], means, means[1:]):
        if abs(m1 - m2) <= resolution:
            assert abs(y1 - y2) <= 0.01 and (m1 != m2 or y1 == y2)
        else:
            assert (y1 < y2) == (m1 > m2)


def test_removal_curve_band_when_the_oracle_stop_is_ambiguous(divergent):
    report = _curve_report(
        divergent, prefix_means=[0.01, 0.02, 0.03, 0.2], candidates=4, tau=0.03, oracle_kept_min=1, oracle_kept_max=3, implementation_kept=4
    )
    html = render_html(report)
    assert re.search(r'<rect class="oracle-stop" data-removed="1-3"', html)
    assert _attr(html, "impl-stop", "data-removed") == ["0"]
    assert "rounding band" in html


def test_removal_curve_uses_a_log_axis_only_for_a_wide_spread(divergent):
    wide = render_html(_curve_report(divergent, prefix_means=[1e-300, 1e-10, 1e300], candidates=3, tau=1e-12))
    assert _attr(wide, "removal-curve", "data-log") == ["true"] and "(log scale)" in wide
    narrow = render_html(_curve_report(divergent, prefix_means=[0.1, 0.2, 0.3], candidates=3, tau=0.15))
    assert _attr(narrow, "removal-curve", "data-log") == ["false"] and "(log scale)" not in narrow


def _junk_report(_: dict[str, Any]) -> dict[str, Any]:
    return {
        "verdict": None,
        "checks": [None, "x", {"name": 3}],
        "counterexamples": [None, "x", {"removal_curve": "bad", "tokens": [None, 3], "mismatches": "oops", "actual": None, "shape": "?"}],
        "tolerances": None,
        "environment": "text",
        "options": [],
        "diagnosis": None,
        "validation": {"probes": [None, {"status": 7}]},
    }


def _empty_actual(report: dict[str, Any]) -> dict[str, Any]:
    cx = report["counterexamples"][0]
    cx["actual"], cx["expected_on_actual_mask"] = {}, {}
    cx["removal_curve"]["implementation_kept"] = None
    for token in cx["tokens"]:
        token["actual_keep"] = token["actual_grad"] = None
    return report


def _junk_explanation(report: dict[str, Any]) -> dict[str, Any]:
    """The new diagnosis keys with every wrong type a hand-edited or newer report could hold."""
    report["diagnosis"] = {
        "status": "partly_explained",
        "summary": None,
        "components": "clamped_log_ratio",
        "by_check": [1, 2],
        "unexplained": 3,
        "matches": [None, {"variant": None}, {"variant": 7, "checks": "loss"}],
        "alternatives": "slime_pr",
        "closest": [None, {"agreed": "nan"}, {"agreed": True}, {"agreed": 1e400}],
        "findings": [None, 3, {"checks": "loss"}],
        "hints": {"text": "x"},
        "examples_compared": {"a": 1},
    }
    cx = report["counterexamples"][0]
    cx["cause"], cx["checks"] = 5, "loss"
    report["counterexamples"] += [{**copy.deepcopy(cx), "cause": ""}, {**copy.deepcopy(cx), "cause": "a + b"}, {"cause": None}]
    return report


ODD_INPUTS = {
    "junk explanation": _junk_explanation,
    "explanation keys missing": lambda r: {**r, "diagnosis": {"status": "partly_explained"}},
    "diagnosis not a mapping": lambda r: {**r, "diagnosis": ["matched"]},
    "empty dict": lambda r: {},
    "junk types": _junk_report,
    "no optional sections": lambda r: {k: v for k, v in r.items() if k not in ("diagnosis", "validation")},
    "no counterexamples": lambda r: {**r, "counterexamples": []},
    "empty actual": _empty_actual,
    "non-finite prefix means": lambda r: _curve_report(
        r, prefix_means=[0.01, 0.02, "inf", "nan", None, "-inf", 1e300, 2e300], candidates=8
    ),
    "zero candidates": lambda r: _curve_report(
        r, prefix_means=[], candidates=0, oracle_kept_min=0, oracle_kept_max=0, implementation_kept=0
    ),
    "single point": lambda r: _curve_report(
        r, prefix_means=[0.5], candidates=1, oracle_kept_min=0, oracle_kept_max=0, implementation_kept=1
    ),
    "all equal": lambda r: _curve_report(r, prefix_means=[0.0, 0.0], candidates=2, tau=0.0),
    "near overflow": lambda r: _curve_report(r, prefix_means=[-1.7e308, 1.7e308, 1.79e308], candidates=3, tau=1.78e308),
    "subnormal": lambda r: _curve_report(r, prefix_means=[5e-324, 1e-320, 1.0], candidates=3, tau=5e-324),
    "non-finite tau": lambda r: _curve_report(r, tau="inf"),
    "truncated curve": lambda r: _curve_report(
        r, prefix_means=[i / 512 for i in range(512)], candidates=600, oracle_kept_max=300, oracle_kept_min=300, implementation_kept=299
    ),
    "implementation off the axis": lambda r: _curve_report(r, implementation_kept=10**9, oracle_kept_min=None),
    "odd scalars": lambda r: {**r, "duration_s": "nan", "examples": None, "options": {"tau": 0.25}},
}


@pytest.mark.parametrize("case", ODD_INPUTS)
def test_rendering_tolerates_odd_and_partial_reports(divergent, case):
    report = ODD_INPUTS[case](copy.deepcopy(divergent))
    html = render_html(report)
    assert html.startswith("<!DOCTYPE html>") and html.rstrip().endswith("</html>")
    assert 'id="verdict"' in html and 'id="tolerances"' in html and 'id="environment"' in html
    assert "nan" not in " ".join(re.findall(r'(?:x|y|x1|x2|y1|y2|cx|cy|width|points)="([^"]*)"', html)).lower()
    if case == "zero candidates":
        assert "No trust-region tokens" in html and "<svg" not in html
    if case == "truncated curve":
        assert "Only the first 512 prefix means" in html
    if case == "non-finite prefix means":
        assert html.count('class="clipped"') == 2 and len(_attr(html, "curve", "points")) == 2  # the line breaks at gaps
    if case == "implementation off the axis":
        assert "off the axis" in html


def test_write_html_creates_the_file(divergent, tmp_path):
    path = tmp_path / "nested" / "report.html"
    write_html(divergent, path)
    assert path.read_text(encoding="utf-8") == render_html(divergent)


def test_the_renderer_does_not_import_torch():
    code = "import sys, m2po_oracle.report.html as h; h.render_html({}); sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


# --- distributed runs ----------------------------------------------------------------------
# Reports of real worlds (gloo, in-process runner) share the distributed tests' xdist group:
# several worlds at once oversubscribe the cores. The synthetic reports below need no world.

DISTRIBUTED = pytest.mark.xdist_group("distributed")
# Two controls that each fail one way only, so shrinking takes few world steps (the built-in
# controls fail five checks each and take several times longer).
IMPLS = f"""
from m2po_oracle.distributed.implementations import core_distributed


def diverging(logp, behavior_logp, advantages, mask, *, tau, parallel):
    result = core_distributed(logp, behavior_logp, advantages, mask, tau=tau, parallel=parallel)
    if parallel.coords.cp == 1:  # this CP replica reports its mask one kept token short
        keep = result["keep"].clone()
        kept = keep.nonzero()
        if len(kept):
            keep[tuple(kept[-1])] = False
        result["keep"] = keep
    return result


def raising(logp, behavior_logp, advantages, mask, *, tau, parallel):
    if parallel.coords.cp == 1:
        raise RuntimeError({PAYLOAD!r})
    return core_distributed(logp, behavior_logp, advantages, mask, tau=tau, parallel=parallel)
"""


def _distributed(spec: str, topology: Topology, examples: int, shrink: bool = True) -> dict[str, Any]:
    with DistributedRunner(spec, topology, timeout_s=60) as runner:
        return run_compare(runner, spec, examples=examples, shrink=shrink).to_json()


@pytest.fixture(scope="module")
def dist_impls(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("impls") / "dist_controls.py"
    path.write_text(IMPLS)
    return path


@pytest.fixture(scope="module")
def dist_divergent(dist_impls) -> dict[str, Any]:
    """CP rank 1 keeps one token fewer than its replica (seeded search, so every run alike)."""
    return _distributed(f"{dist_impls}:diverging", Topology(1, 2, 1), 10)


@pytest.fixture(scope="module")
def dist_equivalent() -> dict[str, Any]:
    """The core on four ranks: every rank calls collectives."""
    return _distributed("core", Topology(2, 1, 2), 10)


@pytest.fixture(scope="module")
def dist_raising(dist_impls) -> dict[str, Any]:
    """CP rank 1 raises with the payload as its message: a real rank traceback."""
    # Not shrunk: a call that raises on every batch is its own minimal case (shrinking took 30 s of worlds).
    return _distributed(f"{dist_impls}:raising", Topology(1, 2, 1), 3, shrink=False)


def _dist_rank(rank: int, dp: int, cp: int, tp: int, keep: Any, **extra: Any) -> dict[str, Any]:
    return {
        "rank": rank,
        "coords": {"dp": dp, "cp": cp, "tp": tp},
        "rows": [dp, dp + 1],
        "keep": keep,
        "loss": -0.25,
        "metrics": {},
        "collectives": {},
        "error": None,
        "stack": None,
        **extra,
    }


MASK = [[1, 1, 0, 0]]
ODD_MASK = [[1, 0, 0, 0]]  # rank 2's: one token differs from its replicas'
TRACEBACK = 'Traceback (most recent call last):\n  File "impl.py", line 3, in fn\n    raise RuntimeError(msg)\nRuntimeError: ' + PAYLOAD
STACK = 'Thread 0x1 (most recent call first):\n  File "impl.py", line 9 in ' + PAYLOAD


def _synthetic_distributed(base: dict[str, Any]) -> dict[str, Any]:
    """Eight ranks dp=2 x cp=2 x tp=2. In dp=0 rank 2 keeps another mask than ranks 0, 1, 3;
    dp=1 agrees. A second counterexample has a raising rank and a hung one."""
    report = copy.deepcopy(base)
    report["topology"] = {"dp": 2, "cp": 2, "tp": 2, "backend": "gloo"}
    coords = [(r // 4, r // 2 % 2, r % 2) for r in range(8)]
    sizes = [16, 1536, 3 * 1024 * 1024, 0, 16, 16, 16, 16]
    report["collectives_per_step"] = [
        {
            "rank": r,
            "coords": dict(zip(("dp", "cp", "tp"), c)),
            "collectives": {"all_gather": {"calls": 2, "bytes": sizes[r]}, **({"all_reduce": {"calls": 1, "bytes": 8}} if r != 3 else {})},
        }
        for r, c in enumerate(coords)
    ]
    report["validation"] = {"strict": False, "probes": []}
    cx = report["counterexamples"][0]
    cx["check"] = "distributed.replica_masks_identical"
    cx["ranks"] = [_dist_rank(r, *c, ODD_MASK if r == 2 else MASK if c[0] == 0 else [[0, 1, 1, 0]]) for r, c in enumerate(coords)]
    failing = copy.deepcopy(cx)
    failing["check"] = "call"
    failing["ranks"] = [_dist_rank(r, *c, MASK) for r, c in enumerate(coords)]
    failing["ranks"][5].update(keep=None, loss=None, error=TRACEBACK)
    failing["ranks"][6].update(keep=None, loss=None, stack=STACK)
    report["counterexamples"] = [cx, failing]
    return report


def _mask_cells(html: str) -> list[list[str]]:
    """Per row of each ranks table: the classes of its mask cells, in order."""
    rows = re.findall(r'<tr class="rank[^"]*">(.*?)</tr>', html, re.DOTALL)
    return [re.findall(r'<span class="(c [^"]*)">', row) for row in rows]


def _replica_divergent(ranks: list[dict[str, Any]]) -> list[bool]:
    """Independently of the renderer: does each rank share its dp with a rank keeping another mask?"""
    return [
        r["keep"] is not None
        and any(o["coords"]["dp"] == r["coords"]["dp"] and o["keep"] is not None and o["keep"] != r["keep"] for o in ranks)
        for r in ranks
    ]


@DISTRIBUTED
def test_distributed_report_shows_topology_ranks_and_highlights_replica_divergence(dist_divergent, equivalent):
    html = render_html(dist_divergent)
    assert "<dt>topology</dt><dd>dp=1, cp=2, tp=1 on gloo, 2 ranks</dd>" in html
    assert "<dt>topology</dt>" not in render_html(equivalent), "a single-process report has no topology"
    # The collective fail-closed probes run across the ranks as the validation.
    # (dp=1: a budget differing between DP ranks cannot be probed, so tau_differs is left out.)
    assert (
        'class="probes"' in html
        and "behavior_logp_missing" in html
        and "every rank (2) raised within" in html
        and "tau_differs" not in html
    )
    with_ranks = [cx for cx in dist_divergent["counterexamples"] if cx.get("ranks")]
    assert with_ranks
    # Every ranks table lists every rank; a row is highlighted exactly when its replicas keep another mask.
    tables = re.findall(r'<table class="ranks">.*?</table>', html, re.DOTALL)
    assert len(tables) == len(with_ranks)
    for cx, table in zip(with_ranks, tables):
        rows = _tables(table)["ranks"][1:]
        assert [cells[0][1] for _, cells in rows] == [str(r["rank"]) for r in cx["ranks"]]
        assert [(cells[1][1], cells[2][1], cells[3][1]) for _, cells in rows] == [
            tuple(str(r["coords"][a]) for a in ("dp", "cp", "tp")) for r in cx["ranks"]
        ]
        assert ["diverge" in cls.split() for cls, _ in rows] == _replica_divergent(cx["ranks"]), cx["check"]
        for (_, cells), r, mask in zip(rows, cx["ranks"], _mask_cells(table)):
            assert cells[6][1] == f"{sum(map(sum, r['keep']))} / {sum(map(len, r['keep']))}"
            assert [c.split()[1] for c in mask] == [f"k{bit}" for row in r["keep"] for bit in row]
    # The shrunk replica counterexample of this control does diverge.
    (replica,) = [cx for cx in with_ranks if cx["check"] == "distributed.replica_masks_identical"]
    assert any(_replica_divergent(replica["ranks"])) and "replicas disagree" in html


def test_synthetic_replica_divergence_is_highlighted_rank_by_rank_and_cell_by_cell(divergent):
    html = render_html(_synthetic_distributed(divergent))
    assert "<dt>topology</dt><dd>dp=2, cp=2, tp=2 on gloo, 8 ranks</dd>" in html
    table = re.search(r'<table class="ranks">.*?</table>', html, re.DOTALL).group(0)
    rows = _tables(table)["ranks"][1:]
    assert ["diverge" in cls.split() for cls, _ in rows] == [True] * 4 + [False] * 4
    masks = _mask_cells(table)
    assert [["d" in c.split() for c in row] for row in masks] == [[False] * 4, [False] * 4, [False, True, False, False], [False] * 4] + [
        [False] * 4
    ] * 4
    assert re.findall(r'<span class="variant"[^>]*>(\w)</span>', table) == ["A", "A", "B", "A"]
    assert "DP rank 0 (ranks 0, 1, 2, 3) keeps 2 different masks" in html and "DP rank 1" not in html
    assert "1 token(s) differ from mask A" in table
    # Padding (from the token table) is marked in the mask too.
    padded = {tuple(t["index"]) for t in divergent["counterexamples"][0]["tokens"] if t["valid"] is False}
    drawn = {(0, i) for i, c in enumerate(masks[0]) if "p" in c.split()}  # rank 0 holds row 0
    assert drawn == {p for p in padded if p[0] == 0}


def test_rank_errors_and_stacks_are_collapsible_and_escaped(divergent):
    html = render_html(_synthetic_distributed(divergent))
    _assert_no_injection(html)
    escaped = str(markupsafe.escape(TRACEBACK))
    assert re.search(r'<details class="rank-failure" id="cx-2-rank-5">\s*<summary>rank 5 \(dp=1, cp=0, tp=1\) raised: ', html)
    assert f'<pre class="trace error">{escaped}</pre>' in html
    assert f'<pre class="trace stack">{markupsafe.escape(STACK)}</pre>' in html
    table = re.findall(r'<table class="ranks">.*?</table>', html, re.DOTALL)[1]
    rows = _tables(table)["ranks"][1:]
    assert [cells[7][1] for _, cells in rows] == ["returned"] * 5 + ["error", "hung", "returned"]
    assert ["fail" in cls.split() for cls, _ in rows] == [False] * 5 + [True, True, False]
    assert '<a href="#cx-2-rank-5"><span class="badge bad">error</span></a>' in table


@DISTRIBUTED
def test_a_real_rank_traceback_with_markup_is_escaped(dist_raising):
    html = render_html(dist_raising)
    _assert_no_injection(html)
    assert dist_raising["verdict"] == "unusable"
    cx = dist_raising["counterexamples"][0]
    (failed,) = [r for r in cx["ranks"] if r["error"]]
    assert failed["coords"]["cp"] == 1 and SCRIPT in failed["error"] and "Traceback" in failed["error"]
    assert f'<pre class="trace error">{markupsafe.escape(failed["error"])}</pre>' in html
    assert "<dt>topology</dt><dd>dp=1, cp=2, tp=1 on gloo, 2 ranks</dd>" in html


@DISTRIBUTED
def test_collectives_table_has_every_rank_and_a_total(dist_equivalent):
    html = render_html(dist_equivalent)
    assert 'class="verdict ok"' in html and '<a href="#collectives">' in html
    per_step = dist_equivalent["collectives_per_step"]
    assert len(per_step) == 4
    kinds = sorted({k for entry in per_step for k in entry["collectives"]})
    assert kinds, "the core calls collectives"
    ((_, head), (_, sub), *rows, (total_cls, total)) = _tables(html)["collectives"]
    assert [text for _, text in head][4:] == kinds and [text for _, text in sub] == ["calls", "bytes"] * len(kinds)
    assert [[text for _, text in cells[:4]] for _, cells in rows] == [
        [str(e["rank"]), *(str(e["coords"][a]) for a in ("dp", "cp", "tp"))] for e in per_step
    ]
    for (_, cells), entry in zip(rows, per_step):
        for i, kind in enumerate(kinds):
            assert cells[4 + 2 * i][1] == str(entry["collectives"][kind]["calls"])
            assert _parse_bytes(cells[5 + 2 * i][1]) == pytest.approx(entry["collectives"][kind]["bytes"], rel=0.05)
    row_html = re.findall(
        r'<tr class="rank">.*?</tr>', re.search(r'<table class="collectives">.*?</table>', html, re.DOTALL).group(0), re.DOTALL
    )
    for tr, entry in zip(row_html, per_step):
        assert re.findall(r'title="(\d+) bytes"', tr) == [str(entry["collectives"][k]["bytes"]) for k in kinds], "exact bytes on hover"
    assert total_cls == "total" and [text for _, text in total][1::2] == [
        str(sum(e["collectives"][k]["calls"] for e in per_step)) for k in kinds
    ]


def _parse_bytes(text: str) -> float:
    number, unit = text.split()
    return float(number) * 1024 ** ["B", "KiB", "MiB", "GiB"].index(unit)


def test_collectives_bytes_are_human_readable_and_missing_kinds_shown_as_dashes(divergent):
    html = render_html(_synthetic_distributed(divergent))
    ((_, head), _, *rows, (_, total)) = _tables(html)["collectives"]
    assert [text for _, text in head][4:] == ["all_gather", "all_reduce"] and len(rows) == 8
    assert [cells[5][1] for _, cells in rows[:3]] == ["16 B", "1.5 KiB", "3.0 MiB"]
    assert '<td class="num" title="1536 bytes">1.5 KiB</td>' in html
    assert [cells[6][1] for _, cells in rows][3] == "\u2014"
    assert [text for _, text in total][1:] == ["16", "3.0 MiB", "7", "56 B"]


def test_large_masks_are_cut_with_a_note_but_hidden_differences_still_counted(divergent):
    report = _synthetic_distributed(divergent)
    big = [[(r + c) % 2 for c in range(40)] for r in range(20)]
    odd = copy.deepcopy(big)
    odd[15][30] ^= 1  # outside the drawn 12 x 16 corner
    cx = report["counterexamples"][0]
    cx["ranks"] = [_dist_rank(0, 0, 0, 0, big, rows=[0, 20]), _dist_rank(1, 0, 0, 1, odd, rows=[0, 20])]
    html = render_html(report)
    table = re.search(r'<table class="ranks">.*?</table>', html, re.DOTALL).group(0)
    assert [len(m) for m in _mask_cells(table)] == [12 * 16] * 2
    assert table.count("first 12 rows × 16 tokens of 20 × 40 shown") == 2
    assert ["diverge" in cls.split() for cls, _ in _tables(table)["ranks"][1:]] == [True, True]
    assert "1 token(s) differ from mask A" in table and not any("d" in c.split() for m in _mask_cells(table) for c in m)


def test_validation_of_a_single_process_run_is_unchanged(divergent):
    report = copy.deepcopy(divergent)
    report["validation"] = {"strict": False, "probes": []}
    html = render_html(report)
    assert "No probes were run." in html and "Not run:" not in html


def _dist_junk_ranks(report: dict[str, Any]) -> dict[str, Any]:
    report["counterexamples"][0]["ranks"] = [
        None,
        3,
        "x",
        {"keep": "x", "coords": None, "rows": "?", "loss": {"a": 1}, "error": 42, "stack": []},
        {"keep": [[2, "a", None, True]], "coords": {"dp": [1]}, "rows": [0, "x"]},
        {"keep": [[1, 0], 5], "coords": {"dp": 0}, "rows": [0, 1]},
        {"keep": [[1.0, 0.0]], "coords": {"dp": 0}, "rows": [3, 1], "loss": "nan"},
        {"keep": [], "coords": {"dp": 0}, "rows": []},
    ]
    return report


DIST_ODD = {
    "ranks missing": lambda r: (r["counterexamples"][0].pop("ranks"), r)[1],
    "ranks not a list": lambda r: (r["counterexamples"][0].update(ranks="junk"), r)[1],
    "ranks null": lambda r: (r["counterexamples"][0].update(ranks=None), r)[1],
    "junk rank entries": _dist_junk_ranks,
    "topology not a mapping": lambda r: {**r, "topology": "weird"},
    "topology odd sizes": lambda r: {**r, "topology": {"dp": "x", "tp": 0, "backend": None}},
    "collectives junk": lambda r: {
        **r,
        "collectives_per_step": [
            None,
            {"collectives": {"all_gather": "x"}},
            {"rank": PAYLOAD, "collectives": {"all_gather": {"calls": "many", "bytes": -5}, 7: None}},
        ],
    },
    "collectives not a list": lambda r: {**r, "collectives_per_step": {"rank": 0}},
    "no collectives": lambda r: {**r, "collectives_per_step": []},
}


@pytest.mark.parametrize("case", DIST_ODD)
def test_rendering_tolerates_odd_distributed_data(divergent, case):
    html = render_html(DIST_ODD[case](_synthetic_distributed(divergent)))
    assert html.startswith("<!DOCTYPE html>") and html.rstrip().endswith("</html>")
    assert 'id="verdict"' in html and 'id="environment"' in html
    _assert_no_injection(html)
    if case == "ranks missing":
        assert html.count('<table class="ranks">') == 1  # only the second counterexample's
    if case in ("ranks not a list", "junk rank entries"):
        assert "rank entries are unreadable" in html
    if case == "junk rank entries":
        assert "unreadable mask" in html and '<span class="c ku">?</span>' in html
    if case == "topology not a mapping":
        assert "<dt>topology</dt><dd>weird</dd>" in html
    if case in ("collectives not a list", "no collectives"):
        assert "No rank called a collective" in html


# --- in a real browser ---------------------------------------------------------------------


def _open(browser, path: pathlib.Path, height: int = 900):
    page = browser.new_page(viewport={"width": 1280, "height": height}, device_scale_factor=1)
    page.set_default_timeout(30_000)
    seen = {"errors": [], "requests": [], "dialogs": []}
    page.on("pageerror", lambda error: seen["errors"].append(f"pageerror: {error}"))
    page.on("console", lambda message: seen["errors"].append(f"console: {message.text}") if message.type == "error" else None)
    page.on("request", lambda request: seen["requests"].append(request.url))
    page.on("dialog", lambda dialog: (seen["dialogs"].append(dialog.message), dialog.dismiss()))
    page.goto(path.as_uri(), wait_until="load")
    return page, seen


def _png_rows(data: bytes, rows: int) -> tuple[int, int, list[list[tuple[int, ...]]]]:
    """Width, height and the first ``rows`` rows of pixels of an 8-bit RGB(A) PNG (stdlib only)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat = 8, []
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
    assert depth == 8 and colour in (2, 6) and interlace == 0, "unexpected PNG format"
    bpp = 3 if colour == 2 else 4
    stride = width * bpp
    rows = min(rows, height)
    raw = zlib.decompressobj().decompress(b"".join(idat), rows * (stride + 1))
    prev, out = bytearray(stride), []
    for y in range(rows):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + a) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + b) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        out.append([tuple(line[x : x + 3]) for x in range(0, stride, bpp)])
        prev = line
    return width, height, out


def test_browser_shows_the_divergent_report_offline(browser, divergent, tmp_path):
    path = tmp_path / "report.html"
    write_html(divergent, path)
    page, seen = _open(browser, path)
    try:
        verdict = page.locator("#verdict")
        assert verdict.is_visible() and "divergent" in verdict.inner_text().lower()
        tokens = page.locator("table.tokens").first
        assert tokens.is_visible() and tokens.locator("tbody tr").count() == len(divergent["counterexamples"][0]["tokens"])
        curve = page.locator("svg.removal-curve").first
        assert curve.is_visible() and curve.bounding_box()["width"] > 300
        box = verdict.bounding_box()
        assert box and box["width"] > 200 and box["height"] > 20 and box["y"] >= 0 and box["y"] + box["height"] <= 900
        shot = tmp_path / "report.png"
        page.screenshot(path=str(shot), full_page=True)
    finally:
        page.close()
    assert seen["errors"] == [] and seen["dialogs"] == []
    assert seen["requests"] == [path.as_uri()], "the page fetched something besides itself"
    data = shot.read_bytes()
    assert len(data) > 30_000, "suspiciously small screenshot"
    width, height, rows = _png_rows(data, int(box["y"] + box["height"]) + 1)
    assert width == 1280 and height > 1500
    colours = {pixel for row in rows for pixel in row}
    assert len(colours) > 20, "the top of the page is (nearly) one colour"
    verdict_rows = rows[int(box["y"]) + 4 : int(box["y"] + box["height"]) - 4]
    assert any(r > 150 and g < 90 and b < 90 for row in verdict_rows for r, g, b in row), "no red in the verdict banner"


def test_browser_shows_the_explanation_and_the_first_counterexample_near_the_top(browser, divergent, tmp_path):
    # Before the explanation box the first counterexample started about 2,650-2,900 px down, under
    # the check table, the diagnosis and the validation; it must now be on the first screens.
    report = _explained(divergent)
    assert len(report["diagnosis"]["components"]) == 3 and report["verdict"] == "divergent"
    path = tmp_path / "explained.html"
    write_html(report, path)
    page, seen = _open(browser, path, height=800)
    try:
        explanation = page.locator("section#explanation")
        first = explanation.locator("article.cx#cx-1")
        assert explanation.is_visible() and first.is_visible()
        box, cx_box = explanation.bounding_box(), first.bounding_box()
        checks_y = page.locator("section#checks").bounding_box()["y"]
        print(f"explanation box at y={box['y']:.0f}, first counterexample at y={cx_box['y']:.0f}, checks at y={checks_y:.0f}")
        assert 0 <= box["y"] < 1200 and 0 <= cx_box["y"] < 1200, (box, cx_box)
        assert box["y"] < cx_box["y"] < checks_y, "the box, then its counterexample, then the check table"
        assert page.locator("#verdict").bounding_box()["y"] < box["y"]
        # Its content is drawn, not hidden: the components, the hint's option, the cause.
        assert page.locator("table.explanation-components tbody tr").count() == 3
        assert page.locator("ul.hints code").inner_text() == "--compute-dtype float32"
        assert first.locator("p.cause").inner_text().startswith("cause: clamped_log_ratio")
        # An explained-by link in the check table lands on its component's row.
        page.locator("table.checks a.deviation", has_text="float32_metrics").first.click()
        row = page.locator("table.explanation-components tr", has_text="float32_metrics")
        assert page.evaluate("location.hash") == f"#{row.get_attribute('id')}"
        row_box = row.bounding_box()
        assert 0 <= row_box["y"] <= 800 - row_box["height"], "the target row is scrolled into view"
    finally:
        page.close()
    assert seen["errors"] == [] and seen["dialogs"] == []
    assert seen["requests"] == [path.as_uri()], "the page fetched something besides itself"


def test_browser_runs_no_hostile_markup(browser, divergent, hostile, tmp_path):
    for name, report in (("poisoned", _poison(divergent)), ("raising", hostile)):
        path = tmp_path / f"{name}.html"
        write_html(report, path)
        page, seen = _open(browser, path)
        try:
            assert page.locator("script").count() == 0 and page.locator("img").count() == 0
            assert PAYLOAD in page.locator("#implementation").inner_text(), "the hostile name is shown as text"
        finally:
            page.close()
        assert seen["errors"] == [] and seen["dialogs"] == [], name
        assert seen["requests"] == [path.as_uri()], name


@DISTRIBUTED
def test_browser_shows_a_distributed_report_offline(browser, dist_divergent, tmp_path):
    # The synthetic layout is laid over the real distributed report (no single-process run needed here).
    for name, report in (("real", dist_divergent), ("synthetic", _synthetic_distributed(dist_divergent))):
        path = tmp_path / f"{name}.html"
        write_html(report, path)
        page, seen = _open(browser, path)
        try:
            assert page.locator("script").count() == 0 and page.locator("img").count() == 0
            ranks = page.locator("table.ranks").first
            assert ranks.is_visible() and page.locator("#collectives table").is_visible()
            backgrounds = [
                row.locator("td").nth(1).evaluate("e => getComputedStyle(e).backgroundColor") for row in ranks.locator("tbody tr").all()
            ]
            highlighted = [bg == "rgb(255, 235, 233)" for bg in backgrounds]
            assert highlighted == ["diverge" in (row.get_attribute("class") or "").split() for row in ranks.locator("tbody tr").all()]
            assert any(highlighted), name
            cell = ranks.locator(".mask .c").first.bounding_box()
            assert cell and 10 <= cell["width"] <= 30 and 10 <= cell["height"] <= 30, "mask cells should be small squares"
            if name == "synthetic":
                failure = page.locator("details.rank-failure").first
                trace = failure.locator("pre")
                assert not trace.is_visible(), "tracebacks start collapsed"
                failure.locator("summary").click()
                assert trace.is_visible() and PAYLOAD in trace.inner_text()
        finally:
            page.close()
        assert seen["errors"] == [] and seen["dialogs"] == [], name
        assert seen["requests"] == [path.as_uri()], name


@pytest.fixture(scope="module")
def trainer_divergent() -> dict[str, Any]:
    from m2po_oracle.trainer.runner import TrainerRunner

    return run_compare(
        TrainerRunner("per_micro_batch_denominator"), "trainer:per_micro_batch_denominator", examples=8, seed=0, shrink=False
    ).to_json()


def test_browser_shows_a_trainer_report_with_its_training_step_offline(browser, trainer_divergent, tmp_path):
    path = tmp_path / "trainer.html"
    write_html(trainer_divergent, path)
    page, seen = _open(browser, path)
    try:
        assert "failing steps" in page.locator("table.checks thead").inner_text()
        step = page.locator("dl.trainer-case").first
        assert step.is_visible()
        labels = [t.strip().lower() for t in step.locator("dt").all_inner_texts()]
        assert labels[:3] == ["seed", "prompts", "completions per prompt"] and "rows per micro-batch" in labels and "rewards" in labels
        case = trainer_divergent["counterexamples"][0]["trainer_case"]
        assert str(case["split"]).replace(" ", "") in step.inner_text().replace(" ", "")
        warned = page.locator("table.probes tr", has_text="kl_coefficient").locator(".badge")
        assert warned.inner_text().lower() == "warned" and "ok" in (warned.get_attribute("class") or "").split()
        assert "trainer:per_micro_batch_denominator" in page.locator("pre.replay").first.inner_text()
    finally:
        page.close()
    assert seen["errors"] == [] and seen["dialogs"] == []
    assert seen["requests"] == [path.as_uri()], "the page fetched something besides itself"


def test_an_adapter_run_shows_its_call_bindings_and_why_each_check_did_not_run(divergent):
    report = copy.deepcopy(divergent)
    status = {c["name"]: c for c in report["checks"]}
    status["metrics.m2_after"].update(status="not run", failures=0, ran=0)
    report["adapter"] = {
        "name": "clip_kernel",
        "signature": "fn(ppo_kl, advantages, budget, response_mask)",
        "bindings": ["m2_before=2"],
        "call": "port(ppo_kl=<ppo_kl>, ...) -> loss at [0]; m2_before at [2]",
        "not_run": {"metrics.m2_after": "the port returns no m2_after here (bind it: --bind m2_after=INDEX)"},
    }
    html = render_html(report)
    summary = _tables(html).get("summary")
    assert "clip_kernel: port(ppo_kl=&lt;ppo_kl&gt;, ...) -&gt; loss at [0]; m2_before at [2]" in html, summary
    assert "m2_before=2" in html
    assert '<div class="full"><dt>adapter</dt>' in html, "the call is a line of its own, not a narrow grid cell"
    rows = {cells[0][1]: cells for _, cells in _tables(html)["checks"][1:]}
    assert "not run: the port returns no m2_after here (bind it: --bind m2_after=INDEX)" in rows["metrics.m2_after"][1][1]
    # A check that ran carries no reason.
    assert not any("not run:" in cells[1][1] for name, cells in rows.items() if name != "metrics.m2_after")


def test_a_check_that_failed_on_every_exercised_batch_reads_100_percent(divergent):
    report = copy.deepcopy(divergent)
    failing = next(c for c in report["checks"] if c["status"] == "fail")
    failing.update(failures=7, exercised=7, failure_rate_upper_95=1.0)
    rows = {cells[0][1]: cells for _, cells in _tables(render_html(report))["checks"][1:]}
    assert rows[failing["name"]][6][1] == "100%"


#: Where a page scrolls sideways: the page itself, or an element whose content is wider than
#: its box (a table cut off behind a scrollbar), as "what: content width > box width".
SIDEWAYS = """() => {
  const found = [];
  const root = document.documentElement;
  if (root.scrollWidth > root.clientWidth + 1) found.push(`the page: ${root.scrollWidth} > ${root.clientWidth}`);
  for (const element of document.querySelectorAll('body *')) {
    const overflow = getComputedStyle(element).overflowX;
    if ((overflow === 'auto' || overflow === 'scroll') && element.scrollWidth > element.clientWidth + 1) {
      const name = element.tagName.toLowerCase() + (element.id ? '#' + element.id : '') + (element.className && typeof element.className === 'string' ? '.' + element.className.trim().split(/\\s+/).join('.') : '');
      found.push(`${name}: ${element.scrollWidth} > ${element.clientWidth}`);
    }
  }
  return found;
}"""

#: The check names in the check table that break across lines (a name has no space: any break is mid-word).
BROKEN_NAMES = """() => {
  const found = [];
  for (const cell of document.querySelectorAll('table.checks tbody tr > :first-child')) {
    const range = document.createRange();
    range.selectNodeContents(cell);
    const lines = new Set([...range.getClientRects()].filter(r => r.width > 0).map(r => Math.round(r.top)));
    if (lines.size > 1) found.push(cell.innerText.trim());
  }
  return found;
}"""


def _long_replays(report: dict[str, Any]) -> dict[str, Any]:
    """The report with every replay command as long as a port's deep path makes it."""
    report = copy.deepcopy(report)
    long = (
        "m2po-oracle replay --impl /home/someone/work/" + "framework/" * 12 + "m2po_port.py:compute_m2po_policy_loss --adapter verl_release"
    )
    for cx in report["counterexamples"]:
        cx["replay"] = long + " --batch '" + json.dumps(cx["batch"]) + "'"
    for residual in report["diagnosis"].get("residuals", []):
        if isinstance(residual.get("counterexample"), dict):
            residual["counterexample"]["replay"] = long
    return report


@pytest.fixture(scope="module")
def composite() -> dict[str, Any]:
    """A port with five deviations at once: the widest explanation a real port has shown."""
    spec = "control:release_clip_float32_bound"
    return run_compare(load_implementation(spec), spec, examples=120).to_json()


def test_the_report_reads_at_1280_px_without_sideways_scroll(browser, divergent, composite, tmp_path):
    problems = []
    reports = (("divergent", divergent), ("explained", _explained(divergent)), ("composite", _long_replays(composite)))
    for name, report in reports:
        path = tmp_path / f"{name}.html"
        write_html(report, path)
        page, seen = _open(browser, path)
        try:
            sideways, broken = page.evaluate(SIDEWAYS), page.evaluate(BROKEN_NAMES)
            page.screenshot(path=str(tmp_path / f"{name}.png"), full_page=True)
        finally:
            page.close()
        problems += [f"{name}: scrolls sideways at 1280 px: {s}" for s in sideways]
        problems += [f"{name}: check name broken across lines: {b}" for b in broken]
        assert seen["errors"] == []
    assert not problems, "\n".join(problems)
