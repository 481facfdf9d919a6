"""M2PO in TRL's real GRPOTrainer: one selection per optimizer batch under gradient
accumulation with stale rollouts, fail-closed options, and planted bugs the audit catches.

Every training here is a real ``trainer.train()`` of TRL 1.16 (HF generation, buffering,
splitting, ``old_per_token_logps``, the HF Trainer's accumulation and optimizer step) on a
random-weight Llama; the runs share one xdist worker (TRL's import costs about 7 s).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import replace

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("trl")

from window_checks import assert_one_selection_per_window, window_batch

from m2po_oracle import oracle
from m2po_oracle.audit import audit_capture
from m2po_oracle.capture import load_capture
from m2po_oracle.integrations.trl import TRLFaults
from m2po_oracle.integrations.trl_demo import DemoSetup, build_trainer, tiny_llama, train
from m2po_oracle.integrations.trl_step import TRL_CONTROLS
from m2po_oracle.judge.equivalence import same_up_to_ties, valid_m2
from m2po_oracle.trainer.grpo import M2POKLWarning

pytestmark = pytest.mark.xdist_group("trl")

#: Stale rollouts under accumulation: each generation batch serves two optimizer batches
#: of two micro-batches, each iterated twice (steps_per_generation 4, GA 2, num_iterations 2).
SETUP = DemoSetup()


def _run(tmp_path_factory: pytest.TempPathFactory, name: str, faults: TRLFaults | None = None):
    directory = tmp_path_factory.mktemp(name) / "capture"
    trainer = train(SETUP, capture=str(directory), faults=faults)
    return trainer, directory, audit_capture(directory)


@pytest.fixture(scope="module")
def correct_run(tmp_path_factory):
    return _run(tmp_path_factory, "correct")


def _windows(directory):
    """Per recorded optimizer step: the micro-batches' captured records, in order."""
    capture = load_capture(directory)
    return {step: [record for _, record in capture.records(step=step)] for step in capture.steps()}


def test_the_correct_run_selects_once_per_optimizer_batch_on_stale_rollouts(correct_run):
    trainer, directory, report = correct_run
    windows = _windows(directory)
    assert sorted(windows) == list(range(SETUP.steps)) and all(len(w) == SETUP.gradient_accumulation_steps for w in windows.values())
    assert_one_selection_per_window(windows, SETUP.steps)
    assert report.verdict == "equivalent", [
        (s.step, s.verdict, [(c.name, c.summary) for c in s.checks if c.status == "fail"]) for s in report.steps
    ]
    logged = [entry for entry in trainer.state.log_history if "m2po/masked_fraction" in entry]
    assert len(logged) == SETUP.steps and all(
        f"m2po/{m}" in logged[0] for m in ("m2_before", "m2_after", "masked_fraction", "trust_region_fraction")
    )


def test_the_capture_holds_the_samplers_prepass_and_gradient_of_every_micro_batch(correct_run):
    _, directory, report = correct_run
    for records in _windows(directory).values():
        for r in records:
            assert {"selection_logp", "rollout_logp", "grad", "logp", "behavior_logp"} <= set(r)
    checks = {c.name: c.status for s in report.steps for c in s.checks}
    for name in (
        "audit.selection",
        "audit.policy_logp",
        "audit.behavior_logp",
        "audit.loss_sum",
        "audit.gradient",
        "audit.metrics",
        "audit.parameter_gradient",
    ):
        assert checks[name] == "pass", (name, checks[name])


#: Each planted bug of the integration: the audit check that must fail and the diagnosis that must name it.
CONTROLS = {
    "per_micro_batch_mask": ("audit.selection", "per_micro_batch_mask"),
    "per_micro_batch_denominator": ("audit.gradient", "per_micro_batch_denominator"),
    "current_policy_as_behavior": ("audit.behavior_logp", "current_policy_as_behavior"),
    "optimizer_step_per_micro_batch": ("audit.policy_logp", "optimizer_step_per_micro_batch"),
}


