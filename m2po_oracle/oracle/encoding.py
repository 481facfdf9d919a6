"""The one JSON encoding of the package's records (compare, audit, bench, batches).

A record is a typed declaration (a frozen dataclass): :func:`to_builtins` derives its JSON from
the declaration (msgspec walks the fields in order and leaves out a field that is ``UNSET``,
the way a record says "this key only where ..."), so no record writes itself by hand.

Strict JSON has no NaN or infinity, and a NaN loss is exactly what a report must be able to
say: non-finite numbers are written as the strings "nan", "inf" and "-inf" (the renderers
read them back), numpy scalars as plain Python numbers. Every report file is written through
:func:`write_json`, which refuses anything else with ``allow_nan=False``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import msgspec
import numpy as np


def number(value: Any) -> Any:
    """A JSON-safe scalar: non-finite floats become strings, numpy scalars plain Python."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (np.bool_,)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        value = float(value)
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return value
    return repr(value)


def json_safe(value: Any) -> Any:
    """``value`` with every mapping, list and tuple walked and every scalar through :func:`number`."""
    if isinstance(value, dict):
        return {str(key): json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return number(value)


def _array(value: Any) -> Any:
    """What msgspec does not know: numpy arrays (a boolean one as 0/1, as a batch's ``valid``)
    and scalars."""
    if isinstance(value, np.ndarray):
        return value.astype(int).tolist() if value.dtype == np.bool_ else value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"no JSON form for {type(value).__name__}")


def to_builtins(record: Any) -> Any:
    """The JSON form of a typed record: its fields in declaration order, ``UNSET`` ones left
    out, tuples as lists, every scalar through :func:`number`."""
    return json_safe(msgspec.to_builtins(record, enc_hook=_array))


def write_json(record: Any, path: Path) -> None:
    """Write ``record`` as indented strict JSON to ``path``, creating its parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json_safe(record), indent=2, allow_nan=False))
