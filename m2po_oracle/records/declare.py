"""How a record's field is declared: its type (a ``Literal`` for a status), ``doc(meaning)`` for
what it means, and, for a key written only under a condition, ``UNSET`` as its default with
``doc(..., when=...)`` saying when (msgspec leaves an ``UNSET`` field out of the JSON).

A map (an object whose keys are data: check names, deviations) is a ``dict[str, T]`` with
``doc(..., keys=...)`` saying what its keys are. ``when`` and ``keys`` travel in the published
JSON Schema as the annotations ``x-when`` and ``x-keys``.
"""

from __future__ import annotations

from typing import Literal

from msgspec import Meta

#: Strict JSON has no NaN or infinity: a report writes them as these strings
#: (:func:`m2po_oracle.oracle.encoding.number`).
NonFinite = Literal["nan", "inf", "-inf"]
Number = float | NonFinite
#: The capture's manifests spell them as JavaScript and Python's float() read them.
CaptureNonFinite = Literal["NaN", "Infinity", "-Infinity"]
CaptureNumber = float | CaptureNonFinite


def doc(meaning: str, *, when: str = "", keys: str = "") -> Meta:
    """A field's meaning, and when it is written (empty: wherever its parent is) and, for a
    map, what its keys are."""
    extra = {**({"x-when": when} if when else {}), **({"x-keys": keys} if keys else {})}
    return Meta(description=meaning, extra_json_schema=extra or None)