@pytest.mark.parametrize("fault", sorted(CONTROLS))
def test_each_planted_bug_in_the_integration_is_caught_and_named_by_the_audit(fault, tmp_path_factory):
    _, _, report = _run(tmp_path_factory, fault, TRLFaults(**{fault: True}))
    check, diagnosis = CONTROLS[fault]
    assert report.verdict == "divergent"
    caught = [s for s in report.steps if any(c.name == check and c.status == "fail" for c in s.checks)]
    assert caught, f"{fault}: no step fails {check}: {[(s.step, s.verdict) for s in report.steps]}"
    assert all(diagnosis in s.diagnosis for s in caught), [(s.step, s.diagnosis) for s in caught]


# --- fail closed --------------------------------------------------------------------------------

REFUSED = [
    ({"loss_type": "grpo"}, "loss_type"),
    ({"importance_sampling_level": "sequence"}, "importance_sampling_level"),
    ({"steps_per_generation": 3}, "steps_per_generation"),
    ({"top_entropy_quantile": 0.5}, "top_entropy_quantile"),
    ({"off_policy_mask_threshold": 0.5}, "off_policy_mask_threshold"),
    ({"entropy_coef": 0.01}, "entropy_coef"),
    ({"use_liger_kernel": True}, "use_liger_kernel"),
    ({"use_vllm": True, "vllm_mode": "server"}, "vllm_importance_sampling_correction"),
    ({"use_transformers_continuous_batching": True}, "use_transformers_continuous_batching"),
    ({"top_p": 0.9}, "top_p"),
    ({"top_k": 5}, "top_k"),
    ({"min_p": 0.1}, "min_p"),
]


@pytest.mark.parametrize(("options", "named"), REFUSED, ids=[n for _, n in REFUSED])
def test_each_option_that_changes_the_objective_is_refused_naming_it(options, named, tmp_path):
    with pytest.raises(ValueError, match=rf"^{named}:"):
        build_trainer(SETUP, str(tmp_path), **options)


def test_stochastic_layers_in_the_prepass_are_refused_naming_the_option(tmp_path):
    model = tiny_llama(0)
    model.config.attention_dropout = 0.1
    trainer = build_trainer(replace(SETUP, steps=1), str(tmp_path), model=model, disable_dropout=False)
    with pytest.raises(ValueError, match=r"^disable_dropout: .*attention_dropout=0.1"):
        trainer.train()


def test_a_kl_coefficient_warns(tmp_path):
    # TRL builds the KL reference from the model's path: a saved copy of the toy model.
    tiny_llama(0).save_pretrained(tmp_path / "model")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_trainer(SETUP, str(tmp_path), model=str(tmp_path / "model"), beta=0.01)
    assert any(issubclass(w.category, M2POKLWarning) and "beta=0.01" in str(w.message) for w in caught)


def test_the_layout_keeps_integrations_on_the_top_floor():
    from property_tests.meta.test_layout import import_graph

    wrong = [
        (m, t)
        for m, targets in import_graph().items()
        for t in targets
        if t.startswith("m2po_oracle.integrations") and not m.startswith("m2po_oracle.integrations")
    ]
    assert not wrong, f"modules below import the integrations: {wrong}"


# --- compare --impl trainer:trl: the trainer battery on TRL's real step -------------------------

#: A scoped step (one micro-batch per prompt, workers 1 and 3 steps behind, tau cutting three
#: trust-region tokens, uneven lengths) on which every TRL control differs from Algorithm 1.
SCOPED_CASE = dict(
    kind="trainer_case",
    seed=5,
    prompts=2,
    group_size=2,
    prompt_len=2,
    max_new_tokens=6,
    lags=[1, 3],
    staleness_lr=0.02,
    tau=0.04,
    split=[2, 2],
    cut=3,
)


