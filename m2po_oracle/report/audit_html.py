"""The HTML report of ``m2po-oracle audit``, rendered from its JSON (schema
``m2po-oracle/audit/1``) and nothing else: a timeline of every audited step (M2 before and
after, masked fraction, tau, verdict), the per-step table and the worst step first."""

from __future__ import annotations

import math
import pathlib
import shlex
from collections.abc import Mapping
from typing import Any

import jinja2

from m2po_oracle.report.environment import environment

_TEMPLATE = "audit.html.j2"
#: The timeline's plot area in SVG units.
WIDTH, HEIGHT, MARGIN = 900, 220, 40


def _value(metrics: Mapping[str, Any], name: str) -> float | None:
    value = metrics.get(name)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) else None


def _series(steps: list[Mapping[str, Any]], name: str, top: float) -> str:
    """SVG polyline points of one metric over the steps (steps without it are skipped)."""
    points = []
    for i, step in enumerate(steps):
        value = _value(step.get("metrics") or {}, name)
        if value is None:
            continue
        x = MARGIN + (WIDTH - 2 * MARGIN) * (i / max(len(steps) - 1, 1))
        y = HEIGHT - MARGIN - (HEIGHT - 2 * MARGIN) * (value / top if top else 0.0)
        points.append(f"{x:.1f},{y:.1f}")
    return " ".join(points)


def _view(report: Mapping[str, Any], directory: str) -> dict[str, Any]:
    steps = [s for s in report.get("steps") or [] if isinstance(s, Mapping)]
    m2_top = max(
        [v for s in steps for v in (_value(s.get("metrics") or {}, k) for k in ("m2_before", "m2_after", "tau")) if v is not None] or [1.0]
    )
    worst = next((s for s in steps if s.get("step") == report.get("worst_step")), None)
    replay = shlex.join(["m2po-oracle", "audit", directory, "--step", str(worst["step"])]) if worst else ""
    markers = [
        {"x": MARGIN + (WIDTH - 2 * MARGIN) * (i / max(len(steps) - 1, 1)), "verdict": s.get("verdict", ""), "step": s.get("step")}
        for i, s in enumerate(steps)
    ]
    return {
        "report": report,
        "steps": steps,
        "worst": worst,
        "replay": replay,
        "markers": markers,
        "m2_top": m2_top,
        "m2_before": _series(steps, "m2_before", m2_top),
        "m2_after": _series(steps, "m2_after", m2_top),
        "tau": _series(steps, "tau", m2_top),
        "masked": _series(steps, "masked_fraction", 1.0),
        "width": WIDTH,
        "height": HEIGHT,
        "margin": MARGIN,
    }


def render_audit_html(report: Mapping[str, Any]) -> str:
    directory = str((report.get("capture") or {}).get("directory", ""))
    return environment(strict=False).get_template(_TEMPLATE).render(v=_view(report, directory), number=_number)


def _number(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "" if value is None or isinstance(value, jinja2.Undefined) else str(value)
    if value == 0:
        return "0"  # never "-0.0"
    return f"{value:.6g}"


def write_audit_html(report: Mapping[str, Any], path: pathlib.Path) -> None:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_audit_html(report), encoding="utf-8")
