"""What a newcomer meets first: a port of the wrong signature, a file name mistyped, a
compiled port, a traceback of their own code, and nothing left behind in their folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from m2po_oracle.adapters import adapt, closest_adapters, contract_misfit
from m2po_oracle.call.isolation import compiled
from m2po_oracle.cli.main import EXIT_DIVERGENT, EXIT_UNUSABLE, main
from m2po_oracle.errors import UsageError


def verl_style(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None):
    raise AssertionError("a port refused at load is never called")


def contract_style(logp, behavior_logp, advantages, mask, *, tau):
    return {"loss": logp.sum(), "keep": mask}


def test_a_port_of_another_signature_is_refused_at_load_with_the_adapter_to_try(capsys):
    assert contract_misfit(contract_style) is None
    assert "tau" in (contract_misfit(verl_style) or "")
    assert [kind for kind, _ in closest_adapters(verl_style)] == ["policy_loss"]
    with pytest.raises(UsageError, match=r"cannot take the contract's call .* try --adapter policy_loss"):
        adapt(verl_style, None)
    # From the command line: exit 2 before any battery runs, one line, no traceback.
    assert main(["compare", "--impl", f"{__file__}:verl_style", "--examples", "5"]) == EXIT_UNUSABLE
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: impl: verl_style(old_log_prob, log_prob") and "try --adapter policy_loss" in err
    assert "Traceback" not in err and len(err.splitlines()) == 1


def test_a_signature_no_adapter_fits_points_at_the_adapters_list():
    def odd(a, b):
        return None

    with pytest.raises(UsageError, match="m2po-oracle adapters lists the other calling conventions"):
        adapt(odd, None)


def test_a_port_that_raises_shows_its_own_frames_only(tmp_path, capsys):
    port = tmp_path / "raising_port.py"
    port.write_text(
        textwrap.dedent(
            """
            def helper(x):
                raise RuntimeError("inside the port")

            def m2po(logp, behavior_logp, advantages, mask, *, tau):
                return helper(logp)
            """
        )
    )
    report = tmp_path / "r.json"
    main(["compare", "--impl", f"{port}:m2po", "--examples", "3", "--no-shrink", "--json", str(report)])
    (cx,) = json.loads(report.read_text())["counterexamples"]
    text = "\n".join(cx["mismatches"][0]["details"]) or cx["mismatches"][0]["summary"]
    assert "raising_port.py" in text and "inside the port" in text
    assert "m2po_oracle" not in text, f"the toolkit's own frame in the port's traceback:\n{text}"


@pytest.mark.parametrize("where", ["source", "batch"])
def test_a_missing_file_says_so(where, capsys):
    argv = ["replay", "nosuch.json", "--impl", "core"] if where == "source" else ["replay", "--impl", "core", "--batch", "nosuch.json"]
    assert main(argv) == EXIT_UNUSABLE
    err = capsys.readouterr().err
    assert "nosuch.json: no such file" in err and "Expecting value" not in err


def test_compare_leaves_nothing_in_the_working_folder(tmp_path):
    environment = {k: v for k, v in os.environ.items() if k != "HYPOTHESIS_STORAGE_DIRECTORY"}
    done = subprocess.run(
        [sys.executable, "-m", "m2po_oracle", "compare", "--impl", "control:strict_stop", "--examples", "30"],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == EXIT_DIVERGENT, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "compare wrote into the folder it ran from"


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's compiler imports its deprecated jit helpers
def test_a_compiled_port_is_recognised_and_told_how_to_run_eagerly(monkeypatch):
    torch = pytest.importorskip("torch")
    compiled_port = torch.compile(contract_style)
    assert compiled(compiled_port) and not compiled(contract_style)
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    assert not compiled(compiled_port), "under TORCHDYNAMO_DISABLE=1 it runs eagerly"


def test_the_folders_the_tutorial_writes_are_ignored():
    ignored = (Path(__file__).parents[2] / ".gitignore").read_text().splitlines()
    assert ".m2po-examples/" in ignored and ".hypothesis/" in ignored
