"""The HTML report: drawn only from the JSON report, escaped, self-contained, robust, and
actually displayed by a browser (headless Chromium, skipped cleanly where it is missing)."""

from __future__ import annotations

import copy
import os
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

from m2po_oracle.compare import run_compare
from m2po_oracle.contract import load_implementation
from m2po_oracle.html_report import render_html, write_html

SCRIPT = "<script>alert(1)</script>"
BREAKOUT = '"><img src=x onerror=alert(1)>'
PAYLOAD = SCRIPT + BREAKOUT
ATTRIBUTE = '" onmouseover="alert(1)'

CHROMIUM = pathlib.Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


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
        "status": "matched", "examples_compared": 60,
        "matches": [{"variant": "one_extra_removed", "description": "removes one token too many", "source": "controls.py"}],
        "closest": [{"variant": "strict_stop", "description": "stops on < tau", "agreed": 58, "of": 60, "first_difference": "keep at (0, 1)"}],
    }
    report["validation"] = {"strict": True, "probes": [
        {"probe": "nan_logp", "description": "NaN in a valid logp", "status": "rejected", "message": "ValueError: logp is not finite"},
        {"probe": "shape_mismatch", "description": "advantages of another shape", "status": "accepted", "message": ""},
        {"probe": "huge_batch", "description": "a 1e9-token batch", "status": "hung", "message": "timed out after 30 s"},
    ]}
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
    assert ('id="diagnosis"' in html) == ("diagnosis" in divergent) and ('id="validation"' in html) == ("validation" in divergent)


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
    assert 'id="diagnosis"' in html and "one_extra_removed" in html and "58 / 60" in html and "keep at (0, 1)" in html
    assert 'id="validation"' in html
    rows = {cells[0][1]: (row_cls, cells) for row_cls, cells in _tables(html)["probes"][1:]}
    assert rows["shape_mismatch"][0] == "warn" and "badge warn" in rows["shape_mismatch"][1][2][0] + html
    assert "WARNING" in rows["shape_mismatch"][1][2][1]
    assert rows["nan_logp"][0] == "" and rows["huge_batch"][0] == "fail"
    assert "1 invalid input(s) were silently accepted" in html


def test_token_table_highlights_differences_and_greys_padding(divergent):
    report = copy.deepcopy(divergent)
    base = {"valid": True, "log_ratio": 0.5, "advantage": 1.0, "m2": 0.125, "trust_region": True,
            "expected_keep": True, "actual_keep": True, "expected_grad": -0.25, "actual_grad": -0.25}
    variants = [
        {},                                                     # agrees
        {"actual_keep": False},                                 # keep differs
        {"actual_grad": -0.25 * (1 + 1e-12)},                   # rounding: not a difference
        {"actual_grad": -0.25 * (1 + 1e-6)},                    # a real difference
        {"actual_grad": None},                                  # missing
        {"actual_grad": "nan"},                                 # non-finite
        {"valid": False, "log_ratio": None, "m2": None, "trust_region": False, "expected_keep": False,
         "actual_keep": False, "expected_grad": 0.0, "actual_grad": 0.0},  # padding
    ]
    report["counterexamples"][0]["tokens"] = [{**base, "index": [0, t], **v} for t, v in enumerate(variants)]
    rows = _tables(render_html(report))["tokens"][1:]
    keep_diff = ["diff" in cells[7][0] for _, cells in rows]
    grad_diff = ["diff" in cells[9][0] for _, cells in rows]
    assert keep_diff == [False, True, False, False, False, False, False]
    assert grad_diff == [False, False, False, True, True, True, False]
    assert [cls for cls, _ in rows] == ["valid"] * 6 + ["padding"]
    assert rows[4][1][9][1] == "\u2014" and rows[5][1][9][1] == "nan"


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
    for (_, y1), (_, y2), m1, m2 in zip(xy, xy[1:], means, means[1:]):
        assert (y1 < y2) == (m1 > m2) and (y1 == y2) == (m1 == m2)


