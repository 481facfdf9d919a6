"""The JSON records' typed declarations (m2po_oracle.records) and their published
schemas are what real runs write, and the renderers render any record the declarations allow.

Small real runs of the command line, in this process, write every record the toolkit has:
compare (a correct core, a port that cannot be loaded, a negative control that yields
counterexamples and a diagnosis, an adapted port, a distributed step, a training step with
--capture), the audit of that capture and of a capture with a planted bug, the capture's
manifests, and both benches. Each must validate against the schema file published under
docs/reference/schemas/ (closed records: an undeclared key fails; a key declared without
``when`` is required) and load as its typed record.
"""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
import types
import typing
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from msgspec import UNSET, UnsetType
from rich.console import Console

from m2po_oracle.capture import recorder
from m2po_oracle.cli.console import print_report
from m2po_oracle.cli.main import EXIT_DIVERGENT, EXIT_EQUIVALENT, EXIT_UNUSABLE, main
from m2po_oracle.oracle.encoding import to_builtins
from m2po_oracle.records import RECORDS, capture, json_schema, load, record_of
from m2po_oracle.records.audit import AuditRecord
from m2po_oracle.records.compare import CompareRecord
from m2po_oracle.report.audit_html import render_audit_html
from m2po_oracle.report.html import render_html

# The distributed run starts a world of processes: keep this module's runs on one worker.
pytestmark = pytest.mark.xdist_group("json_schema")

PUBLISHED = Path(__file__).resolve().parents[2] / "docs" / "reference" / "schemas"


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
    # A capture with one unreadable file: its step is unusable, and its record says so too.
    broken = tmp / "broken"
    shutil.copytree(capture, broken)
    next(broken.glob("step-000000/*.safetensors")).write_bytes(b"not a safetensors file")
    out["broken_audit"] = main(["audit", str(broken), "--json", str(tmp / "broken.json")]), [tmp / "broken.json"]
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
    out: dict[str, list[dict]] = {name: [] for name in RECORDS}
    for _, paths in runs.values():
        for path in paths:
            record = _strict(path)
            out[record_of(record).name].append(record)
    return out


def problems(record: dict) -> list[str]:
    """What the published schema says is wrong with ``record``, each at its key path."""
    schema = json.loads((PUBLISHED / f"{record_of(record).name}.schema.json").read_text())
    found = jsonschema.Draft202012Validator(schema).iter_errors(record)
    return sorted(f"{'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message[:160]}" for e in found)


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
        "broken_audit": EXIT_DIVERGENT,
        "bench": EXIT_EQUIVALENT,
        "bench_audit": EXIT_EQUIVALENT,
    }
    assert all(records[name] for name in RECORDS), {name: len(found) for name, found in records.items()}
    steps = _strict(runs["broken_audit"][1][0])["steps"]
    assert steps[0]["verdict"] == "unusable" and steps[0]["metrics"] is None


def test_every_record_a_run_writes_validates_against_its_published_schema(records):
    found = [f"{name}: {problem}" for name, written in records.items() for record in written for problem in problems(record)]
    assert not found, "the JSON records and m2po_oracle/records disagree:\n" + "\n".join(sorted(set(found)))


def test_every_record_a_run_writes_loads_as_its_typed_record(records):
    for name, written in records.items():
        for record in written:
            assert isinstance(load(record), RECORDS[name].type)


def test_the_published_schemas_are_the_declarations():
    for name in RECORDS:
        assert json.loads((PUBLISHED / f"{name}.schema.json").read_text()) == json_schema(name), (
            f"regenerate: python docs/gen_reference.py ({name})"
        )
    assert capture.SCHEMA == recorder.SCHEMA == typing.get_args(capture.SchemaId)[0]


def test_an_undeclared_key_a_wrong_type_and_a_missing_key_fail(tmp_path, monkeypatch, records):
    from m2po_oracle.compare.report import CompareReport

    to_json = CompareReport.to_json
    monkeypatch.setattr(CompareReport, "to_json", lambda self: {**to_json(self), "typed_by_hand": 1})
    status, report = _compare(tmp_path, "planted", "--impl", "core", "--examples", "2", "--in-process", "--skip-validation")
    assert status == EXIT_EQUIVALENT
    assert problems(_strict(report)) == ["(root): Additional properties are not allowed ('typed_by_hand' was unexpected)"]

    record = json.loads(json.dumps(records["compare"][0]))
    record["checks"][0]["status"] = "passed"
    del record["environment"]["torch"]
    record["coverage"]["families"]["new_family"] = 2  # a map's keys are data: any key is declared
    assert problems(record) == [
        "checks.0.status: 'passed' is not one of ['fail', 'not run', 'pass']",
        "environment: 'torch' is a required property",
    ]
    with pytest.raises(ValueError, match=r"m2po-oracle/compare/1: .*status"):
        load(record)
    with pytest.raises(ValueError, match="no record of this toolkit"):
        load({"schema": "m2po-oracle/compare/0"})


def drawn(kind: Any) -> st.SearchStrategy[Any]:
    """Any value of a record's declared type, every list and map at most two long (the records
    nest deeply: Hypothesis' own ``from_type`` draws trees too large to shrink)."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind is UnsetType:
        return st.just(UNSET)
    if origin is typing.Annotated:
        return drawn(args[0])
    if origin is typing.Literal:
        return st.sampled_from(args)
    if origin in (typing.Union, types.UnionType):
        return st.one_of([drawn(a) for a in args])
    if origin is tuple:
        return st.lists(drawn(args[0]), max_size=2).map(tuple)
    if origin is dict:
        return st.dictionaries(st.text(max_size=6), drawn(args[1]), max_size=2)
    if dataclasses.is_dataclass(kind):
        hints = typing.get_type_hints(kind, include_extras=True)
        return st.builds(kind, **{f.name: drawn(hints[f.name]) for f in dataclasses.fields(kind)})
    simple = {
        str: st.text(max_size=12),
        int: st.integers(-(2**53), 2**53),
        float: st.floats(allow_nan=False, allow_infinity=False),
        bool: st.booleans(),
        type(None): st.none(),
    }
    return simple[kind]


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(drawn(CompareRecord))
def test_the_console_and_the_page_render_any_compare_record_the_schema_allows(record):
    data = to_builtins(record)
    assert problems(data) == []
    print_report(Console(file=io.StringIO(), width=120), data, data["implementation"])
    assert "<html" in render_html(data)


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(drawn(AuditRecord))
def test_the_audit_page_renders_any_audit_record_the_schema_allows(record):
    data = to_builtins(record)
    assert problems(data) == []
    assert "<html" in render_audit_html(data)
