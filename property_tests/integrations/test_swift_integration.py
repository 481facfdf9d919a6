"""M2PO in ms-swift 4.6's real GRPO trainer, loaded by ``swift rlhf --external_plugins``: one
selection per optimizer batch under gradient accumulation with stale rollouts, the audit's
verdict on a real run, planted bugs caught and named, fail-closed options; and the trainer
battery on ms-swift's real step (``compare --impl trainer:swift``), each of its controls
caught and named.

ms-swift needs trl<1 and transformers<5.20, so these tests run only in its own environment
(.venv-swift, constraints-swift.txt): ``.ci/run``'s swift stage and ``tox -e swift`` run them.
Elsewhere the module is skipped, saying so; the stage sets ``M2PO_REQUIRE_SWIFT=1``, under which
a missing ms-swift fails the collection instead. Every training is a real ``swift rlhf`` run in this
process (``rlhf_main``) on a random-weight Llama built in code; nothing is downloaded.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

pytestmark = pytest.mark.swift
if os.environ.get("M2PO_REQUIRE_SWIFT"):
    # The swift stage sets this: there a missing ms-swift is an error, never a skip that passes the stage.
    import swift.rlhf_trainers  # noqa: F401
else:
    pytest.importorskip(
        "swift.rlhf_trainers",
        reason="needs ms-swift 4.6 (its own environment, .venv-swift): .ci/run's swift stage and tox -e swift run these tests",
    )
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from window_checks import assert_one_selection_per_window, window_batch  # noqa: E402  (beside this file)

from m2po_oracle import oracle  # noqa: E402
from m2po_oracle.audit import audit_capture  # noqa: E402
from m2po_oracle.capture import load_capture  # noqa: E402
from m2po_oracle.integrations.hf_window import LOGGED_METRICS, METRIC_PREFIX  # noqa: E402
from m2po_oracle.integrations.swift import check_m2po_args  # noqa: E402
from m2po_oracle.integrations.swift_demo import DemoSetup, run  # noqa: E402
from m2po_oracle.integrations.swift_step import SWIFT_CONTROLS  # noqa: E402
from m2po_oracle.judge.equivalence import same_up_to_ties, valid_m2  # noqa: E402
from m2po_oracle.trainer.grpo import M2POKLWarning  # noqa: E402

#: Stale rollouts under accumulation: each generation batch serves two optimizer batches of two
#: micro-batches, each iterated twice (steps_per_generation 4, GA 2, num_iterations 2).
SETUP = DemoSetup()


def _train(tmp_path_factory: pytest.TempPathFactory, name: str, fault: str | None = None, setup: DemoSetup = SETUP):
    root = tmp_path_factory.mktemp(name)
    capture = root / "capture"
    run(setup, str(capture), fault, scratch=str(root))
    logs = [json.loads(line) for path in (root / "output").rglob("logging.jsonl") for line in path.read_text().splitlines()]
    return capture, logs, audit_capture(capture)


@pytest.fixture(scope="module")
def correct_run(tmp_path_factory):
    return _train(tmp_path_factory, "correct")


def test_the_correct_run_selects_once_per_optimizer_batch_on_stale_rollouts(correct_run):
    directory, logs, report = correct_run
    capture = load_capture(directory)
    windows = {step: [record for _, record in capture.records(step=step)] for step in capture.steps()}
    assert sorted(windows) == list(range(SETUP.steps)) and all(len(w) == SETUP.gradient_accumulation_steps for w in windows.values())
    assert_one_selection_per_window(windows, SETUP.steps)
    assert report.verdict == "equivalent", [
        (s.step, s.verdict, [(c.name, c.summary) for c in s.checks if c.status == "fail"]) for s in report.steps
    ]
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
        assert checks.get(name) == "pass", (name, checks.get(name))
    logged = [entry for entry in logs if f"{METRIC_PREFIX}masked_fraction" in entry]
    assert len(logged) == SETUP.steps and all(METRIC_PREFIX + m in logged[0] for m in LOGGED_METRICS), logs[:2]


#: Each planted bug of the integration: the optimizer steps the demo needs before the bug shows
#: (the demo's first window has micro-batches of unequal valid counts, its second a cut that
#: per-micro-batch selection moves, its second and later stale rollouts), the audit check that
#: must fail and the diagnosis that must name it.
CONTROLS = {
    "per_micro_batch_mask": (4, "audit.selection", "per_micro_batch_mask"),
    "per_micro_batch_denominator": (1, "audit.gradient", "per_micro_batch_denominator"),
    "current_policy_as_behavior": (2, "audit.behavior_logp", "current_policy_as_behavior"),
    "optimizer_step_per_micro_batch": (1, "audit.policy_logp", "optimizer_step_per_micro_batch"),
}


@pytest.mark.parametrize("fault", sorted(CONTROLS))
def test_each_planted_bug_in_the_integration_is_caught_and_named_by_the_audit(fault, tmp_path_factory):
    steps, check, diagnosis = CONTROLS[fault]
    _, _, report = _train(tmp_path_factory, fault, fault, replace(SETUP, steps=steps))
    assert report.verdict == "divergent"
    caught = [s for s in report.steps if any(c.name == check and c.status == "fail" for c in s.checks)]
    assert caught, f"{fault}: no step fails {check}: {[(s.step, s.verdict) for s in report.steps]}"
    assert all(diagnosis in s.diagnosis for s in caught), [(s.step, s.diagnosis) for s in caught]


def test_at_another_temperature_the_engines_raw_logit_log_probs_are_not_recorded_as_the_samplers(tmp_path):
    """ms-swift's engine reports log-softmax of the raw logits but samples from logits / T: at
    T 0.9 those numbers differ from the behaviour log-probs (by up to 0.135 on the demo), so
    recording them as the sampler's would make a correct run fail audit.behavior_logp."""
    capture = tmp_path / "capture"
    run(replace(SETUP, steps=2), str(capture), scratch=str(tmp_path), temperature=0.9)
    records = [record for _, record in load_capture(capture).records()]
    assert records and all("rollout_logp" not in r for r in records)
    report = audit_capture(capture)
    assert report.verdict == "equivalent", [(s.step, [(c.name, c.summary) for c in s.checks if c.status == "fail"]) for s in report.steps]


