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

import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any, cast

from m2po_oracle.explain.diagnosis import ALIKE
from m2po_oracle.judge.coverage import THINLY_EXERCISED, percent, thinly_exercised
from m2po_oracle.report.counterexample_view import counterexample_view, linked
from m2po_oracle.report.environment import environment
from m2po_oracle.report.ranks_view import collectives_view, topology_text
from m2po_oracle.report.values import as_float, as_int, as_list, as_mapping, as_names, as_text, duration_text, fmt, number_or_zero

__all__ = ["render_html", "write_html"]

TEMPLATE = "report.html.j2"


def held_out_text(held: Mapping[str, Any]) -> str:
    """A share's held-out counts: reproduced of failing, and what it contradicts there."""
    text = f"{fmt(held.get('explained'))} of {fmt(held.get('failing'))}"
    return text + (f" ({fmt(held.get('contradicted'))} contradicted)" if held.get("contradicted") else "")


def render_html(report: Mapping[str, Any]) -> str:
    """The report as a standalone HTML document (inline CSS and SVG, no scripts, no network)."""
    return environment().get_template(TEMPLATE).render(r=view(report))


def write_html(report: Mapping[str, Any], path: pathlib.Path) -> None:
    """Write :func:`render_html` of ``report`` to ``path`` as UTF-8, creating parent folders."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_html(report), encoding="utf-8")


# --- scalar helpers ------------------------------------------------------------------------


# --- comparisons for highlighting ----------------------------------------------------------


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
_DIAGNOSIS_CLASS = {
    "matched": "bad",
    "mostly_explained": "bad",
    "partly_explained": "warn",
    "no_known_variant": "warn",
    "not_needed": "ok",
    "not_run": "neutral",
}
# The one line a report without a diagnosis to show gets instead of the explanation box.
DIAGNOSIS_NOTE = {
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


def view(report: Mapping[str, Any]) -> dict[str, Any]:
    report = as_mapping(report)
    options = as_mapping(report.get("options"))
    verdict = as_text(report.get("verdict"), "unknown")
    examples = report.get("examples", options.get("examples"))
    raw_checks = [as_mapping(check) for check in as_list(report.get("checks"))]
    diagnosis = (
        _diagnosis(report.get("diagnosis"), [(as_text(c.get("name"), "?"), as_text(c.get("status"), "?")) for c in raw_checks])
        if "diagnosis" in report
        else None
    )
    anchors = diagnosis["anchors"] if diagnosis is not None else {}
    builds = as_mapping(as_mapping(report.get("adapter")).get("builds"))
    counterexamples = [
        counterexample_view(i, cx, anchors, builds)
        for i, cx in enumerate(as_list(report.get("counterexamples")), start=1)
        if isinstance(cx, Mapping)
    ]
    first_cx: dict[str, str] = {}
    for cx in counterexamples:
        for name in [cx["check"], *cx["checks"]]:
            first_cx.setdefault(name, cx["anchor"])
    # A diagnosis that was not needed or not run explains nothing, whatever else it carries:
    # no check is "unexplained" and no counterexample has a cause (not even "unexplained").
    shown = diagnosis is not None and not diagnosis["brief"]
    by_check = cast("dict[str, Any]", diagnosis)["by_check"] if shown else {}  # shown: there is a diagnosis
    unexplained = set(cast("dict[str, Any]", diagnosis)["unexplained"]) if shown else set()  # as above
    if not shown:
        for cx in counterexamples:
            cx["cause"] = {"recorded": False, "name": None, "parts": []}
    not_run_reasons = as_mapping(as_mapping(report.get("adapter")).get("not_run"))
    checks = []
    failed: int  # a check's verdict in the loop (a bool), then how many checks failed
    for check in raw_checks:
        name = as_text(check.get("name"), "?")
        status = as_text(check.get("status"), "?")
        failed = status == "fail"
        checks.append(
            {
                "name": name,
                "description": as_text(check.get("description")),
                "status": status,
                "failed": failed,
                "status_class": _CHECK_CLASS.get(status, "neutral"),
                "failures": fmt(check.get("failures")),
                "ran": fmt(check.get("ran")),
                "anchor": first_cx.get(name),
                "exercised": fmt(check.get("exercised")) if "exercised" in check else "\u2014",
                "failure_rate": _failure_rate(check.get("failures"), check.get("exercised"), check.get("failure_rate_upper_95")),
                "exercised_when": as_text(as_mapping(as_mapping(report.get("coverage")).get("exercised_when")).get(name)),
                # Only a failing check has something to explain.
                "explained_by": [linked(n, anchors) for n in by_check.get(name, [])] if failed else [],
                # A check the adapter cannot run says why (and often which binding would run it).
                "not_run_reason": _not_run_reason(name, not_run_reasons, adapted=bool(report.get("adapter")))
                if status == "not run"
                else None,
                "unexplained": failed and name in unexplained,
            }
        )
    failed = sum(1 for c in checks if c["failed"])
    not_run = sum(1 for c in checks if c["status"] == "not run")
    topology = topology_text(report.get("topology")) if report.get("topology") is not None else None
    # The first counterexample goes in the explanation box at the top, unless there is nothing to explain.
    top = counterexamples[0] if counterexamples and diagnosis is not None and not diagnosis["brief"] else None
    rest = counterexamples[1:] if top is not None else counterexamples
    return {
        "schema": as_text(report.get("schema"), "unknown schema"),
        "verdict": verdict,
        "verdict_class": _VERDICT_CLASS.get(verdict, "neutral"),
        "verdict_text": _VERDICT_TEXT.get(verdict, "the report does not state a known verdict"),
        "implementation": as_text(report.get("implementation"), "(unnamed implementation)"),
        "summary": [
            ("implementation", as_text(report.get("implementation"), "\u2014")),
            *([("topology", topology)] if topology is not None else []),
            ("dtype", as_text(options.get("dtype"), "\u2014")),
            ("compute dtype", as_text(options.get("compute_dtype"), "\u2014")),
            (f"{as_text(report.get('example_unit'), 'batches')} tried", fmt(examples)),
            ("seed", fmt(options.get("seed"))),
            (
                "tau",
                f"drawn per {'step' if report.get('example_unit') == 'steps' else 'batch'}"
                if options.get("tau") is None
                else fmt(options.get("tau")),
            ),
            ("device", as_text(options.get("device"), "\u2014")),
            ("duration", duration_text(report.get("duration_s"))),
            *(
                [
                    (
                        "capture",
                        f"{as_text(capture.get('directory'))} ({fmt(capture.get('steps'))} steps): m2po-oracle audit {as_text(capture.get('directory'))}",
                    )
                ]
                if isinstance(capture := report.get("capture"), Mapping)
                else []
            ),
            *(
                [("bindings", ", ".join(as_text(b) for b in as_list(adapter.get("bindings"))))]
                if (adapter := as_mapping(report.get("adapter"))) and adapter.get("bindings")
                else []
            ),
            # Last and full width: the call the adapter makes is a line of its own.
            *(
                [("adapter", f"{as_text(adapter.get('name'))}: {as_text(adapter.get('call'), as_text(adapter.get('signature')))}")]
                if adapter
                else []
            ),
            # Which of the port's values each metric check judged (its own names, e.g. 'm2' read as m2_before).
            *(
                [
                    (
                        "metrics read",
                        ", ".join(f"{as_text(k)} \u2190 {as_text(v)}" for k, v in as_mapping(adapter.get("metrics_read")).items()),
                    )
                ]
                if adapter and as_mapping(adapter.get("metrics_read"))
                else []
            ),
        ],
        "checks": checks,
        "checks_failed": failed,
        "checks_not_run": not_run,
        "coverage": _coverage(report.get("coverage")) if "coverage" in report else None,
        "unusable_note": _unusable_note(report) if verdict in ("unusable", "interrupted") else None,
        "thin": thinly_exercised([as_mapping(c) for c in as_list(report.get("checks"))]),
        "thin_bound": THINLY_EXERCISED,
        "stopped_early": as_text(report.get("stopped_early")) if report.get("stopped_early") else None,
        "output": _output(report.get("implementation_output")),
        "counterexamples": counterexamples,
        "top_counterexample": top,
        "cause_groups": _cause_groups(rest, diagnosis),
        "example_unit": as_text(report.get("example_unit"), "batches"),
        "diagnosis": diagnosis,
        "validation": _validation(report.get("validation")) if "validation" in report else None,
        "collectives": collectives_view(report.get("collectives_per_step")) if "collectives_per_step" in report else None,
        "tolerances": [
            {
                "dtype": as_text(t.get("dtype")),
                "quantity": as_text(t.get("quantity")),
                "rtol": fmt(t.get("rtol")),
                "atol": fmt(t.get("atol")),
            }
            for t in map(as_mapping, as_list(report.get("tolerances")))
        ],
        "environment": [(as_text(k), as_text(v, "\u2014")) for k, v in as_mapping(report.get("environment")).items()],
    }


def _failure_rate(failures: Any, exercised: Any, upper: Any) -> str:
    """ "< 0.6%" with no failure, "30% (< 42%)" with some, a dash where nothing was exercised
    (or the report predates the bound)."""
    n, f, bound = as_int(exercised), as_int(failures), as_float(upper)
    if n is None or n <= 0 or f is None or f < 0 or bound is None or not 0 <= bound <= 1:
        return "\u2014"
    if f == 0:
        return f"< {percent(bound)}"
    return percent(1.0) if f >= n else f"{percent(f / n)} (< {percent(bound)})"


def _coverage(raw: Any) -> dict[str, Any]:
    """The coverage table: strategy families and features, each with its count."""
    raw = as_mapping(raw)
    descriptions = as_mapping(raw.get("feature_descriptions"))

    def counts(value: Any) -> list[tuple[str, str]]:
        return [(as_text(k), fmt(v)) for k, v in as_mapping(value).items()]

    return {
        "examples": fmt(raw.get("examples")),
        "judged": fmt(raw.get("judged")),
        "families": counts(raw.get("families")),
        "features": [(name, count, as_text(descriptions.get(name))) for name, count in counts(raw.get("features"))],
        "unmeasured": fmt(raw.get("unmeasured")) if raw.get("unmeasured") else None,
    }


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


def _diagnosis(raw: Any, checks: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
    """The explanation box: the best explanation of the failing checks and what else the diagnosis found.

    ``checks`` are the report's (name, status) pairs: a deviation is listed as explaining
    only checks that failed, in the check table's order. Keys a report lacks (reports older
    than the explanation schema) read as empty."""
    d = as_mapping(raw)
    status = as_text(d.get("status"), "unknown")
    word = _DIAGNOSIS_WORD.get(status, status)
    by_check = {as_text(check): as_names(names) for check, names in as_mapping(d.get("by_check")).items()}
    order = {name: i for i, (name, _) in enumerate(checks)}
    passed = {name for name, state in checks if state != "fail"}
    matches: dict[str, Mapping[str, Any]] = {}
    for m in map(as_mapping, as_list(d.get("matches"))):
        if m.get("variant") is not None:
            matches.setdefault(as_text(m.get("variant")), m)
    components = list(dict.fromkeys(as_names(d.get("components"))))
    # A described deviation: every component, then the matches that are not components
    # (in a report older than "components", every match).
    described = components + [name for name in matches if name not in components]
    brief = status in DIAGNOSIS_NOTE  # nothing to explain: the page shows one line, so nothing to link to
    anchors = {} if brief else {name: f"deviation-{i + 1}" for i, name in enumerate(described)}

    def explains(name: str) -> list[str]:
        explained = [check for check, names in by_check.items() if name in names]
        if not explained and "checks" in matches.get(name, {}):
            explained = as_names(matches[name].get("checks"))
        return sorted((c for c in explained if c not in passed), key=lambda c: order.get(c, len(order)))

    def entry(name: str) -> dict[str, Any]:
        m = matches.get(name, {})
        return {
            "name": name,
            "anchor": anchors.get(name),
            "description": as_text(m.get("description")),
            "source": as_text(m.get("source")),
            "evidence": as_text(m.get("evidence")),
            "checks": explains(name),
        }

    closest = []
    for c in map(as_mapping, as_list(d.get("closest"))):
        agreed = number_or_zero(c.get("agreed"))
        if agreed <= 0:  # a variant that agrees nowhere is no lead
            continue
        closest.append(
            {
                "variant": as_text(c.get("variant")),
                "description": as_text(c.get("description")),
                "source": as_text(c.get("source")),
                "agreed": fmt(c.get("agreed")),
                "agreed_n": agreed,
                "of": fmt(c.get("of")),
                "first_difference": as_text(c.get("first_difference")),
            }
        )
    summary = as_text(d.get("summary")).strip()
    if summary.lower().startswith(word.lower() + ":"):  # the badge already says it
        summary = summary[len(word) + 1 :].strip()
    return {
        "status": status,
        "status_class": _DIAGNOSIS_CLASS.get(status, "neutral"),
        "word": word,
        "brief": brief,
        "note": DIAGNOSIS_NOTE.get(status, ""),
        "summary": summary or _DIAGNOSIS_TEXT.get(status, "" if status in _DIAGNOSIS_WORD else "Diagnosis status not recognised."),
        "examples_compared": fmt(d.get("examples_compared")),
        "examples_searched": fmt(d.get("examples_searched"))
        if d.get("examples_searched") not in (None, d.get("examples_compared"))
        else None,
        "components": [entry(name) for name in components],
        "others": [entry(name) for name in described if name not in components],
        "by_check": by_check,
        "unexplained": [c for c in as_names(d.get("unexplained")) if c not in passed],
        # An unexplained check whose failing examples a residual paragraph characterises is
        # said to be unexplained there: the bare line names only the others.
        "unexplained_alone": [
            c
            for c in as_names(d.get("unexplained"))
            if c not in passed
            and not any(
                as_mapping(r).get("unexplained") and c in as_names(as_mapping(r).get("checks")) for r in as_list(d.get("residuals"))
            )
        ],
        "anchors": anchors,
        "alternatives": [[linked(name, anchors) for name in as_names(alt)] for alt in as_list(d.get("alternatives")) if as_names(alt)],
        "alternatives_reason": as_text(d.get("alternatives_reason")) if d.get("alternatives_reason") else ALIKE,
        "findings": [
            {"kind": as_text(f.get("kind")), "checks": as_names(f.get("checks")), "summary": as_text(f.get("summary"))}
            for f in map(as_mapping, as_list(d.get("findings")))
        ],
        "hints": [
            {
                "checks": as_names(h.get("checks")),
                "text": as_text(h.get("text")),
                "option": as_text(h.get("option")) if h.get("option") is not None else None,
            }
            for h in map(as_mapping, as_list(d.get("hints")))
        ],
        "closest": closest,
        "shares": [
            {
                "check": as_text(check),
                "explained": fmt(v.get("explained")),
                "of": fmt(v.get("of")),
                "percent": percent(number_or_zero(v.get("share"))),
                "partial": number_or_zero(v.get("share")) < 1,
                "contradicted": fmt(v.get("contradicted")) if v.get("contradicted") else None,
                "held_out": held_out_text(as_mapping(v.get("held_out"))) if v.get("held_out") else None,
                "components": [linked(n, anchors) for n in as_names(v.get("components"))],
            }
            for check, v in ((c, as_mapping(v)) for c, v in as_mapping(d.get("shares")).items())
        ],
        "residuals": [
            {
                "checks": as_names(r.get("checks")),
                "count": fmt(r.get("count")),
                "unexplained": bool(r.get("unexplained")),
                "contradicted": fmt(r.get("contradicted")) if r.get("contradicted") else None,
                "float32_fits": fmt(r.get("float32_fits")) if r.get("float32_fits") else None,
                "against": " + ".join(as_names(r.get("explanation"))) or "Algorithm 1",
                "features": [
                    {
                        "feature": as_text(f.get("feature")),
                        "residual": fmt(f.get("residual")),
                        "of": fmt(f.get("of")),
                        "explained": fmt(f.get("explained")),
                        "explained_of": fmt(f.get("explained_of")),
                        "compared": bool(f.get("explained_of")),  # some reproduced example to compare with
                        "description": as_text(f.get("description")),
                    }
                    for f in map(as_mapping, as_list(r.get("features")))
                ],
                "difference": as_text(as_mapping(r.get("counterexample")).get("difference")),
                "replay": as_text(as_mapping(r.get("counterexample")).get("replay")),
                "batch": json.dumps(as_mapping(r.get("counterexample")).get("batch"))
                if as_mapping(r.get("counterexample")).get("batch")
                else "",
            }
            for r in map(as_mapping, as_list(d.get("residuals")))
        ],
    }


def _unusable_note(report: Mapping[str, Any]) -> str:
    """What an unusable or interrupted report must say first: it claims no pass."""
    if report.get("verdict") == "interrupted":
        return "The run was interrupted (Ctrl-C): only the examples tried before it are counted, and nothing was shrunk, diagnosed or probed after it."
    if report.get("load_error"):
        return f"The implementation could not be loaded: {as_text(report.get('load_error'))}. No check ran."
    return "No call returned a usable result (every one raised, hung, crashed or returned the wrong type), so no check other than 'call' ran: nothing below is a pass."


def _output(raw: Any) -> dict[str, Any] | None:
    o = as_mapping(raw)
    lines = as_float(o.get("lines"))
    if not lines:
        return None
    return {"lines": fmt(o.get("lines")), "first_lines": [as_text(line) for line in as_list(o.get("first_lines"))]}


def _validation(raw: Any) -> dict[str, Any]:
    v = as_mapping(raw)
    probes = []
    for p in map(as_mapping, as_list(v.get("probes"))):
        status = as_text(p.get("status"), "unknown")
        status_class, note = _PROBE_CLASS.get(status, "neutral"), _PROBE_NOTE.get(status, status)
        if p.get("expected") == "warned" and status == "rejected":
            status_class, note = "warn", "refused a setting that should be allowed with a warning"
        probes.append(
            {
                "probe": as_text(p.get("probe")),
                "description": as_text(p.get("description")),
                "status": status,
                "status_class": status_class,
                "note": note,
                "message": as_text(p.get("message")),
            }
        )
    strict = v.get("strict")
    return {
        "strict": "yes" if strict is True else "no" if strict is False else fmt(strict),
        "not_run": as_text(v.get("not_run")) if v.get("not_run") else None,
        "probes": probes,
        "accepted": sum(1 for p in probes if p["status"] == "accepted"),
        "bad": sum(1 for p in probes if p["status_class"] == "bad"),
    }


def _not_run_reason(check: str, reasons: Mapping[str, Any], *, adapted: bool) -> str | None:
    """Why a check did not run: the adapter's reason, else, for a metric, that no result carried it."""
    if check in reasons:
        return as_text(reasons[check])
    if check.startswith("metrics."):
        who = "the port" if adapted else "the implementation"
        return f"no result {who} returned carried {check.split('.', 1)[1]}"
    return None


# --- distributed runs ----------------------------------------------------------------------


# --- removal curve -------------------------------------------------------------------------
