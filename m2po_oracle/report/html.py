"""Render a compare report (schema ``m2po-oracle/compare/1``) as one self-contained HTML page.

The page is drawn only from the JSON dict, never by re-running the oracle, so a report
file saved on one machine renders identically anywhere. Every string in the report may
come from the implementation under test (names, exception text), so the template is
rendered with autoescaping on and nothing here builds markup by hand: this module only
turns the dict into plain numbers and strings (a "view model") that the template prints.

The dict is treated as untrusted and possibly partial (older or newer schema, a failed
implementation with no results): every lookup has a default, so rendering never raises
on odd content.
"""

from __future__ import annotations

import functools
import json
import math
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2

from m2po_oracle.judge.coverage import percent
from m2po_oracle.explain.diagnosis import ALIKE

__all__ = ["render_html", "write_html"]

_TEMPLATE = "report.html.j2"

# Token-table highlighting is a visual cue only; the checks themselves use the tolerance
# table. 1e-9 relative is far above float64 rounding yet flags any real difference.
_GRAD_RTOL = 1e-9

# Removal-curve geometry in SVG user units; the SVG scales with its container.
_W, _H = 680, 300
_ML, _MR, _MT, _MB = 78, 20, 18, 48
_PW, _PH = _W - _ML - _MR, _H - _MT - _MB
# Past this many points the markers would merge into a smear; draw the line only.
_MAX_MARKERS = 80
# A y spread wider than this is unreadable on a linear axis.
_LOG_SPREAD = 1e3
# Per-rank keep masks are drawn cell by cell; past this they are cut (with a note).
_MASK_ROWS, _MASK_COLS = 12, 16
# More ranks than this would bury the page; the rest are counted, not drawn.
_MAX_RANKS = 64


@functools.cache
def _environment() -> jinja2.Environment:
    # Built lazily so importing the module stays cheap for CLI paths that never render.
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("m2po_oracle.report", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,  # a typo in the template should fail tests, not render blank
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["num"] = _fmt
    env.filters["short"] = _fmt_short
    return env


def render_html(report: Mapping[str, Any]) -> str:
    """The report as a standalone HTML document (inline CSS and SVG, no scripts, no network)."""
    return _environment().get_template(_TEMPLATE).render(r=_view(report))


def write_html(report: Mapping[str, Any], path: pathlib.Path) -> None:
    """Write :func:`render_html` of ``report`` to ``path`` as UTF-8, creating parent folders."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_html(report), encoding="utf-8")


# --- scalar helpers ------------------------------------------------------------------------

def _as_float(value: Any) -> float | None:
    """A report number as a float; the strings "nan"/"inf"/"-inf" are how JSON carries non-finite values."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        try:
            return float(value)
        except OverflowError:  # a huge int from a hand-edited report
            return math.inf if value > 0 else -math.inf
    if isinstance(value, str) and value.strip().lower() in ("nan", "inf", "-inf", "+inf", "infinity", "-infinity"):
        return float(value.strip())
    return None


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        return int(value)
    return None


def _fmt(value: Any) -> str:
    """Full precision: shortest round-trip repr, so two printed values differ iff the numbers do."""
    if value is None:
        return "\u2014"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        # -0.0 == 0.0: both print as "0", so equal numbers never print differently.
        return "0" if value == 0 else repr(value)
    if isinstance(value, (int, str)):
        return str(value)
    if isinstance(value, Sequence):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return str(value)


def _fmt_short(value: Any) -> str:
    """Six significant digits for dense tables; the full value goes in a tooltip."""
    if isinstance(value, float) and math.isfinite(value) and value != 0:
        return f"{value:.6g}"
    return _fmt(value)


def _column_texts(values: Sequence[Any]) -> list[str]:
    """A dense column's values at six significant digits, or at as many more as it takes for
    distinct numbers to print distinctly (up to a round trip): tokens whose M2 differ in the
    last bits, where the cut falls between them, must not look tied."""
    numbers = {v for v in values if isinstance(v, float) and math.isfinite(v) and v != 0}
    digits = next((d for d in range(6, 17) if len({f"{v:.{d}g}" for v in numbers}) == len(numbers)), 17)
    return [f"{v:.{digits}g}" if isinstance(v, float) and math.isfinite(v) and v != 0 else _fmt(v) for v in values]


def _fixed(value: float, digits: int) -> str:
    """``value`` with ``digits`` decimals; a value that rounds to zero prints without a minus sign."""
    text = f"{value:.{digits}f}"
    return text[1:] if text.startswith("-") and float(text) == 0 else text


def _index(value: Any) -> str:
    if isinstance(value, Sequence) and not isinstance(value, str):
        return "(" + ", ".join(_fmt(v) for v in value) + ")"
    return _fmt(value)


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, Sequence) and not isinstance(value, (str, bytes)) else []


def _text(value: Any, default: str = "") -> str:
    return default if value is None else _fmt(value)


# --- comparisons for highlighting ----------------------------------------------------------

def _numbers_differ(actual: Any, expected: Any, rtol: float = _GRAD_RTOL) -> bool:
    """True when a reader should look twice: one side missing, or values apart by more than ``rtol``."""
    if actual is None and expected is None:
        return False
    a, e = _as_float(actual), _as_float(expected)
    if a is None or e is None:
        return actual != expected
    if math.isnan(a) or math.isnan(e):
        return not (math.isnan(a) and math.isnan(e))
    if math.isinf(a) or math.isinf(e):
        return a != e
    return abs(a - e) > rtol * max(abs(a), abs(e))


def _keep_differs(actual: Any, expected: Any) -> bool:
    # A missing actual keep (the call failed) counts as different: there is no agreement to show.
    return actual is None or expected is None or bool(actual) != bool(expected)


# --- view model ----------------------------------------------------------------------------