def test_an_option_that_changes_the_objective_stops_the_real_run_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"^loss_type: .*--loss_type dapo"):
        run(SETUP, str(tmp_path / "capture"), scratch=str(tmp_path), loss_type="grpo")
    assert not (tmp_path / "capture").exists(), "a refused run must not record anything"


#: ms-swift's GRPO options that would change Algorithm 1's objective, each refused naming it.
NEUTRAL = dict(
    gradient_accumulation_steps=2,
    steps_per_generation=4,
    loss_type="dapo",
    importance_sampling_level="token",
    rollout_importance_sampling_mode=None,
    top_entropy_quantile=1.0,
    off_policy_sequence_mask_delta=None,
    overlong_filter=False,
    use_liger_kernel=False,
    async_generate=False,
    sdar_loss_coef=0.0,
    top_p=1.0,
    top_k=-1,
    repetition_penalty=1.0,
    beta=0.0,
)
REFUSED = [
    ({"steps_per_generation": 3}, "steps_per_generation"),
    ({"loss_type": "grpo"}, "loss_type"),
    ({"importance_sampling_level": "sequence"}, "importance_sampling_level"),
    ({"rollout_importance_sampling_mode": "token_truncate"}, "rollout_importance_sampling_mode"),
    ({"top_entropy_quantile": 0.5}, "top_entropy_quantile"),
    ({"off_policy_sequence_mask_delta": 0.5}, "off_policy_sequence_mask_delta"),
    ({"overlong_filter": True}, "overlong_filter"),
    ({"use_liger_kernel": True}, "use_liger_kernel"),
    ({"async_generate": True}, "async_generate"),
    ({"sdar_loss_coef": 0.1}, "sdar_loss_coef"),
    ({"top_p": 0.9}, "top_p"),
    ({"top_k": 50}, "top_k"),
    ({"repetition_penalty": 1.1}, "repetition_penalty"),
]


@pytest.mark.parametrize(("options", "named"), REFUSED, ids=[n for _, n in REFUSED])
def test_each_option_that_changes_the_objective_is_refused_naming_it(options, named):
    check_m2po_args(SimpleNamespace(**NEUTRAL))  # the neutral settings pass
    with pytest.raises(ValueError, match=rf"^{named}:"):
        check_m2po_args(SimpleNamespace(**{**NEUTRAL, **options}))