def test_removal_curve_band_when_the_oracle_stop_is_ambiguous(divergent):
    report = _curve_report(divergent, prefix_means=[0.01, 0.02, 0.03, 0.2], candidates=4, tau=0.03,
                           oracle_kept_min=1, oracle_kept_max=3, implementation_kept=4)
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
    return {"verdict": None, "checks": [None, "x", {"name": 3}], "counterexamples": [None, "x", {"removal_curve": "bad", "tokens": [None, 3],
            "mismatches": "oops", "actual": None, "shape": "?"}], "tolerances": None, "environment": "text", "options": [], "diagnosis": None,
            "validation": {"probes": [None, {"status": 7}]}}


def _empty_actual(report: dict[str, Any]) -> dict[str, Any]:
    cx = report["counterexamples"][0]
    cx["actual"], cx["expected_on_actual_mask"] = {}, {}
    cx["removal_curve"]["implementation_kept"] = None
    for token in cx["tokens"]:
        token["actual_keep"] = token["actual_grad"] = None
    return report


ODD_INPUTS = {
    "empty dict": lambda r: {},
    "junk types": _junk_report,
    "no optional sections": lambda r: {k: v for k, v in r.items() if k not in ("diagnosis", "validation")},
    "no counterexamples": lambda r: {**r, "counterexamples": []},
    "empty actual": _empty_actual,
    "non-finite prefix means": lambda r: _curve_report(r, prefix_means=[0.01, 0.02, "inf", "nan", None, "-inf", 1e300, 2e300], candidates=8),
    "zero candidates": lambda r: _curve_report(r, prefix_means=[], candidates=0, oracle_kept_min=0, oracle_kept_max=0, implementation_kept=0),
    "single point": lambda r: _curve_report(r, prefix_means=[0.5], candidates=1, oracle_kept_min=0, oracle_kept_max=0, implementation_kept=1),
    "all equal": lambda r: _curve_report(r, prefix_means=[0.0, 0.0], candidates=2, tau=0.0),
    "near overflow": lambda r: _curve_report(r, prefix_means=[-1.7e308, 1.7e308, 1.79e308], candidates=3, tau=1.78e308),
    "subnormal": lambda r: _curve_report(r, prefix_means=[5e-324, 1e-320, 1.0], candidates=3, tau=5e-324),
    "non-finite tau": lambda r: _curve_report(r, tau="inf"),
    "truncated curve": lambda r: _curve_report(r, prefix_means=[i / 512 for i in range(512)], candidates=600, oracle_kept_max=300,
                                               oracle_kept_min=300, implementation_kept=299),
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
    code = "import sys, m2po_oracle.html_report as h; h.render_html({}); sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


# --- in a real browser ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        reason = f"browser test needs Debian chromium at {CHROMIUM} (apt-get install chromium)"
        if os.environ.get("CI") == "true":  # CI's test command installs it: missing there is a failure
            pytest.fail(reason)
        pytest.skip(reason)
    sync_api = pytest.importorskip("playwright.sync_api", reason="browser test needs the playwright Python package")
    with sync_api.sync_playwright() as playwright:
        # A hung browser must fail the test, not hang the suite: every wait has a limit.
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, timeout=60_000)
        try:
            yield chromium
        finally:
            chromium.close()


def _open(browser, path: pathlib.Path):
    page = browser.new_page(viewport={"width": 1280, "height": 900}, device_scale_factor=1)
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
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
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
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
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
        out.append([tuple(line[x:x + 3]) for x in range(0, stride, bpp)])
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
        assert box and box["width"] > 200 and box["height"] > 20 and 0 <= box["y"] and box["y"] + box["height"] <= 900
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
    verdict_rows = rows[int(box["y"]) + 4:int(box["y"] + box["height"]) - 4]
    assert any(r > 150 and g < 90 and b < 90 for row in verdict_rows for r, g, b in row), "no red in the verdict banner"


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