_VERDICT_CLASS = {"equivalent": "ok", "divergent": "bad", "unusable": "bad", "interrupted": "neutral"}
_VERDICT_TEXT = {
    "equivalent": "no divergence from Algorithm 1 was found",
    "divergent": "the implementation diverges from Algorithm 1",
    "unusable": "the implementation never returned a usable result",
    "interrupted": "the run was interrupted; this report is partial",
}
_CHECK_CLASS = {"pass": "ok", "fail": "bad", "not run": "neutral"}
_PROBE_CLASS = {"rejected": "ok", "warned": "ok", "accepted": "warn", "hung": "bad", "crashed": "bad", "not run": "neutral"}
_PROBE_NOTE = {
    "rejected": "rejected as it should be",
    "warned": "allowed with a warning, as it should be",
    "accepted": "WARNING: silently accepted invalid input",
    "hung": "hung",
    "crashed": "crashed instead of raising a clean error",
    "not run": "this input cannot reach the port",
}
# The diagnosis status as the page words it, and the class of its badge.
_DIAGNOSIS_WORD = {
    "matched": "explained",
    "mostly_explained": "mostly explained",
    "partly_explained": "partly explained",
    "no_known_variant": "no known deviation explains it",
    "not_needed": "not needed",
    "not_run": "not run",
}
_DIAGNOSIS_CLASS = {"matched": "bad", "mostly_explained": "bad", "partly_explained": "warn", "no_known_variant": "warn", "not_needed": "ok", "not_run": "neutral"}
# The one line a report without a diagnosis to show gets instead of the explanation box.
_DIAGNOSIS_NOTE = {
    "not_needed": "No explanation needed: no divergence was found.",
    "not_run": "No explanation: there was no result to compare with Algorithm 1, or the run ended before the diagnosis.",
}
# What the box says when the report carries no summary line (reports older than the summary).
_DIAGNOSIS_TEXT = {
    "matched": "Known deviations from Algorithm 1 reproduce every failing check.",
    "mostly_explained": "Known deviations from Algorithm 1 reproduce most failing examples of every failing check; the rest is a residual.",
    "partly_explained": "Known deviations from Algorithm 1 reproduce some failing checks; the others are unexplained.",
    "no_known_variant": "No known deviation from Algorithm 1 reproduces the failing checks.",
}
# The order a reader expects; unknown extra metrics follow in report order.
_METRIC_ORDER = ("loss", "m2_before", "m2_after", "masked_fraction", "trust_region_fraction", "valid_count", "trust_region_count", "kept_trust_region_count")


def _view(report: Mapping[str, Any]) -> dict[str, Any]:
    report = _mapping(report)
    options = _mapping(report.get("options"))
    verdict = _text(report.get("verdict"), "unknown")
    examples = report.get("examples", options.get("examples"))
    raw_checks = [_mapping(check) for check in _list(report.get("checks"))]
    diagnosis = (_diagnosis(report.get("diagnosis"), [(_text(c.get("name"), "?"), _text(c.get("status"), "?")) for c in raw_checks])
                 if "diagnosis" in report else None)
    anchors = diagnosis["anchors"] if diagnosis is not None else {}
    builds = _mapping(_mapping(report.get("adapter")).get("builds"))
    counterexamples = [_counterexample(i, cx, anchors, builds) for i, cx in enumerate(_list(report.get("counterexamples")), start=1) if isinstance(cx, Mapping)]
    first_cx: dict[str, str] = {}
    for cx in counterexamples:
        for name in [cx["check"], *cx["checks"]]:
            first_cx.setdefault(name, cx["anchor"])
    # A diagnosis that was not needed or not run explains nothing, whatever else it carries:
    # no check is "unexplained" and no counterexample has a cause (not even "unexplained").
    shown = diagnosis is not None and not diagnosis["brief"]
    by_check = diagnosis["by_check"] if shown else {}
    unexplained = set(diagnosis["unexplained"]) if shown else set()
    if not shown:
        for cx in counterexamples:
            cx["cause"] = {"recorded": False, "name": None, "parts": []}
    not_run_reasons = _mapping(_mapping(report.get("adapter")).get("not_run"))
    checks = []
    for check in raw_checks:
        name = _text(check.get("name"), "?")
        status = _text(check.get("status"), "?")
        failed = status == "fail"
        checks.append({"name": name, "description": _text(check.get("description")), "status": status, "failed": failed,
                       "status_class": _CHECK_CLASS.get(status, "neutral"), "failures": _fmt(check.get("failures")),
                       "ran": _fmt(check.get("ran")), "anchor": first_cx.get(name),
                       "exercised": _fmt(check.get("exercised")) if "exercised" in check else "\u2014",
                       "failure_rate": _failure_rate(check.get("failures"), check.get("exercised"), check.get("failure_rate_upper_95")),
                       "exercised_when": _text(_mapping(_mapping(report.get("coverage")).get("exercised_when")).get(name)),
                       # Only a failing check has something to explain.
                       "explained_by": [_linked(n, anchors) for n in by_check.get(name, [])] if failed else [],
                       # A check the adapter cannot run says why (and often which binding would run it).
                       "not_run_reason": _not_run_reason(name, not_run_reasons, adapted=bool(report.get("adapter"))) if status == "not run" else None,
                       "unexplained": failed and name in unexplained})
    failed = sum(1 for c in checks if c["failed"])
    not_run = sum(1 for c in checks if c["status"] == "not run")
    topology = _topology_text(report.get("topology")) if report.get("topology") is not None else None
    # The first counterexample goes in the explanation box at the top, unless there is nothing to explain.
    top = counterexamples[0] if counterexamples and diagnosis is not None and not diagnosis["brief"] else None
    rest = counterexamples[1:] if top is not None else counterexamples
    return {
        "schema": _text(report.get("schema"), "unknown schema"),
        "verdict": verdict,
        "verdict_class": _VERDICT_CLASS.get(verdict, "neutral"),
        "verdict_text": _VERDICT_TEXT.get(verdict, "the report does not state a known verdict"),
        "implementation": _text(report.get("implementation"), "(unnamed implementation)"),
        "summary": [
            ("implementation", _text(report.get("implementation"), "\u2014")),
            *([("topology", topology)] if topology is not None else []),
            ("dtype", _text(options.get("dtype"), "\u2014")),
            ("compute dtype", _text(options.get("compute_dtype"), "\u2014")),
            (f"{_text(report.get('example_unit'), 'batches')} tried", _fmt(examples)),
            ("seed", _fmt(options.get("seed"))),
            ("tau", f"drawn per {'step' if report.get('example_unit') == 'steps' else 'batch'}" if options.get("tau") is None else _fmt(options.get("tau"))),
            ("device", _text(options.get("device"), "\u2014")),
            ("duration", _duration(report.get("duration_s"))),
            *([("capture", f"{_text(capture.get('directory'))} ({_fmt(capture.get('steps'))} steps): m2po-oracle audit {_text(capture.get('directory'))}")]
              if isinstance(capture := report.get("capture"), Mapping) else []),
            *([("bindings", ", ".join(_text(b) for b in _list(adapter.get("bindings"))))]
              if (adapter := _mapping(report.get("adapter"))) and adapter.get("bindings") else []),
            # Last and full width: the call the adapter makes is a line of its own.
            *([("adapter", f"{_text(adapter.get('name'))}: {_text(adapter.get('call'), _text(adapter.get('signature')))}")] if adapter else []),
            # Which of the port's values each metric check judged (its own names, e.g. 'm2' read as m2_before).
            *([("metrics read", ", ".join(f"{_text(k)} \u2190 {_text(v)}" for k, v in _mapping(adapter.get("metrics_read")).items()))]
              if adapter and _mapping(adapter.get("metrics_read")) else []),
        ],
        "checks": checks,
        "checks_failed": failed,
        "checks_not_run": not_run,
        "coverage": _coverage(report.get("coverage")) if "coverage" in report else None,
        "unusable_note": _unusable_note(report) if verdict in ("unusable", "interrupted") else None,
        "stopped_early": _text(report.get("stopped_early")) if report.get("stopped_early") else None,
        "output": _output(report.get("implementation_output")),
        "counterexamples": counterexamples,
        "top_counterexample": top,
        "cause_groups": _cause_groups(rest, diagnosis),
        "example_unit": _text(report.get("example_unit"), "batches"),
        "diagnosis": diagnosis,
        "validation": _validation(report.get("validation")) if "validation" in report else None,
        "collectives": _collectives(report.get("collectives_per_step")) if "collectives_per_step" in report else None,
        "tolerances": [
            {"dtype": _text(t.get("dtype")), "quantity": _text(t.get("quantity")), "rtol": _fmt(t.get("rtol")), "atol": _fmt(t.get("atol"))}
            for t in map(_mapping, _list(report.get("tolerances")))
        ],
        "environment": [(_text(k), _text(v, "\u2014")) for k, v in _mapping(report.get("environment")).items()],
    }