def test_data_and_sequence_parallelism_are_refused_and_beta_warns():
    with pytest.raises(ValueError, match=r"^nproc_per_node: without a selection across the data-parallel group"):
        check_m2po_args(SimpleNamespace(**NEUTRAL), world_size=2)
    check_m2po_args(SimpleNamespace(**NEUTRAL), world_size=2, collective=True)  # the trainer's: one selection across the group
    with pytest.raises(ValueError, match=r"^sequence_parallel_size:"):
        check_m2po_args(SimpleNamespace(**NEUTRAL), sequence_parallel_size=2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        check_m2po_args(SimpleNamespace(**{**NEUTRAL, "beta": 0.04}))
    assert any(issubclass(w.category, M2POKLWarning) for w in seen)


# --- compare --impl trainer:swift: the trainer battery on ms-swift's real step ------------------

#: A scoped step (one micro-batch per prompt, workers 1 and 3 steps behind, tau cutting three
#: trust-region tokens, uneven lengths) on which every ms-swift control differs from Algorithm 1
#: (TRL's scoped case: the same step through the other framework).
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


def test_compare_trainer_swift_is_equivalent_and_every_fail_closed_probe_is_refused_by_the_integration(tmp_path, capsys):
    from m2po_oracle.cli.main import main
    from m2po_oracle.trainer.probes import TRAINER_PROBES

    path = tmp_path / "swift.json"
    # Without --dtype the run takes the one dtype ms-swift's step computes in, and says so.
    assert main(["compare", "--impl", "trainer:swift", "--examples", "2", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["verdict"] == "equivalent" and data["examples"] == 2, data["verdict"]
    assert (
        data["options"]["dtype"] == "float32" and data["options"]["dtype_why"] == "the dtype trainer:swift computes in; --dtype not given"
    )
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
    assert [probes[p.name]["status"] for p in TRAINER_PROBES] == [p.expected for p in TRAINER_PROBES], probes
    # The refusals are the integration's, in ms-swift's option names (the adapter refuses only the one setting ms-swift lacks).
    assert probes["sequence_level_is"]["message"].startswith("ValueError: importance_sampling_level:")
    assert probes["rollout_is_correction"]["message"].startswith("ValueError: rollout_importance_sampling_mode:")
    assert probes["stochastic_mask_prepass"]["message"].startswith("ValueError: disable_dropout:")
    assert probes["deployment_behavior_logp_missing"]["message"].startswith(
        "ValueError: behavior_logp: the rollout engine outside the trainer returned no log-probs"
    )
    assert probes["deployment_behavior_logp_from_trainer"]["message"].startswith("ValueError: behavior_logp_source:")
    assert probes["kl_coefficient"]["message"].startswith("M2POKLWarning: beta=0.01")
    out = capsys.readouterr().out
    assert "dtype: float32 (the dtype trainer:swift computes in; --dtype not given)" in out and "verdict: equivalent" in out


def _scoped_outcome(spec: str):
    from m2po_oracle.call.runner import RunOptions
    from m2po_oracle.cli.launch import open_runner
    from m2po_oracle.trainer.cases import TrainerCase

    runner = open_runner(spec, RunOptions(dtype="float32"))
    return runner.run_battery(TrainerCase.from_dict(SCOPED_CASE))


@pytest.mark.parametrize("control", ["", *sorted(SWIFT_CONTROLS)])
def test_each_swift_control_is_caught_by_its_check_and_named_by_the_diagnosis(control):
    outcome = _scoped_outcome("trainer:swift" + (f":{control}" if control else ""))
    failed = {m.check for m in outcome.mismatches}
    if not control:
        assert not failed, [m.summary for m in outcome.mismatches]
        # The scoped step has two micro-batches: the accumulation check ran and passed.
        assert "trainer.accumulation" in outcome.checked and outcome.case["trainer"]["split"] == [2, 2], outcome.case["trainer"]
        return
    expected = SWIFT_CONTROLS[control]
    assert set(expected.caught_by) <= failed, f"{control}: expected {expected.caught_by} to fail, failed: {sorted(failed)}"
    assert outcome.evidenced == (expected.variant,), (
        f"{control}: expected the diagnosis to name {expected.variant!r} "
        f"alone; consistent: {outcome.explained_by}, evidenced: {outcome.evidenced}"
    )


def test_swift_with_a_kl_term_passes_the_kl_check_that_its_k1_control_fails():
    from m2po_oracle.integrations.swift_step import swift_trainer
    from m2po_oracle.trainer.cases import TrainerCase
    from m2po_oracle.trainer.runner import TrainerRunner

    # The control's own run (k1, caught and named) is test_each_swift_control_is_caught_...[kl_k1_estimator].
    assert SWIFT_CONTROLS["kl_k1_estimator"].beta == 0.1 and "trainer.kl_term" in SWIFT_CONTROLS["kl_k1_estimator"].caught_by
    runner = TrainerRunner(trainer=swift_trainer(), spec="trainer:swift", beta=0.1)
    outcome = runner.run_battery(TrainerCase.from_dict(SCOPED_CASE))
    assert runner.options.dtype == "float32" and "trainer.kl_term" in outcome.checked
    assert not outcome.mismatches, [m.summary for m in outcome.mismatches]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["compare", "--impl", "trainer:swift", "--dtype", "float64", "--examples", "1"],
            "dtype: trainer:swift computes in float32: ms-swift collates the engine's log-probs into float32",
        ),
        (["compare", "--impl", "trainer:swift:no_such_control"], "unknown ms-swift control 'no_such_control'; known: per_micro_batch_mask"),
    ],
)
def test_trainer_swift_usage_errors_name_the_problem(argv, message, capsys):
    from m2po_oracle.cli.main import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err


