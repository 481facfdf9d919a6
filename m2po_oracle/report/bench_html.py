"""The bench's HTML page, rendered from its JSON record (schema ``m2po-oracle/bench/1``) alone:
the table of every size and the log-log plot of the medians against tokens."""

from __future__ import annotations

import math
import pathlib
from typing import Any

from m2po_oracle.report.environment import environment


def _plot(rows: list[dict[str, Any]]) -> dict[str, Any]:
    width, height, left, top, right, bottom = 760, 380, 70, 20, 90, 50
    inner_w, inner_h = width - left - right, height - top - bottom
    xs = [math.log2(r["tokens"]) for r in rows]
    methods = list(rows[0]["median_ms"])  # the bench's columns, in its order
    ys = [math.log10(max(r["median_ms"][m], 1e-6)) for r in rows for m in methods]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = math.floor(min(ys)), math.ceil(max(ys)) if math.ceil(max(ys)) > math.floor(min(ys)) else math.floor(min(ys)) + 1
    px = lambda x: left + (x - x0) / (x1 - x0) * inner_w  # noqa: E731
    py = lambda y: top + inner_h - (y - y0) / (y1 - y0) * inner_h  # noqa: E731
    colours = {"sort": "#c0392b", "radix": "#1f6feb", "floor": "#6b7785", "forward": "#2da44e", "unfused": "#8250df", "passes": "#9a6700"}
    series = []
    for m in methods:
        points = [(px(math.log2(r["tokens"])), py(math.log10(max(r["median_ms"][m], 1e-6)))) for r in rows]
        series.append(
            {
                "name": m,
                "colour": colours.get(m, "#1d2430"),
                "points": " ".join(f"{x:.1f},{y:.1f}" for x, y in points),
                "label_y": points[-1][1] + 4,
            }
        )
    return {
        "width": width,
        "height": height,
        "left": left,
        "top": top,
        "inner_w": inner_w,
        "inner_h": inner_h,
        "series": series,
        "xticks": [{"x": px(math.log2(r["tokens"])), "label": f"2^{round(math.log2(r['tokens']))}"} for r in rows],
        "yticks": [{"y": py(v), "label": f"{10.0**v:g} ms"} for v in range(y0, y1 + 1)],
    }


def render_bench_html(record: dict[str, Any]) -> str:
    env = record.get("environment", {})
    return (
        environment(strict=False)
        .get_template("bench.html.j2")
        .render(
            device=record["device"],
            threads=env.get("threads"),
            repeats=record["repeats"],
            tau=record["tau"],
            rows=record["rows"],
            plot=_plot(record["rows"]),
            torch=env.get("torch"),
            platform=env.get("platform"),
            gpu=env.get("gpu"),
            fused_passes=env.get("fused_passes", "not recorded"),
        )
    )


def write_bench_html(record: dict[str, Any], path: pathlib.Path) -> None:
    """Write :func:`render_bench_html` of ``record`` to ``path`` as UTF-8, creating parent folders."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_bench_html(record), encoding="utf-8")