def _failure_rate(failures: Any, exercised: Any, upper: Any) -> str:
    """"< 0.6%" with no failure, "30% (< 42%)" with some, a dash where nothing was exercised
    (or the report predates the bound)."""
    n, f, bound = _as_int(exercised), _as_int(failures), _as_float(upper)
    if n is None or n <= 0 or f is None or f < 0 or bound is None or not 0 <= bound <= 1:
        return "\u2014"
    if f == 0:
        return f"< {percent(bound)}"
    return percent(1.0) if f >= n else f"{percent(f / n)} (< {percent(bound)})"


def _coverage(raw: Any) -> dict[str, Any]:
    """The coverage table: strategy families and features, each with its count."""
    raw = _mapping(raw)
    descriptions = _mapping(raw.get("feature_descriptions"))

    def counts(value: Any) -> list[tuple[str, str]]:
        return [(_text(k), _fmt(v)) for k, v in _mapping(value).items()]

    return {"examples": _fmt(raw.get("examples")), "judged": _fmt(raw.get("judged")),
            "families": counts(raw.get("families")),
            "features": [(name, count, _text(descriptions.get(name))) for name, count in counts(raw.get("features"))],
            "unmeasured": _fmt(raw.get("unmeasured")) if raw.get("unmeasured") else None}


def _duration(value: Any) -> str:
    seconds = _as_float(value)
    if seconds is None or not math.isfinite(seconds):
        return _fmt(value)
    return f"{_fixed(seconds, 1)} s"


