"""M2PO in verl 0.9.1's real actor update (``m2po_oracle.integrations.verl``): the trainer battery on
verl's own update path (``compare --impl trainer:verl``), each planted bug caught and named, the
budget set through verl's config system, options that change the objective refused naming them,
and verl's own registered losses judged not M2PO.

verl 0.9.1 needs transformers<5.11, so these tests run only in its own environment (.venv-verl,
constraints-verl.txt): ``.ci/run``'s verl stage and ``tox -e verl`` run them. Elsewhere the module is
skipped, saying so; the stage sets ``M2PO_REQUIRE_VERL=1``, under which a missing verl fails the
collection instead. Every update runs on the CPU (the step's own platform glue) on a random-weight
Llama built in code; nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import warnings

import pytest

pytestmark = pytest.mark.verl
if os.environ.get("M2PO_REQUIRE_VERL"):
    # The verl stage sets this: there a missing verl is an error, never a skip that passes the stage.
    import verl.workers.engine_workers  # noqa: F401
else:
    pytest.importorskip(
        "verl.workers.engine_workers",
        reason="needs verl 0.9.1 (its own environment, .venv-verl): .ci/run's verl stage and tox -e verl run these tests",
    )

import torch  # noqa: E402

from m2po_oracle.integrations.verl import LOSS_MODE, M2POPolicyLossConfig, check_m2po_config  # noqa: E402
from m2po_oracle.integrations.verl_step import VERL_CONTROLS, verl_trainer  # noqa: E402
from m2po_oracle.trainer.grpo import M2POKLWarning  # noqa: E402

#: A scoped step (two micro-batches of two rows, workers 1 and 3 steps behind, tau cutting three
#: trust-region tokens, uneven lengths) on which every control differs from Algorithm 1 (the
#: TRL and ms-swift tests' scoped case: the same step through verl).
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


def _outcome(spec: str, *, beta: float | None = None):
    from m2po_oracle.call.runner import RunOptions
    from m2po_oracle.cli.launch import open_runner
    from m2po_oracle.trainer.cases import TrainerCase
    from m2po_oracle.trainer.runner import TrainerRunner

    if beta is None:
        runner = open_runner(spec, RunOptions(dtype="float32"))
    else:
        runner = TrainerRunner(trainer=verl_trainer(), spec=spec, beta=beta)
    return runner.run_battery(TrainerCase.from_dict(SCOPED_CASE))


# --- compare --impl trainer:verl: the trainer battery on verl's real update ------------------------


def test_compare_trainer_verl_is_equivalent_and_every_fail_closed_probe_is_refused(tmp_path, capsys):
    from m2po_oracle.cli.main import main
    from m2po_oracle.trainer.probes import TRAINER_PROBES

    path = tmp_path / "verl.json"
    # Without --dtype the run takes the one dtype verl's step computes in, and says so.
    assert main(["compare", "--impl", "trainer:verl", "--examples", "2", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["verdict"] == "equivalent" and data["examples"] == 2, data["verdict"]
    assert data["options"]["dtype"] == "float32" and data["options"]["dtype_why"] == "the dtype trainer:verl computes in; --dtype not given"
    ran = {c["name"]: c["status"] for c in data["checks"]}
    for name in (
        "trainer.behavior_logp",
        "trainer.policy_logp",
        "trainer.parameter_gradient",
        "trainer.optimizer_step",
        "selection.minimal",
        "loss",
        "gradient",
        "metrics.m2_before",
        "metrics.masked_fraction",
    ):
        assert ran[name] == "pass", (name, ran)
    probes = {p["probe"]: p for p in data["validation"]["probes"]}
    assert [probes[p.name]["status"] for p in TRAINER_PROBES] == [p.expected for p in TRAINER_PROBES], probes
    # The integration's own refusals, in verl's option names.
    assert probes["rollout_is_correction"]["message"].startswith("ValueError: algorithm.rollout_correction.rollout_is:")
    assert probes["stochastic_mask_prepass"]["message"].startswith("ValueError: model: the mask prepass must be deterministic")
    assert probes["deployment_behavior_logp_missing"]["message"].startswith("ValueError: rollout_log_probs: the mini-batch carries no")
    assert probes["kl_coefficient"]["message"].startswith("M2POKLWarning: kl_loss_coef=0.01")
    assert "verdict: equivalent" in capsys.readouterr().out


@pytest.mark.parametrize("control", ["", *sorted(VERL_CONTROLS)])
def test_each_verl_control_is_caught_by_its_check_and_named_by_the_diagnosis(control):
    outcome = _outcome("trainer:verl" + (f":{control}" if control else ""))
    failed = {m.check for m in outcome.mismatches}
    if not control:
        assert not failed, [m.summary for m in outcome.mismatches]
        # Two micro-batches: the accumulation check ran (and passed) against the same step as one.
        assert "trainer.accumulation" in outcome.checked and outcome.case["trainer"]["split"] == [2, 2], outcome.case["trainer"]
        return
    expected = VERL_CONTROLS[control]
    assert set(expected.caught_by) <= failed, f"{control}: expected {expected.caught_by} to fail, failed: {sorted(failed)}"
    assert outcome.evidenced == (expected.variant,), (
        f"{control}: expected the diagnosis to name {expected.variant!r} alone; consistent: {outcome.explained_by}, "
        f"evidenced: {outcome.evidenced}"
    )


def test_per_micro_batch_metrics_averaged_by_verl_are_a_finding_beside_the_weighted_value():
    """Each micro-batch returns its own metrics on the right mask; verl's own averaging logs their
    mean with equal weight. Only the metric checks fail; the finding holds verl's logged number
    and Algorithm 1's token-weighted one, and no selection or mask deviation is named."""
    outcome = _outcome("trainer:verl:micro_batch_metrics")
    failed = {m.check for m in outcome.mismatches}
    assert failed and all(check.startswith("metrics.") for check in failed), failed
    assert outcome.evidenced == ("unweighted_micro_batch_metric_mean",), (outcome.explained_by, outcome.evidenced)
    found = outcome.metric_averaging
    assert found is not None and found.micro_batches == 2
    masked = {m.name: m for m in found.differing}["masked_fraction"]
    # The scoped case: 12 and 10 valid tokens, 2 and 1 masked; verl logs (2/12 + 1/10) / 2, Algorithm 1 3/22.
    assert masked.counts == (12, 10) and masked.logged == pytest.approx((2 / 12 + 1 / 10) / 2, rel=1e-6), masked
    assert masked.weighted == pytest.approx(3 / 22, rel=1e-12), masked
    assert "masked_fraction logged 0.133333, token-weighted 0.136364" in found.summary(), found.summary()


