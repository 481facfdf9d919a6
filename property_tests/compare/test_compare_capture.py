"""``compare --capture DIR``: the trainer and the distributed world record every step they run
through ``m2po_oracle.capture.recorder.Recorder``, for an offline ``m2po-oracle audit DIR``."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest
import torch

from m2po_oracle.call.runner import CaptureUse, RunOptions
from m2po_oracle.capture import load_capture
from m2po_oracle.cli.config import parse_section
from m2po_oracle.cli.launch import open_runner
from m2po_oracle.cli.main import EXIT_UNUSABLE, main
from m2po_oracle.errors import UsageError

#: A step of two prompts (a fresh worker and a stale one) in three micro-batches, one empty.
SPLIT_CASE = {
    "seed": 3,
    "prompts": 2,
    "group_size": 3,
    "prompt_len": 2,
    "max_new_tokens": 5,
    "lags": (0, 2),
    "staleness_lr": 0.02,
    "tau": 0.04,
    "split": (3, 0, 3),
}


def _on_valid(record, name):
    """``record[name]`` in float64 with invalid tokens zeroed (the rollout's padding is NaN)."""
    return torch.where(record["mask"], record[name].double(), 0.0)


def _same(record, a, b) -> bool:
    return torch.equal(_on_valid(record, a), _on_valid(record, b))


# --- the trainer ---------------------------------------------------------------------------------


def test_a_trainer_compare_captures_one_step_per_battery_call_replays_included(tmp_path, monkeypatch, capsys):
    from m2po_oracle.trainer.runner import TrainerRunner

    calls = []
    run_battery = TrainerRunner.run_battery
    monkeypatch.setattr(TrainerRunner, "run_battery", lambda self, case: calls.append(case) or run_battery(self, case))
    directory, report = tmp_path / "capture", tmp_path / "report.json"
    # A control caught on every step: the counterexample is replayed after exploration, one more step.
    main(
        [
            "compare",
            "--impl",
            "trainer:embedding_gradient_dropped",
            "--examples",
            "2",
            "--no-shrink",
            "--capture",
            str(directory),
            "--json",
            str(report),
        ]
    )
    assert len(calls) > 2, "the counterexample's replay did not run"
    capture = load_capture(directory)
    assert capture.world_size == 1 and capture.topology == "dp=1,cp=1,tp=1"
    assert capture.steps() == list(range(len(calls))), "the validation probes or the one-micro-batch rerun were recorded"
    for step, case in enumerate(calls):
        micro_batches = sorted(k[2] for k in capture if k[1] == step)
        assert micro_batches == list(range(len(case.split))), (step, case.split)
        assert capture.parameter_gradients(step)[0], f"step {step}: no parameter gradients noted"
    for (_, step, micro_batch), record in capture.records():
        assert {"selection_logp", "rollout_logp", "grad"} <= set(record), (step, micro_batch, sorted(record))
        assert record["logp"].shape == record["grad"].shape == record["rollout_logp"].shape
    assert json.loads(report.read_text())["capture"] == {"directory": str(directory), "steps": len(calls)}
    assert f"capture: {directory} ({len(calls)} steps): m2po-oracle audit {directory}" in capsys.readouterr().out


def _captured_step(tmp_path, control_name: str | None, **case_fields):
    """One step of ``SPLIT_CASE`` through the built-in trainer (with a control), recorded."""
    from m2po_oracle.capture.recorder import Recorder
    from m2po_oracle.trainer.cases import TrainerCase
    from m2po_oracle.trainer.controls import CONTROLS_BY_NAME
    from m2po_oracle.trainer.run import run_case

    directory = tmp_path / (control_name or "trainer")
    recorder = Recorder(directory, rank=0, world_size=1, topology="dp=1,cp=1,tp=1")
    step = run_case(
        TrainerCase(**{**SPLIT_CASE, **case_fields}),
        control=CONTROLS_BY_NAME[control_name] if control_name else None,
        recorder=recorder,
        step_index=0,
    )
    capture = load_capture(directory)
    return step, {key[2]: record for key, record in capture.records()}, capture.parameter_gradients(0)[0]


def test_the_correct_trainers_capture_is_what_its_step_record_says(tmp_path):
    step, records, parameters = _captured_step(tmp_path, None)
    assert sorted(records) == [0, 1, 2] and records[1]["logp"].shape == (0, 5), "the empty micro-batch is recorded, empty"
    rows = np.cumsum([0, *SPLIT_CASE["split"]])
    for i, record in records.items():
        r = slice(rows[i], rows[i + 1])
        assert torch.equal(record["logp"], step.record.logp[r]) and torch.equal(record["grad"], step.record.token_grad[r])
        assert torch.equal(record["keep"], step.record.keep[r]) and torch.equal(record["mask"], step.record.valid[r])
        assert _same(record, "rollout_logp", "behavior_logp") and _same(record, "selection_logp", "logp")
        assert record["metrics"]["valid_count"] == int(step.record.valid.sum()), "each micro-batch logs the optimizer batch's N"
    assert sum(record["loss"] for record in records.values()) == pytest.approx(step.record.loss, rel=1e-12)
    assert all(entry["norm"] not in (None, 0.0) for entry in parameters.values())


def test_a_capture_shows_the_behaviour_log_probs_are_not_the_samplers(tmp_path):
    _, records, _ = _captured_step(tmp_path, "current_policy_as_behavior")
    assert not _same(records[0], "rollout_logp", "behavior_logp") and not _same(records[2], "rollout_logp", "behavior_logp")


def test_a_capture_shows_the_mask_prepass_and_the_loss_pass_differ_under_dropout(tmp_path):
    _, records, _ = _captured_step(tmp_path, "dropout_left_on")
    assert not _same(records[0], "selection_logp", "logp") and not _same(records[2], "selection_logp", "logp")


def test_a_capture_shows_the_policy_moved_between_micro_batches(tmp_path):
    _, records, _ = _captured_step(tmp_path, "optimizer_step_per_micro_batch")
    assert _same(records[0], "selection_logp", "logp"), "before any optimizer step the prepass and the loss pass agree"
    assert not _same(records[2], "selection_logp", "logp"), "after a per-micro-batch step they must not"


def test_a_capture_shows_a_parameter_without_gradient(tmp_path):
    _, _, parameters = _captured_step(tmp_path, "embedding_gradient_dropped")
    assert [name for name, entry in parameters.items() if entry["norm"] == 0.0] == ["model.embed_tokens.weight"]


def test_without_recorded_sampler_log_probs_the_capture_recomputes_them_or_omits_them(tmp_path):
    from m2po_oracle.capture.recorder import Recorder
    from m2po_oracle.trainer.cases import TrainerCase
    from m2po_oracle.trainer.grpo import (
        GRPOTrainer,
        TrainerConfig,
        TrainerFaults,
        behaviour_logp_of,
    )
    from m2po_oracle.trainer.run import setup_case

    versions, samplers, rollout = setup_case(TrainerCase(**SPLIT_CASE), record_logp=False)
    recomputing = GRPOTrainer(versions[-1], TrainerConfig(behavior_logp_source="trainer"), behaviour=samplers)
    # The current policy as behaviour needs no sampler: nothing knows the sampler's log-probs.
    not_knowing = GRPOTrainer(versions[-1], TrainerConfig(), faults=TrainerFaults(current_policy_as_behavior=True))
    for name, trainer in (("recomputed", recomputing), ("unknown", not_knowing)):
        trainer.step(rollout, (3, 3), recorder=Recorder(tmp_path / name, rank=0, world_size=1, topology="dp=1"), step_index=0)
    (_, recomputed), *_ = load_capture(tmp_path / "recomputed").records()
    assert torch.equal(recomputed["rollout_logp"], behaviour_logp_of(samplers, rollout)[:3])
    (_, unknown), *_ = load_capture(tmp_path / "unknown").records()
    assert "rollout_logp" not in unknown and "selection_logp" in unknown


def test_a_recorded_step_needs_its_step_number(tmp_path):
    from m2po_oracle.capture.recorder import Recorder
    from m2po_oracle.trainer.cases import TrainerCase
    from m2po_oracle.trainer.grpo import GRPOTrainer, TrainerConfig
    from m2po_oracle.trainer.run import setup_case

    versions, _, rollout = setup_case(TrainerCase(**SPLIT_CASE))
    with pytest.raises(ValueError, match="step_index: a recorded step needs its optimizer step number"):
        GRPOTrainer(versions[-1], TrainerConfig()).step(rollout, recorder=Recorder(tmp_path, rank=0, world_size=1, topology="dp=1"))


def test_a_failing_capture_stops_the_run_instead_of_failing_the_trainer(tmp_path, monkeypatch, capsys):
    from m2po_oracle.capture.recorder import Recorder

    def full_disk(self, **record):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Recorder, "record", full_disk)
    assert main(["compare", "--impl", "trainer", "--examples", "2", "--capture", str(tmp_path / "c")]) == EXIT_UNUSABLE
    error = capsys.readouterr().err
    assert "capture: recording step 0, micro-batch 0" in error and "No space left on device" in error