def test_compare_trainer_trl_is_equivalent_and_every_fail_closed_probe_is_refused_by_the_integration(tmp_path, capsys):
    from m2po_oracle.cli.main import main
    from m2po_oracle.trainer.probes import TRAINER_PROBES

    path = tmp_path / "trl.json"
    # Without --dtype the run takes the one dtype TRL's step computes in, and says so.
    assert main(["compare", "--impl", "trainer:trl", "--examples", "2", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["verdict"] == "equivalent" and data["examples"] == 2
    assert data["options"]["dtype"] == "float32" and data["options"]["dtype_why"] == "the dtype trainer:trl computes in; --dtype not given"
    ran = {c["name"]: c["status"] for c in data["checks"]}
    assert all(
        ran[name] == "pass"
        for name in (
            "trainer.behavior_logp",
            "trainer.policy_logp",
            "trainer.parameter_gradient",
            "trainer.optimizer_step",
            "selection.minimal",
            "loss",
            "gradient",
            "metrics.m2_before",
        )
    ), ran
    probes = {p["probe"]: p for p in data["validation"]["probes"]}
    assert [probes[p.name]["status"] for p in TRAINER_PROBES] == [p.expected for p in TRAINER_PROBES]
    # The refusals are the integration's, in TRL's option names (the adapter refuses only the one setting TRL lacks).
    assert probes["sequence_level_is"]["message"].startswith("ValueError: importance_sampling_level:")
    assert probes["rollout_is_correction"]["message"].startswith("ValueError: vllm_importance_sampling_correction:")
    assert probes["stochastic_mask_prepass"]["message"].startswith("ValueError: disable_dropout:")
    assert probes["deployment_behavior_logp_missing"]["message"].startswith(
        "ValueError: behavior_logp: the rollout_func returned no log-probs"
    )
    out = capsys.readouterr().out
    assert "dtype: float32 (the dtype trainer:trl computes in; --dtype not given)" in out and "verdict: equivalent" in out


@pytest.mark.parametrize("control", ["", *sorted(TRL_CONTROLS)])
def test_each_trl_control_is_caught_by_its_check_and_named_by_the_diagnosis(control):
    from m2po_oracle.call.runner import RunOptions
    from m2po_oracle.cli.launch import open_runner
    from m2po_oracle.trainer.cases import TrainerCase

    runner = open_runner("trainer:trl" + (f":{control}" if control else ""), RunOptions(dtype="float32"))
    outcome = runner.run_battery(TrainerCase.from_dict(SCOPED_CASE))
    failed = {m.check for m in outcome.mismatches}
    if not control:
        assert not failed, [m.summary for m in outcome.mismatches]
        return
    expected = TRL_CONTROLS[control]
    assert set(expected.caught_by) <= failed, (control, failed)
    assert outcome.evidenced == (expected.variant,), (control, outcome.explained_by, outcome.evidenced)


def test_trl_with_a_kl_term_passes_the_kl_check_that_its_k1_control_fails():
    from m2po_oracle.integrations.trl_step import trl_trainer
    from m2po_oracle.trainer.cases import TrainerCase
    from m2po_oracle.trainer.runner import TrainerRunner

    # The control's own run (k1, caught and named) is test_each_trl_control_is_caught_...[kl_k1_estimator].
    assert TRL_CONTROLS["kl_k1_estimator"].beta == 0.1 and "trainer.kl_term" in TRL_CONTROLS["kl_k1_estimator"].caught_by
    runner = TrainerRunner(trainer=trl_trainer(), spec="trainer:trl", beta=0.1)
    outcome = runner.run_battery(TrainerCase.from_dict(SCOPED_CASE))
    assert runner.options.dtype == "float32" and "trainer.kl_term" in outcome.checked
    assert not outcome.mismatches, [m.summary for m in outcome.mismatches]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["compare", "--impl", "trainer:trl", "--dtype", "float64", "--examples", "1"],
            "dtype: trainer:trl computes in float32: its log-probs come from a chunked LM-head kernel that accumulates in float32 whatever the "
            "model's dtype; --dtype float64 would judge float32 values at float64 tolerance. Leave --dtype out (the run takes float32) or give "
            "--dtype float32",
        ),
        (["compare", "--impl", "trainer:trl:no_such_control", "--dtype", "float32"], "unknown TRL control 'no_such_control'"),
    ],
)
def test_trainer_trl_usage_errors_name_the_problem(argv, message, capsys):
    from m2po_oracle.cli.main import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err