def test_verl_with_its_k3_kl_term_passes_the_kl_check_that_its_k1_control_fails():
    # The control's own run (kl_loss_type=k1, caught and named) is the parametrised test above.
    assert VERL_CONTROLS["kl_k1_estimator"].beta == 0.1 and "trainer.kl_term" in VERL_CONTROLS["kl_k1_estimator"].caught_by
    outcome = _outcome("trainer:verl", beta=0.1)
    assert "trainer.kl_term" in outcome.checked
    assert not outcome.mismatches, [m.summary for m in outcome.mismatches]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["compare", "--impl", "trainer:verl", "--dtype", "float64", "--examples", "1"],
            "dtype: trainer:verl computes in float32: verl's FSDP engine computes the log-probs from float32 logits",
        ),
        (["compare", "--impl", "trainer:verl:no_such_control"], "unknown verl control 'no_such_control'; known: per_micro_batch_mask"),
    ],
)
def test_trainer_verl_usage_errors_name_the_problem(argv, message, capsys):
    from m2po_oracle.cli.main import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err


# --- a real verl update, captured and audited ------------------------------------------------------


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    from m2po_oracle.integrations.verl_demo import VerlDemo, run

    capture = tmp_path_factory.mktemp("verl-demo") / "capture"
    return capture, run(VerlDemo(), str(capture))


def test_a_real_verl_update_selects_once_per_mini_batch_and_audits_equivalent(demo_run):
    from window_checks import assert_one_selection_per_window

    from m2po_oracle.audit import audit_capture
    from m2po_oracle.capture import load_capture
    from m2po_oracle.integrations.hf_window import LOGGED_METRICS, METRIC_PREFIX
    from m2po_oracle.integrations.verl_demo import VerlDemo

    directory, logged = demo_run
    demo = VerlDemo()
    capture = load_capture(directory)
    windows = {step: [record for _, record in capture.records(step=step)] for step in capture.steps()}
    # Two mini-batches of two micro-batches, two epochs: four optimizer steps, each selected over its four rows.
    assert sorted(windows) == list(range(demo.steps)) and all(
        len(w) == demo.mini_batch_size // demo.micro_batch_size for w in windows.values()
    )
    assert_one_selection_per_window(windows, demo.steps)
    report = audit_capture(directory)
    assert report.verdict == "equivalent", [(s.step, [(c.name, c.summary) for c in s.checks if c.status == "fail"]) for s in report.steps]
    ran = {c.name: c.status for s in report.steps for c in s.checks}
    for name in ("audit.selection", "audit.policy_logp", "audit.behavior_logp", "audit.loss_sum", "audit.gradient", "audit.metrics"):
        assert ran.get(name) == "pass", (name, ran.get(name))
    assert ran.get("audit.parameter_gradient") == "pass", ran
    assert sorted(logged) == sorted(METRIC_PREFIX + m for m in LOGGED_METRICS), logged