def _cause_groups(counterexamples: list[dict[str, Any]], diagnosis: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """The counterexamples below the box, grouped by cause where the report records one.

    Groups follow the explanation's components, then other causes in report order; the
    unexplained and the unattributed come last. Without any cause: one group, no heading."""
    if not any(cx["cause"]["recorded"] for cx in counterexamples):
        return [{"kind": "all", "label": "", "parts": [], "members": counterexamples}] if counterexamples else []
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for cx in counterexamples:
        cause = cx["cause"]
        key = ("cause", cause["name"]) if cause["name"] is not None else ("unexplained", "") if cause["recorded"] else ("unattributed", "")
        group = groups.setdefault(key, {"kind": key[0], "label": key[1], "parts": cause["parts"], "members": []})
        group["members"].append(cx)
    components = list(diagnosis["anchors"]) if diagnosis is not None else []
    rank = {"cause": 0, "unexplained": 1, "unattributed": 2}

    def position(key: tuple[str, str]) -> tuple[int, int]:
        return rank[key[0]], components.index(key[1]) if key[1] in components else len(components)

    return [groups[key] for key in sorted(groups, key=position)]  # stable: report order within a rank


def _names(value: Any) -> list[str]:
    """A list of names from a list (or, from a hand-edited report, a single string)."""
    if isinstance(value, str):
        return [value]
    return [_text(v) for v in _list(value) if v is not None]


def _number_or_zero(value: Any) -> float:
    number = _as_float(value)
    return number if number is not None and math.isfinite(number) else 0.0


def _diagnosis(raw: Any, checks: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
    """The explanation box: the best explanation of the failing checks and what else the diagnosis found.

    ``checks`` are the report's (name, status) pairs: a deviation is listed as explaining
    only checks that failed, in the check table's order. Keys a report lacks (reports older
    than the explanation schema) read as empty."""
    d = _mapping(raw)
    status = _text(d.get("status"), "unknown")
    word = _DIAGNOSIS_WORD.get(status, status)
    by_check = {_text(check): _names(names) for check, names in _mapping(d.get("by_check")).items()}
    order = {name: i for i, (name, _) in enumerate(checks)}
    passed = {name for name, state in checks if state != "fail"}
    matches = {}
    for m in map(_mapping, _list(d.get("matches"))):
        if m.get("variant") is not None:
            matches.setdefault(_text(m.get("variant")), m)
    components = list(dict.fromkeys(_names(d.get("components"))))
    # A described deviation: every component, then the matches that are not components
    # (in a report older than "components", every match).
    described = components + [name for name in matches if name not in components]
    brief = status in _DIAGNOSIS_NOTE  # nothing to explain: the page shows one line, so nothing to link to
    anchors = {} if brief else {name: f"deviation-{i + 1}" for i, name in enumerate(described)}

    def explains(name: str) -> list[str]:
        explained = [check for check, names in by_check.items() if name in names]
        if not explained and "checks" in matches.get(name, {}):
            explained = _names(matches[name].get("checks"))
        return sorted((c for c in explained if c not in passed), key=lambda c: order.get(c, len(order)))

    def entry(name: str) -> dict[str, Any]:
        m = matches.get(name, {})
        return {"name": name, "anchor": anchors.get(name), "description": _text(m.get("description")), "source": _text(m.get("source")),
                "evidence": _text(m.get("evidence")), "checks": explains(name)}

    closest = []
    for c in map(_mapping, _list(d.get("closest"))):
        agreed = _number_or_zero(c.get("agreed"))
        if agreed <= 0:  # a variant that agrees nowhere is no lead
            continue
        closest.append({"variant": _text(c.get("variant")), "description": _text(c.get("description")), "source": _text(c.get("source")),
                        "agreed": _fmt(c.get("agreed")), "agreed_n": agreed, "of": _fmt(c.get("of")),
                        "first_difference": _text(c.get("first_difference"))})
    summary = _text(d.get("summary")).strip()
    if summary.lower().startswith(word.lower() + ":"):  # the badge already says it
        summary = summary[len(word) + 1:].strip()
    return {
        "status": status,
        "status_class": _DIAGNOSIS_CLASS.get(status, "neutral"),
        "word": word,
        "brief": brief,
        "note": _DIAGNOSIS_NOTE.get(status, ""),
        "summary": summary or _DIAGNOSIS_TEXT.get(status, "" if status in _DIAGNOSIS_WORD else "Diagnosis status not recognised."),
        "examples_compared": _fmt(d.get("examples_compared")),
        "examples_searched": _fmt(d.get("examples_searched")) if d.get("examples_searched") not in (None, d.get("examples_compared")) else None,
        "components": [entry(name) for name in components],
        "others": [entry(name) for name in described if name not in components],
        "by_check": by_check,
        "unexplained": [c for c in _names(d.get("unexplained")) if c not in passed],
        "anchors": anchors,
        "alternatives": [[_linked(name, anchors) for name in _names(alt)] for alt in _list(d.get("alternatives")) if _names(alt)],
        "alternatives_reason": _text(d.get("alternatives_reason")) if d.get("alternatives_reason") else ALIKE,
        "findings": [{"kind": _text(f.get("kind")), "checks": _names(f.get("checks")), "summary": _text(f.get("summary"))}
                     for f in map(_mapping, _list(d.get("findings")))],
        "hints": [{"checks": _names(h.get("checks")), "text": _text(h.get("text")),
                   "option": _text(h.get("option")) if h.get("option") is not None else None}
                  for h in map(_mapping, _list(d.get("hints")))],
        "closest": closest,
        "shares": [{"check": _text(check), "explained": _fmt(v.get("explained")), "of": _fmt(v.get("of")),
                    "percent": percent(_number_or_zero(v.get("share"))), "partial": _number_or_zero(v.get("share")) < 1,
                    "contradicted": _fmt(v.get("contradicted")) if v.get("contradicted") else None,
                    "components": [_linked(n, anchors) for n in _names(v.get("components"))]}
                   for check, v in ((c, _mapping(v)) for c, v in _mapping(d.get("shares")).items())],
        "residuals": [{"checks": _names(r.get("checks")), "count": _fmt(r.get("count")), "unexplained": bool(r.get("unexplained")),
                       "contradicted": _fmt(r.get("contradicted")) if r.get("contradicted") else None,
                       "float32_fits": _fmt(r.get("float32_fits")) if r.get("float32_fits") else None,
                       "against": " + ".join(_names(r.get("explanation"))) or "Algorithm 1",
                       "features": [{"feature": _text(f.get("feature")), "residual": _fmt(f.get("residual")), "of": _fmt(f.get("of")),
                                     "explained": _fmt(f.get("explained")), "explained_of": _fmt(f.get("explained_of")),
                                     "description": _text(f.get("description"))} for f in map(_mapping, _list(r.get("features")))],
                       "difference": _text(_mapping(r.get("counterexample")).get("difference")),
                       "replay": _text(_mapping(r.get("counterexample")).get("replay")),
                       "batch": json.dumps(_mapping(r.get("counterexample")).get("batch")) if _mapping(r.get("counterexample")).get("batch") else ""}
                      for r in map(_mapping, _list(d.get("residuals")))],
    }


def _linked(name: str, anchors: Mapping[str, str]) -> dict[str, Any]:
    return {"name": name, "anchor": anchors.get(name)}


def _cause_parts(cause: str, anchors: Mapping[str, str]) -> list[dict[str, Any]]:
    """A cause as linked deviation names; a combined cause is written "a + b"."""
    if cause in anchors or " + " not in cause:
        return [_linked(cause, anchors)]
    return [_linked(part.strip(), anchors) for part in cause.split(" + ")]


def _unusable_note(report: Mapping[str, Any]) -> str:
    """What an unusable or interrupted report must say first: it claims no pass."""
    if report.get("verdict") == "interrupted":
        return "The run was interrupted (Ctrl-C): only the examples tried before it are counted, and nothing was shrunk, diagnosed or probed after it."
    if report.get("load_error"):
        return f"The implementation could not be loaded: {_text(report.get('load_error'))}. No check ran."
    return "No call returned a usable result (every one raised, hung, crashed or returned the wrong type), so no check other than 'call' ran: nothing below is a pass."


def _output(raw: Any) -> dict[str, Any] | None:
    o = _mapping(raw)
    lines = _as_float(o.get("lines"))
    if not lines:
        return None
    return {"lines": _fmt(o.get("lines")), "first_lines": [_text(line) for line in _list(o.get("first_lines"))]}


def _validation(raw: Any) -> dict[str, Any]:
    v = _mapping(raw)
    probes = []
    for p in map(_mapping, _list(v.get("probes"))):
        status = _text(p.get("status"), "unknown")
        status_class, note = _PROBE_CLASS.get(status, "neutral"), _PROBE_NOTE.get(status, status)
        if p.get("expected") == "warned" and status == "rejected":
            status_class, note = "warn", "refused a setting that should be allowed with a warning"
        probes.append({"probe": _text(p.get("probe")), "description": _text(p.get("description")), "status": status,
                       "status_class": status_class, "note": note,
                       "message": _text(p.get("message"))})
    strict = v.get("strict")
    return {
        "strict": "yes" if strict is True else "no" if strict is False else _fmt(strict),
        "not_run": _text(v.get("not_run")) if v.get("not_run") else None,
        "probes": probes,
        "accepted": sum(1 for p in probes if p["status"] == "accepted"),
        "bad": sum(1 for p in probes if p["status_class"] == "bad"),
    }


def _tie_swaps(tokens: list[dict[str, Any]]) -> int:
    """Where the port's mask and Algorithm 1's differ only by which of several equal-M2
    tokens are kept (any choice among ties is admissible), those rows are marked as tie
    swaps, not differences; returns how many rows that is (0: a real difference, or none)."""
    swapped = [t for t in tokens if t["keep_differs"] and t["expected_keep"] != "\u2014" and t["actual_keep"] != "\u2014"]
    gained = sorted(t["m2"] for t in swapped if t["actual_keep"] == "keep")
    lost = sorted(t["m2"] for t in swapped if t["actual_keep"] == "removed")
    if not gained or not all(isinstance(v, (int, float)) for v in gained + lost) or gained != lost:
        return 0
    for t in swapped:
        t["keep_differs"], t["tie_swap"] = False, True
    return len(swapped)


def _not_run_reason(check: str, reasons: Mapping[str, Any], *, adapted: bool) -> str | None:
    """Why a check did not run: the adapter's reason, else, for a metric, that no result carried it."""
    if check in reasons:
        return _text(reasons[check])
    if check.startswith("metrics."):
        who = "the port" if adapted else "the implementation"
        return f"no result {who} returned carried {check.split('.', 1)[1]}"
    return None


def _counterexample(number: int, raw: Mapping[str, Any], anchors: Mapping[str, str] | None = None,
                    builds: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One counterexample's tables; ``builds`` (field -> how) are the values an adapter
    computed itself, shown as the adapter's, never as the port's "actual"."""
    anchors = anchors or {}
    builds = {name: _text(how) for name, how in (builds or {}).items()}
    expected = _mapping(raw.get("expected"))
    on_mask = _mapping(raw.get("expected_on_actual_mask"))
    actual = _mapping(raw.get("actual"))
    names = [n for n in _METRIC_ORDER if n in expected or n in on_mask or n in actual]
    names += [n for src in (expected, on_mask, actual) for n in src if n not in names]
    names = list(dict.fromkeys(names))
    metrics = [{
        "name": _text(name),
        "expected": _fmt(expected.get(name)),
        "on_mask": _fmt(on_mask.get(name)),
        "actual": _fmt(actual.get(name)),
        # The loss and metric checks compare against Algorithm 1 evaluated on the
        # implementation's own mask, so that is the reference for the highlight. A metric
        # the port does not report is not a difference: its check is "not run".
        "differs": name not in builds and actual.get(name) is not None
        and _numbers_differ(actual.get(name), on_mask.get(name) if name in on_mask else expected.get(name)),
        "built": builds.get(name),
    } for name in names]
    tokens = []
    for t in map(_mapping, _list(raw.get("tokens"))):
        tokens.append({
            "index": _index(t.get("index")),
            "padding": t.get("valid") is False,
            "valid": _fmt(t.get("valid")),
            "log_ratio": t.get("log_ratio"),
            "advantage": t.get("advantage"),
            "m2": t.get("m2"),
            "trust_region": _fmt(t.get("trust_region")),
            "expected_keep": _keep_label(t.get("expected_keep")),
            "actual_keep": _keep_label(t.get("actual_keep")),
            "keep_differs": _keep_differs(t.get("actual_keep"), t.get("expected_keep")),
            "expected_grad": _fmt(t.get("expected_grad")),
            "actual_grad": _fmt(t.get("actual_grad")),
            "grad_differs": "grad" not in builds and _numbers_differ(t.get("actual_grad"), t.get("expected_grad")),
            "tie_swap": False,
        })
    for column in ("log_ratio", "m2"):
        for token, text in zip(tokens, _column_texts([t[column] for t in tokens])):
            token[f"{column}_text"] = text
    ties = _tie_swaps(tokens) if raw.get("tokens_truncated") is not True else 0
    mismatches = [{
        "check": _text(m.get("check")),
        "summary": _text(m.get("summary")),
        "field": _text(m.get("field")),
        "index": _index(m.get("index")) if m.get("index") is not None else "",
        "actual": _fmt(m.get("actual")),
        "expected": _fmt(m.get("expected")),
        "has_values": m.get("actual") is not None or m.get("expected") is not None,
        "details": [_text(d) for d in _list(m.get("details"))],
    } for m in map(_mapping, _list(raw.get("mismatches")))]
    shape = _list(raw.get("shape"))
    check = _text(raw.get("check"), "?")
    cause = raw.get("cause")
    if isinstance(cause, str) and not cause.strip():
        cause = None
    return {
        "number": number,
        "anchor": f"cx-{number}",
        "check": check,
        # "cause": the deviation (or "a + b") that explains it, null when none does; absent in older reports.
        "cause": {"recorded": "cause" in raw, "name": _text(cause) if cause is not None else None,
                  "parts": _cause_parts(_text(cause), anchors) if cause is not None else []},
        "checks": [c for c in _names(raw.get("checks")) if c != check] if "checks" in raw else [],
        "summary": _text(raw.get("summary")),
        "replay": _text(raw.get("replay")),
        "shape": " \u00d7 ".join(_fmt(s) for s in shape) if shape else "\u2014",
        "tau": _fmt(_mapping(raw.get("batch")).get("tau", _mapping(raw.get("removal_curve")).get("tau"))),
        "mismatches": mismatches,
        "metrics": metrics,
        "no_actual": not actual,
        "tokens": tokens,
        "tokens_truncated": raw.get("tokens_truncated") is True,
        "tokens_differ": sum(1 for t in tokens if t["keep_differs"] or t["grad_differs"]),
        "tie_swaps": ties,
        "actual_keep_label": "keep (the adapter's, not the port's)" if "keep" in builds else "actual keep",
        "actual_grad_label": "grad (the adapter's, not the port's)" if "grad" in builds else "actual grad",
        "curve": _removal_curve(raw.get("removal_curve")),
        "ranks": _ranks(raw.get("ranks"), number, _padding(raw.get("tokens"))) if "ranks" in raw else None,
        "trainer_case": _trainer_case(raw.get("trainer_case")) if "trainer_case" in raw else None,
    }


_CASE_LABELS = (("seed", "seed"), ("prompts", "prompts"), ("group_size", "completions per prompt"), ("prompt_len", "prompt tokens"),
                ("max_new_tokens", "max new tokens"), ("lags", "worker lag per prompt (optimizer steps)"), ("staleness_lr", "staleness lr"),
                ("tau", "tau"), ("split", "rows per micro-batch"))


def _trainer_case(raw: Any) -> list[tuple[str, str]]:
    """The training step a trainer counterexample came from, as (label, value) rows."""
    case = _mapping(raw)
    rows = [(label, _text(json.dumps(_no_negative_zero(case[key])) if isinstance(case.get(key), list) else _fmt(case[key])))
            for key, label in _CASE_LABELS if key in case]
    step = _mapping(case.get("trainer"))
    if "loss" in step:
        rows.append(("step loss", _fmt(step["loss"])))
    if "tokens" in step:
        rows.append(("valid tokens", _fmt(step["tokens"])))
    if isinstance(step.get("rewards"), list):
        rows.append(("rewards", ", ".join(_fmt(r) for r in step["rewards"][:32])))
    return rows or [("case", _text(raw))]


def _no_negative_zero(value: Any) -> Any:
    """``value`` with every float zero (of either sign) as the int 0, for ``json.dumps``."""
    if isinstance(value, float) and value == 0:
        return 0
    if isinstance(value, list):
        return [_no_negative_zero(v) for v in value]
    if isinstance(value, dict):
        return {k: _no_negative_zero(v) for k, v in value.items()}
    return value


def _keep_label(value: Any) -> str:
    if value is None:
        return "\u2014"
    # "mask" is the input's name (valid tokens); a token the selection drops is "removed".
    return "keep" if value else "removed"


# --- distributed runs ----------------------------------------------------------------------

_AXES = ("dp", "cp", "tp")
_BIT_CLASS = {1: "k1", 0: "k0"}  # anything else is an unreadable cell, "ku"


def _topology_text(raw: Any) -> str:
    """The topology line, e.g. ``dp=2, cp=2, tp=1 on gloo, 4 ranks``; the raw value when it is not a mapping."""
    if not isinstance(raw, Mapping):
        return _fmt(raw)
    sizes = [(axis, raw.get(axis)) for axis in _AXES if axis in raw]
    text = ", ".join(f"{axis}={_fmt(size)}" for axis, size in sizes) or "unknown layout"
    if raw.get("backend") is not None:
        text += f" on {_fmt(raw.get('backend'))}"
    counts = [_as_int(raw.get(axis)) for axis in _AXES]
    if all(c is not None and c >= 1 for c in counts):
        world = counts[0] * counts[1] * counts[2]
        text += f", {world} rank{'' if world == 1 else 's'}"
    return text


def _coords(raw: Any) -> dict[str, str]:
    coords = _mapping(raw)
    return {axis: _fmt(coords.get(axis)) for axis in _AXES}


def _bytes(value: Any) -> str:
    """Human-readable byte count, binary units: 16 B, 1.5 KiB, 2.0 MiB."""
    n = _as_int(value)
    if n is None:
        return _fmt(value)
    if abs(n) >= 1024 ** 6:  # beyond PiB: a hand-edited report; float() could overflow
        return f"{n} B"
    size, unit = float(abs(n)), "B"
    for next_unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        if size < 1024:
            break
        size, unit = size / 1024, next_unit
    sign = "-" if n < 0 else ""
    return f"{sign}{int(size)} B" if unit == "B" else f"{sign}{size:.1f} {unit}"


def _collectives(raw: Any) -> dict[str, Any]:
    """The per-rank collective counts of one step: a column pair per kind, a total row."""
    entries = [e for e in _list(raw) if isinstance(e, Mapping)]
    kinds: list[str] = []
    for entry in entries:
        for kind in _mapping(entry.get("collectives")):
            if _text(kind) not in kinds:
                kinds.append(_text(kind))
    totals = {kind: [0, 0] for kind in kinds}

    def cell(stats: Any, kind: str) -> dict[str, str]:
        if stats is None:
            return {"calls": "\u2014", "bytes": "\u2014", "exact": ""}
        stats = _mapping(stats)
        calls, size = _as_int(stats.get("calls")), _as_int(stats.get("bytes"))
        if calls is not None:
            totals[kind][0] += calls
        if size is not None:
            totals[kind][1] += size
        return {"calls": _fmt(stats.get("calls")), "bytes": _bytes(stats.get("bytes")),
                "exact": f"{size} bytes" if size is not None else ""}

    rows = []
    for entry in entries[:_MAX_RANKS]:
        stats = {_text(k): v for k, v in _mapping(entry.get("collectives")).items()}
        rows.append({"rank": _fmt(entry.get("rank")), "coords": _coords(entry.get("coords")),
                     "cells": [cell(stats.get(kind), kind) for kind in kinds]})
    for entry in entries[_MAX_RANKS:]:  # counted in the totals even when not drawn
        stats = {_text(k): v for k, v in _mapping(entry.get("collectives")).items()}
        for kind in kinds:
            if stats.get(kind) is not None:
                cell(stats[kind], kind)
    return {
        "kinds": kinds,
        "rows": rows,
        "hidden": max(len(entries) - _MAX_RANKS, 0),
        "total": [{"calls": str(calls), "bytes": _bytes(size), "exact": f"{size} bytes"} for calls, size in totals.values()],
    }


def _bit(value: Any) -> int | None:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)) and value in (0, 1):
        return int(value)
    return None


def _mask(raw: Any) -> tuple[tuple[int | None, ...], ...] | None:
    """A rank's keep mask as rows of 0/1 (None for an unreadable cell); None when absent or not a 2-D list."""
    if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)):
        return None
    rows = []
    for row in raw:
        if not isinstance(row, Sequence) or isinstance(row, (str, bytes)):
            return None
        rows.append(tuple(_bit(c) for c in row))
    return tuple(rows)


def _rows_text(raw: Any) -> str:
    bounds = _list(raw)
    if len(bounds) != 2:
        return "\u2014" if not bounds else _fmt(bounds)
    start, stop = (_as_int(b) for b in bounds)
    if start is None or stop is None:
        return _fmt(bounds)
    if stop <= start:
        return "none"
    return f"{start}" if stop - start == 1 else f"{start}..{stop - 1}"


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _padding(raw_tokens: Any) -> set[tuple[int, int]]:
    """(row, column) of the padding tokens the token table lists (it may be truncated)."""
    padded = set()
    for t in map(_mapping, _list(raw_tokens)):
        index = [_as_int(i) for i in _list(t.get("index"))]
        if t.get("valid") is False and len(index) == 2 and None not in index:
            padded.add((index[0], index[1]))
    return padded


def _ranks(raw: Any, number: int, padding: set[tuple[int, int]] = frozenset()) -> dict[str, Any]:
    """Per-rank results of one counterexample, with DP replica groups that disagree on the mask.

    Ranks with the same ``dp`` coordinate hold replicas of the same rows and must keep the
    same mask. In a group that does not, every rank is highlighted, masks are labelled
    A, B, ... by how many ranks keep them (first seen wins a tie), and cells that differ
    from mask A are marked.
    """
    entries = _list(raw)
    ranks = [e for e in entries if isinstance(e, Mapping)]
    info: dict[str, Any] = {"malformed": not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)) or len(ranks) != len(entries),
                            "rows": [], "groups": [], "truncated": False, "hidden": max(len(ranks) - _MAX_RANKS, 0),
                            "limit": f"{_MASK_ROWS} rows \u00d7 {_MASK_COLS} tokens"}
    masks = [_mask(r.get("keep")) for r in ranks]
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(ranks):
        dp = _mapping(r.get("coords")).get("dp")
        if dp is not None and masks[i] is not None:
            groups.setdefault(_fmt(dp), []).append(i)
    label: dict[int, str] = {}
    reference: dict[int, tuple[tuple[int | None, ...], ...]] = {}
    for dp, members in groups.items():
        variants: dict[Any, list[int]] = {}
        for i in members:
            variants.setdefault(masks[i], []).append(i)
        if len(variants) < 2:
            continue
        ordered = sorted(variants.items(), key=lambda item: -len(item[1]))  # stable: first seen wins a tie
        for n, (mask, holders) in enumerate(ordered):
            letter = _letter(n)
            for i in holders:
                label[i], reference[i] = letter, ordered[0][0]
        info["groups"].append({"dp": dp, "ranks": ", ".join(_fmt(ranks[i].get("rank")) for i in members), "masks": len(variants)})

    for i, r in enumerate(ranks[:_MAX_RANKS]):
        mask = masks[i]
        error, stack = r.get("error"), r.get("stack")
        row: dict[str, Any] = {
            "rank": _fmt(r.get("rank")), "coords": _coords(r.get("coords")), "rows": _rows_text(r.get("rows")),
            "loss": r.get("loss"), "diverges": i in label, "variant": label.get(i, ""),
            "error": _text(error) if error is not None else None, "stack": _text(stack) if stack is not None else None,
            "anchor": f"cx-{number}-rank-{i}",
        }
        row["status"] = "error" if error is not None else "hung" if stack is not None else "returned" if mask is not None else "no mask"
        row["headline"] = _last_line(row["error"] or row["stack"] or "")
        if mask is None:
            row.update(kept="\u2014", grid=None, differ=0, cut="", unreadable=r.get("keep") is not None)
        else:
            ref = reference.get(i)
            # Rows are labelled with their index in the optimizer batch where the report says where the rank's rows start.
            start = _as_int(_list(r.get("rows"))[0]) if _list(r.get("rows")) else None
            first = start or 0
            shown = [(str(first + ri), [{"text": "?" if c is None else str(c), "cls": _BIT_CLASS.get(c, "ku"),
                                         "padding": start is not None and (first + ri, ci) in padding,
                                         "differs": ref is not None and _cell(ref, ri, ci) != c}
                                        for ci, c in enumerate(mask_row[:_MASK_COLS])])
                     for ri, mask_row in enumerate(mask[:_MASK_ROWS])]
            if ref is None or ref == mask:
                row["differ"] = 0
            else:  # over the whole mask, not just the part drawn, and positions only one side has
                height = max(len(mask), len(ref))
                row["differ"] = sum(_cell(mask, ri, ci) != _cell(ref, ri, ci) for ri in range(height)
                                    for ci in range(max(len(mask[ri]) if ri < len(mask) else 0, len(ref[ri]) if ri < len(ref) else 0)))
            cut = len(mask) > _MASK_ROWS or any(len(line) > _MASK_COLS for line in mask)
            info["truncated"] = info["truncated"] or cut
            row.update(kept=f"{sum(1 for line in mask for c in line if c == 1)} / {sum(len(line) for line in mask)}", grid=shown, unreadable=False,
                       cut=f"{len(mask)} \u00d7 {max((len(line) for line in mask), default=0)}" if cut else "")
        info["rows"].append(row)
    info["diverging"] = len(label)
    info["failed"] = [row for row in info["rows"] if row["error"] is not None or row["stack"] is not None]
    return info