# --- data parallel: two processes on gloo, accelerate's MULTI_CPU world under torchrun ------------


def _torchrun_demo(directory, *extra):
    import subprocess
    import sys

    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "m2po_oracle.integrations.trl_demo",
        "--steps",
        "3",
        "--capture",
        str(directory),
        *extra,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=400, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _pulled_back_norms(capture, inputs, step=0):
    """Each parameter's gradient norm recomputed from the capture: every rank's and micro-batch's
    captured d loss / d logp pulled back through the demo's initial model (step 0)."""
    import torch
    from safetensors.torch import load_file

    model = tiny_llama(SETUP.seed)
    total = 0
    for (rank, _, micro), record in capture.records(step=step):
        x = load_file(str(inputs / f"rank{rank}-step{step}-mb{micro}.safetensors"))
        ids = torch.cat([x["prompt_ids"], x["completion_ids"]], 1)
        width = x["completion_ids"].shape[1]
        logits = model(input_ids=ids, attention_mask=torch.cat([x["prompt_mask"], x["completion_mask"]], 1)).logits[:, -width - 1 : -1]
        logp = torch.log_softmax(logits, -1).gather(-1, x["completion_ids"][..., None])[..., 0]
        valid = record["mask"]
        assert float((torch.where(valid, logp.detach(), 0) - torch.where(valid, record["logp"], 0)).abs().max()) < 1e-5
        total = total + (torch.where(valid, record["grad"], 0) * torch.where(valid, logp, 0)).sum()
    total.backward()
    return {name: float(p.grad.double().norm()) for name, p in model.named_parameters()}


def test_two_gloo_ranks_select_once_over_the_dp_group_and_the_audit_reassembles_both(tmp_path):
    out = _torchrun_demo(tmp_path / "dp2", "--max-grad-norm", "0", "--save-inputs", str(tmp_path / "inputs"))
    assert out.count("of 2 process(es), DistributedType.MULTI_CPU on gloo, model wrapped as DistributedDataParallel") == 2, out
    report = audit_capture(tmp_path / "dp2")
    assert report.verdict == "equivalent", [(s.step, [(c.name, c.summary) for c in s.checks if c.status == "fail"]) for s in report.steps]
    capture = load_capture(tmp_path / "dp2")
    assert capture.world_size == 2 and {rank for rank, _, _ in capture} == {0, 1}
    for step in capture.steps():
        records = [record for _, record in capture.records(step=step)]
        assert len(records) == 4  # two ranks x two micro-batches, one selection over all four
        batch = window_batch(records)
        keep = np.concatenate([r["keep"].numpy() for r in records])
        assert same_up_to_ties(keep, oracle.m2po(batch).keep, valid_m2(batch)), f"step {step}"
    # DDP averages the ranks' gradients; the objective wants their sum. The gradient each rank
    # noted before the first optimizer step (no clipping) is the sum over both ranks' records.
    expected = _pulled_back_norms(capture, tmp_path / "inputs")
    noted = capture.parameter_gradients(0)
    for rank in (0, 1):
        for name, norm in expected.items():
            assert math.isclose(noted[rank][name]["norm"], norm, rel_tol=1e-5), (rank, name, noted[rank][name]["norm"], norm)


def test_a_rank_selecting_alone_is_caught_and_named_by_the_audit(tmp_path):
    _torchrun_demo(tmp_path / "alone", "--fault", "per_rank_selection")
    report = audit_capture(tmp_path / "alone")
    assert report.verdict == "divergent"
    failing = [s for s in report.steps if s.verdict == "divergent"]
    # A scope is named where the mask shows it (audit.selection fails); a step where only the
    # logged metrics differ fails audit.metrics and gets no name; no step gets another name.
    shown = [s for s in failing if any(c.name == "audit.selection" and c.status == "fail" for c in s.checks)]
    assert shown and all("per_rank_selection_global_n" in s.diagnosis for s in shown), [(s.step, s.diagnosis) for s in report.steps]
    assert all(set(s.diagnosis) <= {"per_rank_selection_global_n"} for s in report.steps), [(s.step, s.diagnosis) for s in report.steps]