#: Each planted bug on the demo: the audit check that must fail and the name the audit must give
#: (observed: every step shows each, except current_policy_as_behavior, named on its first step).
AUDITED = {
    "per_micro_batch_mask": ("audit.selection", "per_micro_batch_mask"),
    "per_micro_batch_denominator": ("audit.gradient", "per_micro_batch_denominator"),
    "current_policy_as_behavior": ("audit.behavior_logp", "current_policy_as_behavior"),
    "optimizer_step_per_micro_batch": ("audit.policy_logp", "optimizer_step_per_micro_batch"),
    "kept_count_denominator": ("audit.gradient", "kept_count_denominator"),
    "micro_batch_metrics": ("audit.metrics", "unweighted_micro_batch_metric_mean"),
}


@pytest.mark.parametrize("fault", sorted(AUDITED))
def test_each_planted_bug_in_a_real_verl_update_is_caught_and_named_by_the_audit(fault, tmp_path):
    from m2po_oracle.audit import audit_capture
    from m2po_oracle.integrations.verl_demo import VerlDemo, run

    check, name = AUDITED[fault]
    run(VerlDemo(), str(tmp_path / "capture"), fault)
    report = audit_capture(tmp_path / "capture")
    assert report.verdict == "divergent"
    caught = [s for s in report.steps if any(c.name == check and c.status == "fail" for c in s.checks)]
    assert caught, f"{fault}: no step fails {check}: {[(s.step, s.verdict) for s in report.steps]}"
    assert any(s.diagnosis == [name] for s in caught), [(s.step, s.diagnosis) for s in caught]
    assert all(set(s.diagnosis) <= {name} for s in report.steps), [(s.step, s.diagnosis) for s in report.steps]
    if fault == "micro_batch_metrics":  # right values averaged wrong: only the metrics fail, a finding says both means
        assert all(s.failing == ["audit.metrics"] for s in caught), [(s.step, s.failing) for s in caught]
        assert all(any(o.startswith("finding: ") and "token-weighted" in o for o in s.observations) for s in caught)


def test_two_gloo_ranks_under_torchrun_select_once_over_the_dp_group_and_audit_equivalent(tmp_path):
    """The demo under torchrun: each rank trains on its half of the rows; the mask of every
    mini-batch is Algorithm 1 over both ranks' micro-batches (each rank selecting alone would have
    kept another on some step), and the audit reassembles both ranks' captures."""
    import subprocess
    import sys

    import numpy as np
    from window_checks import window_batch

    from m2po_oracle import oracle
    from m2po_oracle.audit import audit_capture
    from m2po_oracle.capture import load_capture
    from m2po_oracle.judge.equivalence import same_up_to_ties, valid_m2

    capture = tmp_path / "dp2"
    module = "m2po_oracle.integrations.verl_demo"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        module,
        "--capture",
        str(capture),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("rank ") == 2 and "of 2, recorded in" in done.stdout, done.stdout[-2000:]
    loaded = load_capture(capture)
    assert loaded.world_size == 2 and {rank for rank, _, _ in loaded} == {0, 1}
    per_rank_differs = 0
    for step in loaded.steps():
        by_rank = {rank: [record for _, record in loaded.records(step=step, rank=rank)] for rank in (0, 1)}
        batch = window_batch(by_rank[0] + by_rank[1])
        keep = np.concatenate([r["keep"].numpy() for r in by_rank[0] + by_rank[1]])
        whole = oracle.m2po(batch).keep
        assert same_up_to_ties(keep, whole, valid_m2(batch)), f"step {step}: the mask is not Algorithm 1 over both ranks"
        alone = np.concatenate([oracle.m2po(window_batch(by_rank[rank])).keep for rank in (0, 1)])
        per_rank_differs += not same_up_to_ties(alone, whole, valid_m2(batch))
    assert per_rank_differs >= 1, "no step where each rank selecting alone would have kept another mask: the run shows nothing"
    # The ranks' replicas step with one gradient (averaged over the group, as FSDP's reduce-scatter
    # does), so both note the same norms before every step; each rank's own share differs.
    for step in loaded.steps():
        noted = loaded.parameter_gradients(step)
        assert noted[0] == noted[1], f"step {step}: the ranks stepped with different gradients"
    report = audit_capture(capture)
    assert report.verdict == "equivalent", [(s.step, [(c.name, c.summary) for c in s.checks if c.status == "fail"]) for s in report.steps]


