"""The report's values as the pages print them.

A report is untrusted and possibly partial JSON (an older or newer schema, a failed
implementation with no results): these helpers read any value with a default and never
raise, and print numbers so that two printed values differ exactly when the numbers do.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

# Token-table highlighting is a visual cue only; the checks themselves use the tolerance
# table. 1e-9 relative is far above float64 rounding yet flags any real difference.
GRAD_RTOL = 1e-9


def as_float(value: Any) -> float | None:
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


def as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        return int(value)
    return None


def fmt(value: Any) -> str:
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
        return "[" + ", ".join(fmt(v) for v in value) + "]"
    return str(value)


def fmt_short(value: Any) -> str:
    """Six significant digits for dense tables; the full value goes in a tooltip."""
    if isinstance(value, float) and math.isfinite(value) and value != 0:
        return f"{value:.6g}"
    return fmt(value)


def column_texts(values: Sequence[Any]) -> list[str]:
    """A dense column's values at six significant digits, or at as many more as it takes for
    distinct numbers to print distinctly (up to a round trip): tokens whose M2 differ in the
    last bits, where the cut falls between them, must not look tied."""
    numbers = {v for v in values if isinstance(v, float) and math.isfinite(v) and v != 0}
    digits = next((d for d in range(6, 17) if len({f"{v:.{d}g}" for v in numbers}) == len(numbers)), 17)
    return [f"{v:.{digits}g}" if isinstance(v, float) and math.isfinite(v) and v != 0 else fmt(v) for v in values]


def fixed_text(value: float, digits: int) -> str:
    """``value`` with ``digits`` decimals; a value that rounds to zero prints without a minus sign."""
    text = f"{value:.{digits}f}"
    return text[1:] if text.startswith("-") and float(text) == 0 else text


def index_text(value: Any) -> str:
    if isinstance(value, Sequence) and not isinstance(value, str):
        return "(" + ", ".join(fmt(v) for v in value) + ")"
    return fmt(value)


def as_mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, Sequence) and not isinstance(value, (str, bytes)) else []


def as_text(value: Any, default: str = "") -> str:
    return default if value is None else fmt(value)


def numbers_differ(actual: Any, expected: Any, rtol: float = GRAD_RTOL) -> bool:
    """True when a reader should look twice: one side missing, or values apart by more than ``rtol``."""
    if actual is None and expected is None:
        return False
    a, e = as_float(actual), as_float(expected)
    if a is None or e is None:
        return actual != expected
    if math.isnan(a) or math.isnan(e):
        return not (math.isnan(a) and math.isnan(e))
    if math.isinf(a) or math.isinf(e):
        return a != e
    return abs(a - e) > rtol * max(abs(a), abs(e))


def keep_differs(actual: Any, expected: Any) -> bool:
    # A missing actual keep (the call failed) counts as different: there is no agreement to show.
    return actual is None or expected is None or bool(actual) != bool(expected)


def duration_text(value: Any) -> str:
    seconds = as_float(value)
    if seconds is None or not math.isfinite(seconds):
        return fmt(value)
    return f"{fixed_text(seconds, 1)} s"


def as_names(value: Any) -> list[str]:
    """A list of names from a list (or, from a hand-edited report, a single string)."""
    if isinstance(value, str):
        return [value]
    return [as_text(v) for v in as_list(value) if v is not None]


def number_or_zero(value: Any) -> float:
    number = as_float(value)
    return number if number is not None and math.isfinite(number) else 0.0


def no_negative_zero(value: Any) -> Any:
    """``value`` with every float zero (of either sign) as the int 0, for ``json.dumps``."""
    if isinstance(value, float) and value == 0:
        return 0
    if isinstance(value, list):
        return [no_negative_zero(v) for v in value]
    if isinstance(value, dict):
        return {k: no_negative_zero(v) for k, v in value.items()}
    return value


def keep_label(value: Any) -> str:
    if value is None:
        return "\u2014"
    # "mask" is the input's name (valid tokens); a token the selection drops is "removed".
    return "keep" if value else "removed"


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def clamped(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


def rounded(value: float) -> float:
    # Two decimals keep the SVG small without visible error; + 0.0 turns -0.0 into 0.0.
    return round(value, 2) + 0.0
