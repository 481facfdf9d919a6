"""The M2 removal curve of one counterexample, as SVG geometry the template draws."""

from __future__ import annotations

import math
from typing import Any

from m2po_oracle.report.values import as_float, as_int, as_list, as_mapping, clamped, fmt, fmt_short, rounded

# Removal-curve geometry in SVG user units; the SVG scales with its container.
_W, _H = 680, 300


_ML, _MR, _MT, _MB = 78, 20, 18, 48


_PW, _PH = _W - _ML - _MR, _H - _MT - _MB


# Past this many points the markers would merge into a smear; draw the line only.
_MAX_MARKERS = 80


# A y spread wider than this is unreadable on a linear axis.
_LOG_SPREAD = 1e3


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


def removal_curve(raw: Any) -> dict[str, Any]:
    """Plot geometry for the M2 removal curve of one counterexample.

    Algorithm 1 removes trust-region tokens largest-M2 first while the mean M2 of those
    left exceeds tau. With n candidates sorted by M2 ascending and P_k the mean of the k
    smallest, removing r tokens leaves k = n - r, so the curve is (r, P_{n-r}) for
    r = 0 .. n-1; r = n (everything removed) has no mean and only carries the stop markers.
    The oracle may stop anywhere in n - k_max .. n - k_min (rounding ambiguity), drawn as a band.
    """
    rc = as_mapping(raw)
    means = as_list(rc.get("prefix_means"))
    n = as_int(rc.get("candidates"))
    if n is None or n < 0:
        n = len(means)
    tau = as_float(rc.get("tau"))
    kmin, kmax, kimpl = (as_int(rc.get(key)) for key in ("oracle_kept_min", "oracle_kept_max", "implementation_kept"))
    info: dict[str, Any] = {
        "empty": n == 0,
        "n": n,
        "tau": fmt(rc.get("tau")) if "tau" in rc else "\u2014",
        "oracle_kept": _kept_text(kmin, kmax),
        "implementation_kept": fmt(kimpl) if kimpl is not None else "no result",
        "truncated": 0 < len(means) < n,
        "shown": min(len(means), n),
        "rows": [],
    }
    if n == 0:
        return info

    # (removed, P_k) pairs; values may be None (missing), nan or +-inf. Only the means the
    # report carries (a truncated curve's first removals have none): a count of candidates,
    # however large, costs nothing more.
    points = []
    for r in range(max(0, n - len(means)), n):
        k = n - r
        value = as_float(means[k - 1]) if k - 1 < len(means) else None
        points.append((r, k, value))
        info["rows"].append(
            {
                "removed": r,
                "kept": k,
                "mean": fmt(means[k - 1]) if k - 1 < len(means) else "\u2014",
                "within": value is not None and tau is not None and value <= tau,
            }
        )

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

    # A span of subnormal values halves to zero: draw it flat rather than divide by it.
    span = (hi / 2 - lo / 2) or 1.0

    def y_scaled(v: float) -> float:
        return _MT + _PH - (v / 2 - lo / 2) / span * _PH

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
                clipped.append({"x": rounded(x_of(r)), "y": rounded(y), "up": clip == "above", "label": fmt_short(value), "removed": r})
            continue
        assert value is not None  # y_of gives a y for a number only
        segments[-1].append((x_of(r), y))
        markers.append(
            {
                "x": rounded(x_of(r)),
                "y": rounded(y),
                "within": None if tau is None or math.isnan(tau) else value <= tau,
                "title": f"removed {r}, kept {k}: mean M2 {fmt(value)}",
            }
        )
    polylines = [" ".join(f"{rounded(x)},{rounded(y)}" for x, y in seg) for seg in segments if len(seg) > 1]

    x_step = max(1, int(_nice_step(n, 8)))
    x_ticks = [(rounded(x_of(t)), str(t)) for t in range(0, n + 1, x_step)]
    if x_ticks[-1][1] != str(n):
        x_ticks.append((rounded(x_of(n)), str(n)))

    tau_y, tau_clip = y_of(tau)
    oracle = None
    if kmin is not None and kmax is not None:
        a, b = sorted((clamped(n - kmax, 0, n), clamped(n - kmin, 0, n)))
        oracle = {
            "x1": rounded(x_of(a)),
            "x2": rounded(x_of(b)),
            "band": a != b,
            "removed": a if a == b else f"{a}-{b}",
            "width": rounded(max(x_of(b) - x_of(a), 0.0)),
        }
    impl = None
    if kimpl is not None:
        removed = n - kimpl
        impl = {"x": rounded(x_of(clamped(removed, 0, n))), "removed": removed, "outside": not 0 <= removed <= n}

    info.update(
        {
            "width": _W,
            "height": _H,
            "plot": {"left": _ML, "top": _MT, "right": _ML + _PW, "bottom": _MT + _PH, "width": _PW, "height": _PH},
            "log": log,
            "polylines": polylines,
            "markers": markers if len(markers) <= _MAX_MARKERS else [],
            "clipped": clipped[:_MAX_MARKERS],
            "x_ticks": x_ticks,
            "y_ticks": [(rounded(y_scaled(v)), label) for v, label in y_ticks],
            "tau_y": rounded(tau_y) if tau_y is not None else None,
            "tau_clipped": tau_clip,
            "oracle": oracle,
            "impl": impl,
        }
    )
    return info


def _kept_text(kmin: int | None, kmax: int | None) -> str:
    if kmin is None or kmax is None:
        return "\u2014"
    return str(kmin) if kmin == kmax else f"{kmin} to {kmax}"