# --- refusals --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, values, reason",
    [
        ("core", {}, "a single-process run has no training step to capture"),
        ("core", {"in_process": True}, "a single-process run has no training step to capture"),
        ("trainer:m2po_oracle.trainer.grpo:GRPOTrainer", {}, "a custom trainer records through m2po_oracle.capture itself"),
    ],
)
def test_capture_is_refused_where_there_is_no_step_of_ours_to_record(tmp_path, spec, values, reason):
    directory = tmp_path / "capture"
    with pytest.raises(UsageError) as refused:
        open_runner(spec, RunOptions.from_values({**values, "capture": str(directory)}))
    assert "cannot honour --capture" in str(refused.value) and reason in str(refused.value)
    assert not directory.exists(), "a refused run must leave no directory behind"


def test_a_directory_that_already_holds_a_capture_is_refused_and_a_new_one_is_created(tmp_path, capsys):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "manifest.rank-000.json").write_text("{}")
    with pytest.raises(UsageError, match="capture: .*old already holds a capture; choose an empty directory"):
        open_runner("trainer", RunOptions.from_values({"capture": str(tmp_path / "old")}))
    assert main(["compare", "--impl", "trainer", "--capture", str(tmp_path / "old")]) == EXIT_UNUSABLE
    assert f"capture: {tmp_path / 'old'} already holds a capture; choose an empty directory" in capsys.readouterr().err
    runner = open_runner("trainer", RunOptions.from_values({"capture": str(tmp_path / "new" / "capture")}))
    assert (tmp_path / "new" / "capture").is_dir() and not list((tmp_path / "new" / "capture").iterdir()), (
        "opening a runner records nothing"
    )
    assert runner.describe().capture == CaptureUse(str(tmp_path / "new" / "capture"), 0)