def test_a_rank_selecting_alone_under_torchrun_is_caught_and_named_by_the_audit(tmp_path):
    """The same two-rank run with each rank selecting over its own rows only: the audit fails
    the selection on a step where the ranks alone keep another mask, and names the fault."""
    import subprocess
    import sys

    from m2po_oracle.audit import audit_capture

    capture = tmp_path / "alone"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["-m", "m2po_oracle.integrations.verl_demo", "--capture", str(capture), "--fault", "per_rank_selection"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    report = audit_capture(capture)
    assert report.verdict == "divergent"
    caught = [s for s in report.steps if any(c.name == "audit.selection" and c.status == "fail" for c in s.checks)]
    assert caught, [(s.step, s.verdict) for s in report.steps]
    assert all("per_rank_selection_global_n" in s.diagnosis for s in caught), [(s.step, s.diagnosis) for s in caught]


# --- the budget, in verl's config system --------------------------------------------------------


def _actor(**overrides):
    """verl's ActorConfig as its trainer builds it from the YAML (omega_conf_to_dataclass of a
    _target_ config), with the M2PO policy loss installed by its _target_."""
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    policy_loss = {"_target_": "m2po_oracle.integrations.verl.M2POPolicyLossConfig", "loss_mode": "m2po", "tau": 0.02}
    chosen = overrides.pop("policy_loss", {})
    if "_target_" in chosen:  # another class: verl's own PolicyLossConfig has no tau
        policy_loss = {"loss_mode": "m2po"}
    policy_loss.update(chosen)
    actor = {
        "_target_": "verl.workers.config.ActorConfig",
        "strategy": "fsdp",
        "rollout_n": 2,
        "ppo_mini_batch_size": 2,
        "ppo_micro_batch_size_per_gpu": 2,
        "use_torch_compile": False,
        "policy_loss": policy_loss,
        **overrides,
    }
    return omega_conf_to_dataclass(OmegaConf.create(actor))


def test_tau_is_a_key_of_the_policy_loss_config_verl_builds_from_its_yaml():
    actor = _actor()
    assert isinstance(actor.policy_loss, M2POPolicyLossConfig) and actor.policy_loss.tau == 0.02
    assert check_m2po_config(actor) == 0.02
    from hydra.errors import InstantiationException

    # hydra wraps the config class's error, naming the key it was building.
    with pytest.raises(
        InstantiationException, match=r"policy_loss\.tau: expected a finite number >= 0, got -0\.1(.|\n)*full_key: policy_loss"
    ):
        _actor(policy_loss={"tau": -0.1})


#: verl's actor options that would change Algorithm 1's objective, each refused naming it.
REFUSED = [
    ({"loss_agg_mode": "seq-mean-token-mean"}, r"actor\.loss_agg_mode: M2PO divides the masked sum by N"),
    ({"loss_agg_mode": "token-sum"}, r"actor\.loss_agg_mode:"),
    ({"entropy_coeff": 0.01}, r"actor\.entropy_coeff: an entropy bonus"),
    ({"use_kl_loss": True, "kl_loss_type": "k1"}, r"actor\.kl_loss_type: with use_kl_loss the KL term must be the k3"),
    ({"use_kl_loss": True, "kl_loss_type": "mse"}, r"actor\.kl_loss_type:"),
    ({"use_prefix_grouper": True}, r"actor\.use_prefix_grouper:"),
    (
        {"policy_loss": {"_target_": "verl.workers.config.PolicyLossConfig"}},
        r"policy_loss\._target_: loss_mode 'm2po' needs its budget tau",
    ),
]


@pytest.mark.parametrize(("options", "named"), REFUSED, ids=[n.split(":")[0].replace("\\", "") for _, n in REFUSED])
def test_each_verl_option_that_changes_the_objective_is_refused_naming_it(options, named):
    check_m2po_config(_actor())  # the neutral settings pass
    actor = _actor(**options)
    with pytest.raises(ValueError, match=rf"^{named}"):
        check_m2po_config(actor)


def test_sequence_parallelism_and_other_engines_are_refused_and_a_k3_kl_term_warns():
    actor = _actor()
    with pytest.raises(ValueError, match=r"^ulysses_sequence_parallel_size: the micro-batches are sequence shards"):
        check_m2po_config(actor, ulysses_sequence_parallel_size=2)
    with pytest.raises(ValueError, match=r"^actor\.strategy: this integration hooks verl's FSDP engine"):
        check_m2po_config(actor, strategy="megatron")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        check_m2po_config(_actor(use_kl_loss=True, kl_loss_type="low_var_kl", kl_loss_coef=0.05))
    assert any(issubclass(w.category, M2POKLWarning) and "kl_loss_coef=0.05" in str(w.message) for w in seen)


def test_an_objective_changing_option_stops_the_real_worker_before_any_update():
    from verl.workers.config import ActorConfig

    from m2po_oracle.integrations.verl_step import build_engine, build_worker, use_cpu_platform
    from m2po_oracle.trainer.grpo import tiny_llama

    use_cpu_platform()
    policy = tiny_llama(0)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    engine, engine_config, model_config = build_engine(policy, 1e-2, 2)
    actor = ActorConfig(
        strategy="fsdp",
        rollout_n=2,
        ppo_mini_batch_size=2,
        ppo_micro_batch_size_per_gpu=2,
        loss_agg_mode="seq-mean-token-sum-norm",
        policy_loss=M2POPolicyLossConfig(tau=0.04),
        use_torch_compile=False,
    )
    with pytest.raises(ValueError, match=r"^actor\.loss_agg_mode: .*'seq-mean-token-sum-norm'"):
        build_worker(engine, engine_config, model_config, actor, None)
    assert all(torch.equal(p, before[n]) for n, p in policy.named_parameters())


# --- verl's own registered losses are not M2PO -------------------------------------------------


def test_the_m2po_loss_is_registered_and_refuses_to_run_without_the_mini_batch_selection():
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    loss = get_policy_loss_fn(LOSS_MODE)
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"^policy_loss\.loss_mode: the 'm2po' loss selects its mask once per optimizer mini-batch"):
        loss(old_log_prob=x, log_prob=x, advantages=x, response_mask=x.bool(), config=_actor())


