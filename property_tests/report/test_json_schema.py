"""The JSON records' declarations (m2po_oracle.report.schema) are what real runs write.

Small real runs of the command line, in this process, write every record the toolkit has:
compare (a correct core, a port that cannot be loaded, a negative control that yields
counterexamples and a diagnosis, an adapted port, a distributed step, a training step with
--capture), the audit of that capture and of a capture with a planted bug, the capture's
manifests, and both benches. Each key path they write must be declared with its type; each
path declared must be written by one of them, or say in ``when`` (on itself or a parent)
which records have it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from m2po_oracle.cli.main import EXIT_DIVERGENT, EXIT_EQUIVALENT, EXIT_UNUSABLE, main
from m2po_oracle.report.fields import Field, FromDataclass, Schema, parent_of
from m2po_oracle.report.schema import SCHEMAS, schema_of

# The distributed run starts a world of processes: keep this module's runs on one worker.
pytestmark = pytest.mark.xdist_group("json_schema")

#: A mask-only port (Algorithm 1's own selection): the adapter's fields of the report.
PORT = """
import torch
from m2po_oracle.core.loss import select_tokens


def mask_only(log_ratio, advantages, mask, tau):
    return select_tokens(log_ratio, torch.zeros_like(log_ratio), advantages, mask, tau=tau).keep
"""


def _compare(directory: Path, name: str, *argv: str) -> tuple[int, Path]:
    report = directory / f"{name}.json"
    return main(["compare", *argv, "--json", str(report)]), report


def _planted_capture(directory: Path) -> Path:
    """A data-parallel step (the audit benchmark's) whose first micro-batch keeps every valid
    token: the audit's selection check fails, and its counterexample is a token table."""
    from m2po_oracle.bench.audit import synthetic_step, write_capture

    step = synthetic_step(4096)
    first = step["order"][0]
    write_capture(directory, step, bug=(first, step["parts"][first][3]))
    return directory


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[int, list[Path]]]:
    """Each run's exit status and the JSON files it wrote, by run name."""
    tmp = tmp_path_factory.mktemp("json_schema")
    (tmp / "port.py").write_text(PORT)
    capture = tmp / "capture"
    out: dict[str, tuple[int, list[Path]]] = {}
    for name, argv in {
        "core": ("--impl", "core", "--examples", "5", "--in-process"),
        "unusable": ("--impl", f"{tmp / 'port.py'}:no_such_function", "--examples", "2", "--in-process"),
        "control": (
            "--impl",
            "control:leak_clamp_float32_metrics",
            "--examples",
            "8",
            "--no-shrink",
            "--in-process",
            "--accept",
            "float32_metrics",
        ),
        "adapter": ("--impl", f"{tmp / 'port.py'}:mask_only", "--adapter", "mask_only", "--examples", "3", "--in-process"),
        "distributed": ("--impl", "control:kept_count_denominator", "--topology", "dp=2", "--examples", "3", "--no-shrink"),
        "trainer": ("--impl", "trainer:embedding_gradient_dropped", "--examples", "2", "--no-shrink", "--capture", str(capture)),
    }.items():
        status, report = _compare(tmp, name, *argv)
        out[name] = status, [report]
    out["capture"] = EXIT_EQUIVALENT, sorted(capture.glob("manifest.rank-*.json"))
    out["audit"] = main(["audit", str(capture), "--json", str(tmp / "audit.json")]), [tmp / "audit.json"]
    planted = _planted_capture(tmp / "planted")
    out["planted_audit"] = (
        main(["audit", str(planted), "--json", str(tmp / "planted.json")]),
        [tmp / "planted.json", *sorted(planted.glob("manifest.rank-*.json"))],
    )
    bench = ["bench", "--sizes", "10", "--repeats", "1", "--ranks", "2", "--json", str(tmp / "bench.json")]
    out["bench"] = main(bench), [tmp / "bench.json"]
    out["bench_audit"] = (
        main(["bench", "--audit", "--tokens", "4096", "--json", str(tmp / "bench_audit.json")]),
        [tmp / "bench_audit.json"],
    )
    return out