def _letter(i: int) -> str:
    return chr(ord("A") + i) if i < 26 else f"#{i + 1}"


def _cell(mask: tuple[tuple[int | None, ...], ...], r: int, c: int) -> int | None | str:
    # "absent" (not None, which is an unreadable cell) where the mask has no such position.
    return mask[r][c] if r < len(mask) and c < len(mask[r]) else "absent"


# --- removal curve -------------------------------------------------------------------------

def _nice_step(span: float, target: int) -> float:
    """A 1-2-5 step giving about ``target`` intervals over ``span``."""
    raw = span / max(target, 1)
    if not math.isfinite(raw) or raw <= 0:
        return 1.0
    magnitude = 10.0 ** math.floor(math.log10(raw))
    for m in (1.0, 2.0, 5.0, 10.0):
        if raw <= m * magnitude:
            return m * magnitude
    return 10.0 * magnitude


def _tick_label(value: float) -> str:
    if value == 0:
        return "0"
    return f"{value:.3g}"


def _removal_curve(raw: Any) -> dict[str, Any]:
    """Plot geometry for the M2 removal curve of one counterexample.

    Algorithm 1 removes trust-region tokens largest-M2 first while the mean M2 of those
    left exceeds tau. With n candidates sorted by M2 ascending and P_k the mean of the k
    smallest, removing r tokens leaves k = n - r, so the curve is (r, P_{n-r}) for
    r = 0 .. n-1; r = n (everything removed) has no mean and only carries the stop markers.
    The oracle may stop anywhere in n - k_max .. n - k_min (rounding ambiguity), drawn as a band.
    """
    rc = _mapping(raw)
    means = _list(rc.get("prefix_means"))
    n = _as_int(rc.get("candidates"))
    if n is None or n < 0:
        n = len(means)
    tau = _as_float(rc.get("tau"))
    kmin, kmax, kimpl = (_as_int(rc.get(key)) for key in ("oracle_kept_min", "oracle_kept_max", "implementation_kept"))
    info = {
        "empty": n == 0,
        "n": n,
        "tau": _fmt(rc.get("tau")) if "tau" in rc else "\u2014",
        "oracle_kept": _kept_text(kmin, kmax),
        "implementation_kept": _fmt(kimpl) if kimpl is not None else "no result",
        "truncated": 0 < len(means) < n,
        "shown": min(len(means), n),
        "rows": [],
    }
    if n == 0:
        return info

    # (removed, P_k) pairs; values may be None (missing), nan or +-inf.
    points = []
    for r in range(n):
        k = n - r
        value = _as_float(means[k - 1]) if k - 1 < len(means) else None
        points.append((r, k, value))
        info["rows"].append({"removed": r, "kept": k, "mean": _fmt(means[k - 1]) if k - 1 < len(means) else "\u2014",
                             "within": value is not None and tau is not None and value <= tau})

    finite = [v for _, _, v in points if v is not None and math.isfinite(v)]
    if tau is not None and math.isfinite(tau):
        finite.append(tau)
    log = False
    positives = [v for v in finite if v > 0]
    if positives and all(v >= 0 for v in finite) and max(positives) / min(positives) > _LOG_SPREAD:
        log = True
        lo_exp = math.floor(math.log10(min(positives)))
        hi_exp = math.ceil(math.log10(max(positives)))
        if hi_exp == lo_exp:
            hi_exp += 1
        lo, hi = float(lo_exp), float(hi_exp)
        stride = max(1, math.ceil((hi_exp - lo_exp) / 6))
        y_ticks = [(float(e), f"1e{e}") for e in range(lo_exp, hi_exp + 1, stride)]
    else:
        if finite:
            lo, hi = min(min(finite), 0.0), max(max(finite), 0.0)
        else:
            lo, hi = 0.0, 1.0
        if hi == lo:
            hi = 1.0
        # Halves keep the arithmetic finite for values near +-1.8e308.
        step = 2.0 * _nice_step(hi / 2 - lo / 2, 5)
        rounded_lo, rounded_hi = math.floor(lo / step) * step, math.ceil(hi / step) * step
        lo = rounded_lo if math.isfinite(rounded_lo) else lo
        hi = rounded_hi if math.isfinite(rounded_hi) else hi
        y_ticks = []
        for i in range(21):
            tick = lo + i * step
            if not math.isfinite(tick) or tick > hi + step * 1e-9:
                break
            y_ticks.append((tick, _tick_label(tick)))

    def y_scaled(v: float) -> float:
        return _MT + _PH - (v / 2 - lo / 2) / (hi / 2 - lo / 2) * _PH

    def y_of(value: float | None) -> tuple[float | None, str]:
        """SVG y of a data value, clamped to the plot, with why it was clamped."""
        if value is None or math.isnan(value):
            return None, ""
        if value == math.inf:
            return _MT, "above"
        if value == -math.inf:
            return _MT + _PH, "below"
        if log:
            if value <= 0:
                return _MT + _PH, "below"
            v = math.log10(value)
        else:
            v = value
        y = y_scaled(v)
        if y < _MT - 1e-9:
            return _MT, "above"
        if y > _MT + _PH + 1e-9:
            return _MT + _PH, "below"
        return y, ""

    def x_of(removed: float) -> float:
        return _ML + (removed / n) * _PW

    segments: list[list[tuple[float, float]]] = [[]]
    markers, clipped = [], []
    for r, k, value in points:
        y, clip = y_of(value)
        if y is None or clip:
            if segments[-1]:
                segments.append([])
            if y is not None:
                clipped.append({"x": _r(x_of(r)), "y": _r(y), "up": clip == "above", "label": _fmt_short(value), "removed": r})
            continue
        segments[-1].append((x_of(r), y))
        markers.append({"x": _r(x_of(r)), "y": _r(y), "within": None if tau is None or math.isnan(tau) else value <= tau,
                        "title": f"removed {r}, kept {k}: mean M2 {_fmt(value)}"})
    polylines = [" ".join(f"{_r(x)},{_r(y)}" for x, y in seg) for seg in segments if len(seg) > 1]

    x_step = max(1, int(_nice_step(n, 8)))
    x_ticks = [(_r(x_of(t)), str(t)) for t in range(0, n + 1, x_step)]
    if x_ticks[-1][1] != str(n):
        x_ticks.append((_r(x_of(n)), str(n)))

    tau_y, tau_clip = y_of(tau)
    oracle = None
    if kmin is not None and kmax is not None:
        a, b = sorted((_clamp(n - kmax, 0, n), _clamp(n - kmin, 0, n)))
        oracle = {"x1": _r(x_of(a)), "x2": _r(x_of(b)), "band": a != b, "removed": a if a == b else f"{a}-{b}",
                  "width": _r(max(x_of(b) - x_of(a), 0.0))}
    impl = None
    if kimpl is not None:
        removed = n - kimpl
        impl = {"x": _r(x_of(_clamp(removed, 0, n))), "removed": removed, "outside": not 0 <= removed <= n}

    info.update({
        "width": _W, "height": _H,
        "plot": {"left": _ML, "top": _MT, "right": _ML + _PW, "bottom": _MT + _PH, "width": _PW, "height": _PH},
        "log": log,
        "polylines": polylines,
        "markers": markers if len(markers) <= _MAX_MARKERS else [],
        "clipped": clipped[:_MAX_MARKERS],
        "x_ticks": x_ticks,
        "y_ticks": [(_r(y_scaled(v)), label) for v, label in y_ticks],
        "tau_y": _r(tau_y) if tau_y is not None else None,
        "tau_clipped": tau_clip,
        "oracle": oracle,
        "impl": impl,
    })
    return info


def _kept_text(kmin: int | None, kmax: int | None) -> str:
    if kmin is None or kmax is None:
        return "\u2014"
    return str(kmin) if kmin == kmax else f"{kmin} to {kmax}"


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


def _r(value: float) -> float:
    # Two decimals keep the SVG small without visible error; + 0.0 turns -0.0 into 0.0.
    return round(value, 2) + 0.0