def test_capture_is_read_from_the_project_configuration(tmp_path, monkeypatch, capsys):
    assert parse_section({"capture": "runs/capture"}).values["capture"] == "runs/capture"
    (tmp_path / "pyproject.toml").write_text(
        textwrap.dedent("""\
        [tool.m2po-oracle]
        impl = "core"
        capture = "runs/capture"
        """)
    )
    monkeypatch.chdir(tmp_path)
    assert main(["compare", "--examples", "2"]) == EXIT_UNUSABLE
    assert "cannot honour --capture" in capsys.readouterr().err


# --- the distributed world -------------------------------------------------------------------------


@pytest.mark.xdist_group("distributed")
def test_a_distributed_compare_captures_every_ranks_cp_shard(tmp_path):
    from m2po_oracle.compare.search import run_compare
    from m2po_oracle.distributed.topology import Topology, cp_reconstruct, dp_row_slices

    topology = Topology(2, 2, 1)
    directory = tmp_path / "capture"
    outcomes = []
    with open_runner("core", RunOptions.from_values({"topology": topology, "capture": str(directory)})) as runner:
        runner.start()
        report = run_compare(runner, examples=4, seed=0, shrink=False, on_example=outcomes.append)
    assert report.verdict == "equivalent" and report.capture == CaptureUse(str(directory), len(outcomes))
    capture = load_capture(directory)
    assert sorted(capture.manifests) == [0, 1, 2, 3] and capture.topology == "dp=2,cp=2,tp=1"
    assert capture.steps() == list(range(len(outcomes))), "the collective probes or rank 0's one-rank rerun were recorded"
    for step, outcome in enumerate(outcomes):
        batch = outcome.batch  # as the ranks were fed it: rounded and padded to a multiple of 2 * cp
        records = {topology.coords(rank): capture.load(rank, step, 0) for rank in range(topology.world_size)}
        assert {key[2] for key in capture if key[1] == step} == {0}
        for dp_rank, rows in enumerate(dp_row_slices(batch.shape[0], topology.dp)):
            shards = [records[c] for c in sorted(records, key=lambda c: c.cp) if c.dp == dp_rank]
            assert all(s["logp"].shape == (rows.stop - rows.start, batch.shape[1] // 2) for s in shards)
            whole = {
                name: cp_reconstruct([s[name].numpy() for s in shards], topology.cp)
                for name in ("logp", "behavior_logp", "advantages", "mask", "keep")
            }
            np.testing.assert_array_equal(whole["logp"], batch.logp[rows])  # NaN padding compares equal
            np.testing.assert_array_equal(whole["behavior_logp"], batch.behavior_logp[rows])
            np.testing.assert_array_equal(whole["advantages"], batch.advantages[rows])
            np.testing.assert_array_equal(whole["mask"], batch.valid[rows])
            np.testing.assert_array_equal(whole["keep"], outcome.measurement.result.keep[rows])
        assert sum(r["loss"] for r in records.values()) == pytest.approx(outcome.measurement.result.loss, rel=1e-9, abs=1e-12)
        assert all("grad" in r and r["metrics"]["valid_count"] == int(batch.valid.sum()) for r in records.values())


def test_the_html_report_names_the_capture_and_the_command_that_audits_it():
    from m2po_oracle.report.html import render_html

    html = render_html({"schema": "m2po-oracle/compare/1", "verdict": "equivalent", "capture": {"directory": "runs/<cap>", "steps": 7}})
    assert "runs/&lt;cap&gt; (7 steps): m2po-oracle audit runs/&lt;cap&gt;" in html
    assert "m2po-oracle audit" not in render_html({"schema": "m2po-oracle/compare/1", "verdict": "equivalent"})