def _strict(path: Path) -> object:
    """The file as JSON, refusing NaN and Infinity (not standard JSON: a value the encoder
    let through unconverted)."""

    def refuse(constant: str) -> None:
        raise ValueError(f"{path.name}: {constant} is not standard JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


@pytest.fixture(scope="module")
def records(runs) -> dict[str, list[dict]]:
    """Every record the runs wrote, by schema name."""
    out: dict[str, list[dict]] = {name: [] for name in SCHEMAS}
    for _, paths in runs.values():
        for path in paths:
            record = _strict(path)
            out[schema_of(record).name].append(record)
    return out


def unwritten(schema: Schema, records: list[dict]) -> list[str]:
    """The paths ``schema`` declares that no record has, and neither it nor a parent says when."""
    written = {path for record in records for path in schema.paths(record)}
    fields = schema.fields()
    conditional = {f.path for f in fields if f.when}

    def said(path: str) -> bool:
        """Whether the path or a field it is under has a ``when``."""
        while path:
            if path in conditional:
                return True
            path = re.sub(r"(\[\]|\{\})+$", "", parent_of(path))
        return False

    return [f.path for f in fields if f.path not in written and not said(f.path)]


def test_the_runs_did_what_they_are_here_for(runs, records):
    statuses = {name: status for name, (status, _) in runs.items()}
    assert statuses == {
        "core": EXIT_EQUIVALENT,
        "unusable": EXIT_UNUSABLE,
        "control": EXIT_DIVERGENT,
        "adapter": EXIT_EQUIVALENT,
        "distributed": EXIT_DIVERGENT,
        "trainer": EXIT_DIVERGENT,
        "capture": EXIT_EQUIVALENT,
        "audit": EXIT_DIVERGENT,
        "planted_audit": EXIT_DIVERGENT,
        "bench": EXIT_EQUIVALENT,
        "bench_audit": EXIT_EQUIVALENT,
    }
    assert all(records[name] for name in SCHEMAS), {name: len(found) for name, found in records.items()}


def test_every_key_path_a_run_writes_is_declared_with_its_type(records):
    found = [
        f"{name}: {problem}"
        for name, schema_records in records.items()
        for record in schema_records
        for problem in SCHEMAS[name].problems(record)
    ]
    assert not found, "the JSON records and m2po_oracle/report/schema.py disagree:\n" + "\n".join(sorted(set(found)))


def test_every_declared_path_is_written_by_a_run_or_says_when(records):
    found = {name: unwritten(schema, records[name]) for name, schema in SCHEMAS.items()}
    found = {name: paths for name, paths in found.items() if paths}
    assert not found, f"declared in m2po_oracle/report/schema.py, written by none of these runs and without a `when`: {found}"


def test_a_key_the_builder_adds_without_declaring_it_fails(tmp_path, monkeypatch, records):
    from m2po_oracle.compare.report import CompareReport

    to_json = CompareReport.to_json
    monkeypatch.setattr(CompareReport, "to_json", lambda self: {**to_json(self), "typed_by_hand": 1})
    status, report = _compare(tmp_path, "planted", "--impl", "core", "--examples", "2", "--in-process", "--skip-validation")
    assert status == EXIT_EQUIVALENT
    assert SCHEMAS["compare"].problems(_strict(report)) == ["typed_by_hand: not declared"]

    record = json.loads(json.dumps(records["compare"][0]))
    record["checks"][0]["status"] = 1
    del record["environment"]["torch"]
    record["coverage"]["families"]["new_family"] = 2  # a map's keys are data: any key is declared
    assert SCHEMAS["compare"].problems(record) == [
        "checks[].status: declared string, found 1",
        "environment.torch: missing (declared with no condition, `when`)",
    ]


def test_a_declared_path_no_run_writes_is_found(records):
    schema = SCHEMAS["audit"]
    planted = dataclasses.replace(schema, declared=(*schema.declared, Field("steps[].typed_by_hand", "string", "?")))
    assert unwritten(planted, records["audit"]) == ["steps[].typed_by_hand"]
    explained = dataclasses.replace(schema, declared=(*schema.declared, Field("steps[].typed_by_hand", "string", "?", when="never")))
    assert unwritten(explained, records["audit"]) == []


def test_a_dataclass_field_without_a_meaning_is_refused():
    source = "m2po_oracle.explain.deviations:Accepted"
    with pytest.raises(ValueError, match=r"fields without a meaning: \['link'\]"):
        FromDataclass("accepted[]", source, {"deviation": "its name", "reason": "why"}).fields()
    with pytest.raises(ValueError, match=r"no field of the dataclass: \['url'\]"):
        FromDataclass("accepted[]", source, {"deviation": "a", "reason": "b", "link": "c", "url": "d"}).fields()
    with pytest.raises(ValueError, match="is not declared as an object"):
        Schema("x", "m2po_oracle.audit.records:SCHEMA", "", "", (), (Field("a", "string", "?"), Field("a.b", "string", "?"))).fields()