# --- data parallel: two ms-swift processes on gloo under torchrun, one selection across both -----


@pytest.fixture(scope="module")
def dp_runs(tmp_path_factory):
    """Both data-parallel demo runs (swift_dp_runs.py, beside this file), in one torchrun world."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path_factory.mktemp("dp")
    script = Path(__file__).with_name("swift_dp_runs.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script), str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=400, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("of 2 process(es) on gloo: ran both") == 2, done.stdout[-2000:]
    return out


def _pulled_back_norms(capture, inputs, step=0):
    """Each parameter's gradient norm recomputed from the capture: every rank's and micro-batch's
    captured d loss / d logp pulled back through the demo's initial model (step 0)."""
    import torch
    from safetensors.torch import load_file

    from m2po_oracle.integrations.swift_demo import demo_model

    model = demo_model(SETUP.seed)
    total = 0
    for (rank, _, micro), record in capture.records(step=step):
        x = load_file(str(inputs / f"rank{rank}-step{step}-mb{micro}.safetensors"))
        keep = int(x["logits_to_keep"])
        forward = {name: x[name] for name in ("input_ids", "attention_mask", "position_ids") if name in x}
        logits = model(**forward).logits[:, -keep - 1 : -1]
        logp = torch.log_softmax(logits, -1).gather(-1, x["input_ids"][:, -keep:, None])[..., 0]
        valid = record["mask"]
        assert torch.equal(valid, x["completion_mask"].bool()), (rank, micro)
        assert float((torch.where(valid, logp, 0) - torch.where(valid, record["logp"], 0)).detach().abs().max()) < 1e-5, (rank, micro)
        total = total + (torch.where(valid, record["grad"], 0) * torch.where(valid, logp, 0)).sum()
    total.backward()
    return {name: float(p.grad.double().norm()) for name, p in model.named_parameters()}


def test_two_gloo_ranks_select_once_over_the_dp_group_and_the_audit_reassembles_both(dp_runs):
    report = audit_capture(dp_runs / "dp2")
    assert report.verdict == "equivalent", [(s.step, [(c.name, c.summary) for c in s.checks if c.status == "fail"]) for s in report.steps]
    capture = load_capture(dp_runs / "dp2")
    assert capture.world_size == 2 and {rank for rank, _, _ in capture} == {0, 1}
    per_rank_differs = 0
    for step in capture.steps():
        by_rank = {rank: [record for _, record in capture.records(step=step, rank=rank)] for rank in (0, 1)}
        records = by_rank[0] + by_rank[1]
        assert len(records) == 4  # two ranks x two micro-batches, one selection over all four
        batch = window_batch(records)
        keep = np.concatenate([r["keep"].numpy() for r in records])
        assert same_up_to_ties(keep, oracle.m2po(batch).keep, valid_m2(batch)), f"step {step}: the mask is not Algorithm 1 over both ranks"
        alone = np.concatenate([oracle.m2po(window_batch(by_rank[rank])).keep for rank in (0, 1)])
        per_rank_differs += not same_up_to_ties(alone, oracle.m2po(batch).keep, valid_m2(batch))
    assert per_rank_differs >= 1, "no step where each rank selecting alone would have kept another mask: the run shows nothing"
    # DDP averages the ranks' gradients; the objective wants their sum. The gradient each rank
    # noted before the first optimizer step (no clipping) is the sum over both ranks' records.
    expected = _pulled_back_norms(capture, dp_runs / "inputs")
    noted = capture.parameter_gradients(0)
    for rank in (0, 1):
        for name, norm in expected.items():
            assert math.isclose(noted[rank][name]["norm"], norm, rel_tol=1e-5), (rank, name, noted[rank][name]["norm"], norm)


def test_a_rank_selecting_alone_is_caught_and_named_by_the_audit(dp_runs):
    # Six steps: the demo's step 5 is one where only a rank's own selection reproduces the mask.
    report = audit_capture(dp_runs / "alone")
    assert report.verdict == "divergent"
    shown = [s for s in report.steps if any(c.name == "audit.selection" and c.status == "fail" for c in s.checks)]
    # A scope is named where the mask shows it; where a micro-batch selecting alone gives the same
    # mask the files cannot tell the two apart and say so (an alternative); no other name is given.
    assert any(s.diagnosis == ["per_rank_selection_global_n"] for s in shown), [(s.step, s.diagnosis) for s in report.steps]
    assert all("per_rank_selection_global_n" in [*s.diagnosis, *(x for v in s.alternatives.values() for x in v)] for s in shown), [
        (s.step, s.diagnosis, s.alternatives) for s in shown
    ]
    assert all(set(s.diagnosis) <= {"per_rank_selection_global_n", "per_micro_batch_mask"} for s in report.steps), [
        (s.step, s.diagnosis) for s in report.steps
    ]
