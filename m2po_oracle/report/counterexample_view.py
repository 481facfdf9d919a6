"""One counterexample of a compare page: its mismatches, metrics, token table, training
case, removal curve and ranks, read from the report's JSON alone."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from m2po_oracle.report.curve_view import removal_curve
from m2po_oracle.report.ranks_view import padding_cells, ranks_view
from m2po_oracle.report.values import (
    as_list,
    as_mapping,
    as_names,
    as_text,
    column_texts,
    fmt,
    index_text,
    keep_differs,
    keep_label,
    no_negative_zero,
    numbers_differ,
)

# The order a reader expects; unknown extra metrics follow in report order.
_METRIC_ORDER = (
    "loss",
    "m2_before",
    "m2_after",
    "masked_fraction",
    "trust_region_fraction",
    "valid_count",
    "trust_region_count",
    "kept_trust_region_count",
)


def linked(name: str, anchors: Mapping[str, str]) -> dict[str, Any]:
    return {"name": name, "anchor": anchors.get(name)}


def cause_parts(cause: str, anchors: Mapping[str, str]) -> list[dict[str, Any]]:
    """A cause as linked deviation names; a combined cause is written "a + b"."""
    if cause in anchors or " + " not in cause:
        return [linked(cause, anchors)]
    return [linked(part.strip(), anchors) for part in cause.split(" + ")]


def _tie_swaps(tokens: list[dict[str, Any]]) -> int:
    """Where the port's mask and Algorithm 1's differ only by which of several equal-M2
    tokens are kept (any choice among ties is admissible), those rows are marked as tie
    swaps, not differences; returns how many rows that is (0: a real difference, or none)."""
    swapped = [t for t in tokens if t["keep_differs"] and t["expected_keep"] != "\u2014" and t["actual_keep"] != "\u2014"]
    gained = [t["m2"] for t in swapped if t["actual_keep"] == "keep"]
    lost = [t["m2"] for t in swapped if t["actual_keep"] == "removed"]
    # A record may hold a token without its M2 (null) or with "nan": no swap is read from those.
    if not gained or not all(isinstance(v, (int, float)) and v == v for v in gained + lost) or sorted(gained) != sorted(lost):
        return 0
    for t in swapped:
        t["keep_differs"], t["tie_swap"] = False, True
    return len(swapped)


def counterexample_view(
    number: int, raw: Mapping[str, Any], anchors: Mapping[str, str] | None = None, builds: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """One counterexample's tables; ``builds`` (field -> how) are the values an adapter
    computed itself, shown as the adapter's, never as the port's "actual"."""
    anchors = anchors or {}
    builds = {name: as_text(how) for name, how in (builds or {}).items()}
    expected = as_mapping(raw.get("expected"))
    on_mask = as_mapping(raw.get("expected_on_actual_mask"))
    actual = as_mapping(raw.get("actual"))
    names = [n for n in _METRIC_ORDER if n in expected or n in on_mask or n in actual]
    names += [n for src in (expected, on_mask, actual) for n in src if n not in names]
    names = list(dict.fromkeys(names))
    metrics = [
        {
            "name": as_text(name),
            "expected": fmt(expected.get(name)),
            "on_mask": fmt(on_mask.get(name)),
            "actual": fmt(actual.get(name)),
            # The loss and metric checks compare against Algorithm 1 evaluated on the
            # implementation's own mask, so that is the reference for the highlight. A metric
            # the port does not report is not a difference: its check is "not run".
            "differs": name not in builds
            and actual.get(name) is not None
            and numbers_differ(actual.get(name), on_mask.get(name) if name in on_mask else expected.get(name)),
            "built": builds.get(name),
        }
        for name in names
    ]
    tokens = []
    for t in map(as_mapping, as_list(raw.get("tokens"))):
        tokens.append(
            {
                "index": index_text(t.get("index")),
                "padding": t.get("valid") is False,
                "valid": fmt(t.get("valid")),
                "log_ratio": t.get("log_ratio"),
                "advantage": t.get("advantage"),
                "m2": t.get("m2"),
                "trust_region": fmt(t.get("trust_region")),
                "expected_keep": keep_label(t.get("expected_keep")),
                "actual_keep": keep_label(t.get("actual_keep")),
                "keep_differs": keep_differs(t.get("actual_keep"), t.get("expected_keep")),
                "expected_grad": fmt(t.get("expected_grad")),
                "actual_grad": fmt(t.get("actual_grad")),
                "grad_differs": "grad" not in builds and numbers_differ(t.get("actual_grad"), t.get("expected_grad")),
                "tie_swap": False,
            }
        )
    for column in ("log_ratio", "m2"):
        for token, text in zip(tokens, column_texts([t[column] for t in tokens])):
            token[f"{column}_text"] = text
    ties = _tie_swaps(tokens) if raw.get("tokens_truncated") is not True else 0
    mismatches = [
        {
            "check": as_text(m.get("check")),
            "summary": as_text(m.get("summary")),
            "field": as_text(m.get("field")),
            "index": index_text(m.get("index")) if m.get("index") is not None else "",
            "actual": fmt(m.get("actual")),
            "expected": fmt(m.get("expected")),
            "has_values": m.get("actual") is not None or m.get("expected") is not None,
            "details": [as_text(d) for d in as_list(m.get("details"))],
        }
        for m in map(as_mapping, as_list(raw.get("mismatches")))
    ]
    shape = as_list(raw.get("shape"))
    check = as_text(raw.get("check"), "?")
    cause = raw.get("cause")
    if isinstance(cause, str) and not cause.strip():
        cause = None
    return {
        "number": number,
        "anchor": f"cx-{number}",
        "check": check,
        # "cause": the deviation (or "a + b") that explains it, null when none does; absent in older reports.
        "cause": {
            "recorded": "cause" in raw,
            "name": as_text(cause) if cause is not None else None,
            "parts": cause_parts(as_text(cause), anchors) if cause is not None else [],
        },
        "checks": [c for c in as_names(raw.get("checks")) if c != check] if "checks" in raw else [],
        "summary": as_text(raw.get("summary")),
        "replay": as_text(raw.get("replay")),
        "shrink_stopped": as_text(raw.get("shrink_stopped")) if raw.get("shrink_stopped") else None,
        "shape": " \u00d7 ".join(fmt(s) for s in shape) if shape else "\u2014",
        "tau": fmt(as_mapping(raw.get("batch")).get("tau", as_mapping(raw.get("removal_curve")).get("tau"))),
        "mismatches": mismatches,
        "metrics": metrics,
        "no_actual": not actual,
        "tokens": tokens,
        "tokens_truncated": raw.get("tokens_truncated") is True,
        "tokens_differ": sum(1 for t in tokens if t["keep_differs"] or t["grad_differs"]),
        "tie_swaps": ties,
        "actual_keep_label": "keep (the adapter's, not the port's)" if "keep" in builds else "actual keep",
        "actual_grad_label": "grad (the adapter's, not the port's)" if "grad" in builds else "actual grad",
        "curve": removal_curve(raw.get("removal_curve")),
        "ranks": ranks_view(raw.get("ranks"), number, padding_cells(raw.get("tokens"))) if "ranks" in raw else None,
        "trainer_case": _trainer_case(raw.get("trainer_case")) if "trainer_case" in raw else None,
    }


_CASE_LABELS = (
    ("seed", "seed"),
    ("prompts", "prompts"),
    ("group_size", "completions per prompt"),
    ("prompt_len", "prompt tokens"),
    ("max_new_tokens", "max new tokens"),
    ("lags", "worker lag per prompt (optimizer steps)"),
    ("staleness_lr", "staleness lr"),
    ("tau", "tau"),
    ("split", "rows per micro-batch"),
)


def _trainer_case(raw: Any) -> list[tuple[str, str]]:
    """The training step a trainer counterexample came from, as (label, value) rows."""
    case = as_mapping(raw)
    rows = [
        (label, as_text(json.dumps(no_negative_zero(case[key])) if isinstance(case.get(key), list) else fmt(case[key])))
        for key, label in _CASE_LABELS
        if key in case
    ]
    step = as_mapping(case.get("trainer"))
    if "loss" in step:
        rows.append(("step loss", fmt(step["loss"])))
    if "tokens" in step:
        rows.append(("valid tokens", fmt(step["tokens"])))
    if isinstance(step.get("rewards"), list):
        rows.append(("rewards", ", ".join(fmt(r) for r in step["rewards"][:32])))
    return rows or [("case", as_text(raw))]