def test_every_other_registered_verl_loss_is_refused_by_the_m2po_worker_naming_loss_mode():
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    others = sorted(name for name in POLICY_LOSS_REGISTRY if name != LOSS_MODE)
    assert "vanilla" in others and len(others) >= 5, others
    for name in others:
        with pytest.raises(ValueError, match=rf"^policy_loss\.loss_mode: M2POTrainingWorker runs the 'm2po' loss; got '{name}'"):
            check_m2po_config(_actor(policy_loss={"loss_mode": name}))


def test_verls_vanilla_loss_is_judged_divergent_and_named_ppo_clip(tmp_path):
    """verl's registered vanilla loss through the policy-loss adapter: the M2PO checks fail it and
    the diagnosis names PPO's clip (verl's losses aggregate with config.global_batch_info, which
    the adapter's config carries)."""
    from m2po_oracle.cli.main import main

    path = tmp_path / "vanilla.json"
    spec = "verl.trainer.ppo.core_algos:compute_policy_loss_vanilla"
    # Eight examples, unshrunk and without the invalid-input probes: the verdict and its name are what is asked.
    argv = ["compare", "--impl", spec, "--adapter", "policy_loss", "--in-process", "--examples", "8", "--no-shrink", "--skip-validation"]
    assert main([*argv, "--json", str(path)]) == 1
    data = json.loads(path.read_text())
    assert data["verdict"] == "divergent", (data["verdict"], data["load_error"])
    assert "ppo_clip_still_applied" in data["diagnosis"]["components"], data["diagnosis"]


def test_the_worker_is_what_verls_actor_worker_builds():
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from m2po_oracle.integrations.verl import M2POActorRolloutRefWorker, M2POTrainingWorker

    assert issubclass(M2POActorRolloutRefWorker, ActorRolloutRefWorker)
    assert M2POActorRolloutRefWorker.actor_worker_cls is M2POTrainingWorker
