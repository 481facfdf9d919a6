"""The command line: exit statuses, the JSON report, and replaying a counterexample."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest

from m2po_oracle.cli.main import EXIT_DIVERGENT, EXIT_EQUIVALENT, EXIT_UNUSABLE, main


def test_compare_core_is_equivalent_and_writes_json(tmp_path, capsys):
    report = tmp_path / "core.json"
    assert main(["compare", "--impl", "core", "--examples", "40", "--json", str(report)]) == EXIT_EQUIVALENT
    data = json.loads(report.read_text())
    assert data["schema"] == "m2po-oracle/compare/1" and data["verdict"] == "equivalent" and data["examples"] == 40
    assert {c["status"] for c in data["checks"]} == {"pass"} and data["counterexamples"] == []
    assert data["environment"]["torch"].startswith("2.")
    assert "verdict: equivalent" in capsys.readouterr().out


def test_compare_a_control_is_divergent_with_a_replayable_minimal_counterexample(tmp_path, capsys):
    report = tmp_path / "strict.json"
    assert main(["compare", "--impl", "control:strict_stop", "--examples", "60", "--json", str(report)]) == EXIT_DIVERGENT
    data = json.loads(report.read_text())
    (counterexample,) = data["counterexamples"]
    assert counterexample["check"] == "selection.minimal"
    assert len(counterexample["batch"]["logp"]) == 1 and len(counterexample["batch"]["logp"][0]) == 1, "not shrunk to one token"
    replay = shlex.split(counterexample["replay"])
    assert replay[:2] == ["m2po-oracle", "replay"]
    assert main(replay[1:]) == EXIT_DIVERGENT
    assert main(["replay", str(report), "--impl", "core"]) == EXIT_EQUIVALENT
    assert main(["replay", str(report), "--impl", "control:strict_stop", "--in-process"]) == EXIT_DIVERGENT
    assert main(["replay", "--impl", "core"]) == EXIT_UNUSABLE
    assert "[selection.minimal]" in capsys.readouterr().out


def test_an_implementation_that_always_raises_is_unusable(tmp_path):
    source = tmp_path / "broken.py"
    source.write_text("def port(*args, **kwargs):\n    raise RuntimeError('not implemented')\n")
    assert main(["compare", "--impl", f"{source}:port", "--examples", "5"]) == EXIT_UNUSABLE


@pytest.mark.parametrize("argv", [["compare", "--impl", "cor"], ["replay", "--impl", "core", "--batch", "{not json"]])
def test_bad_input_exits_2_with_a_clear_error(argv, capsys):
    assert main(argv) == EXIT_UNUSABLE
    err = capsys.readouterr().err
    assert "closest matches: core" in err or "batch: expected JSON" in err


@pytest.mark.parametrize("argv", [["compare", "--impl", "core", "--examples", "0"], ["compare", "--impl", "core", "--tau", "nan"]])
def test_usage_errors_exit_2(argv):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == EXIT_UNUSABLE


def test_compare_without_an_impl_anywhere_names_both_places(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no pyproject.toml above a fresh temporary folder
    assert main(["compare"]) == EXIT_UNUSABLE
    assert "--impl: required (or impl = " in capsys.readouterr().err


def test_console_script_is_installed():
    done = subprocess.run([sys.executable, "-m", "m2po_oracle", "checks"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "selection.minimal" in done.stdout
