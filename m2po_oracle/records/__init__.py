"""The toolkit's JSON records, declared once as typed, frozen dataclasses: the key paths each
file has, their types (a status is a ``Literal``) and meanings, and which keys are written only
under a condition. From these declarations come the published JSON Schema (draft 2020-12,
``docs/reference/schemas/``), the JSON reference page and the typed loader; msgspec derives
all three (see the architecture page for why msgspec).

``property_tests/report/test_records.py`` holds the declarations to what real runs write, and
``docs/gen_reference.py`` writes the schema files and the reference page from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from m2po_oracle.records import audit, bench, capture, compare


@dataclass(frozen=True)
class Record:
    """One JSON file the toolkit writes: its name, schema id, type, writer and what it is."""

    name: str
    id: str
    type: type
    writer: str
    about: str


RECORDS: dict[str, Record] = {
    r.name: r
    for r in (
        Record(
            "compare",
            compare.SCHEMA,
            compare.CompareRecord,
            "`m2po-oracle compare --json PATH` (and the pytest plugin's and `python -m m2po_oracle.torchrun`'s)",
            "A run of a loss function, a distributed step or a training step against Algorithm 1; the HTML report is rendered "
            "from it and nothing else.",
        ),
        Record(
            "audit", audit.SCHEMA, audit.AuditRecord, "`m2po-oracle audit DIR --json PATH`", "The offline audit of a capture, step by step."
        ),
        Record(
            "capture",
            capture.SCHEMA,
            capture.CaptureManifest,
            "`m2po_oracle.capture.Recorder`: `DIR/manifest.rank-NNN.json`",
            "One rank's manifest of a capture: every record it wrote, with a CRC-32 of each file.",
        ),
        Record(
            "bench",
            bench.SCHEMA,
            bench.BenchRecord,
            "`m2po-oracle bench --json PATH`",
            "The selection's and the core forward's speed, side by side.",
        ),
        Record(
            "bench-audit",
            bench.AUDIT_SCHEMA,
            bench.BenchAuditRecord,
            "`m2po-oracle bench --audit --json PATH`",
            "How long the offline audit takes on one synthetic step, correct and with a planted bug.",
        ),
    )
}

DIALECT = "https://json-schema.org/draft/2020-12/schema"


def json_schema(name: str) -> dict[str, Any]:
    """The published JSON Schema of record ``name`` (draft 2020-12)."""
    record = RECORDS[name]
    schema = msgspec.json.schema(record.type)
    for declared in schema.get("$defs", {}).values():
        if "properties" in declared:  # a record has exactly the keys it declares
            declared["additionalProperties"] = False
    return {"$schema": DIALECT, "title": record.id, "description": f"{record.about} Written by {record.writer}.", **schema}


def record_of(data: Any) -> Record:
    """The record a loaded JSON value declares itself to be (its ``schema``); a ValueError naming the ids known."""
    found = next((r for r in RECORDS.values() if isinstance(data, dict) and r.id == data.get("schema")), None)
    if found is None:
        schema = data.get("schema") if isinstance(data, dict) else None
        raise ValueError(f"schema: {schema!r} is no record of this toolkit; expected one of {', '.join(r.id for r in RECORDS.values())}")
    return found


def load(data: Any) -> Any:
    """``data`` (as ``json.load`` gives it) as its typed record; a ValueError saying what of it
    does not match its declaration, and where."""
    try:
        return msgspec.convert(data, record_of(data).type)
    except msgspec.ValidationError as error:
        raise ValueError(f"{record_of(data).id}: {error}") from None
