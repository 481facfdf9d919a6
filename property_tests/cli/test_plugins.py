"""The pytest plugin and implementations registered through entry points."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from m2po_oracle.judge.checks import CHECKS


def test_pytest_plugin_passes_the_core(pytester):
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--m2po-impl", "core", "--m2po-examples", "25", "--m2po-in-process")
    result.assert_outcomes(passed=len(CHECKS) + 1)


def test_pytest_plugin_fails_a_control_on_its_check_with_a_replay_command(pytester):
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--m2po-impl", "control:one_extra_removed", "--m2po-examples", "60", "--m2po-in-process"
    )
    result.assert_outcomes(failed=1, passed=len(CHECKS))
    result.stdout.fnmatch_lines(
        ["*replay: m2po-oracle replay --impl control:one_extra_removed*", "*FAILED*m2po[[]control:one_extra_removed[]]::selection.minimal*"]
    )


def test_pytest_plugin_runs_the_trainer_step_with_its_own_checks(pytester):
    from m2po_oracle.trainer.checks import CHECK_NAMES

    # Not shrunk: the failure, its check and its replay line are what the plugin owes here
    # (test_cli holds counterexamples minimal); shrinking the trainer case took half of this test.
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--m2po-impl", "trainer:embedding_gradient_dropped", "--m2po-examples", "8", "--m2po-no-shrink"
    )
    # trainer.kl_term runs only on steps with a KL term (beta != 0): these have none.
    result.assert_outcomes(failed=1, passed=len([c for c in CHECK_NAMES if c != "trainer.kl_term"]))
    result.stdout.fnmatch_lines(
        [
            "*replay: m2po-oracle replay --impl trainer:embedding_gradient_dropped*trainer_case*",
            "*FAILED*m2po[[]trainer:embedding_gradient_dropped[]]::trainer.parameter_gradient*",
        ]
    )


def test_pytest_plugin_strict_validation_and_unloadable_impl(pytester):
    strict = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "--m2po-impl",
        "control:m2_after_over_valid",
        "--m2po-examples",
        "5",
        "--m2po-in-process",
        "--m2po-strict-validation",
        "--m2po-no-shrink",
    )
    strict.stdout.fnmatch_lines(["*FAILED*::validation*"])
    missing = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--m2po-impl", "cor", "--m2po-in-process")
    missing.assert_outcomes(failed=len(CHECKS) + 1)
    missing.stdout.fnmatch_lines(["*could not be loaded*closest matches: core*"])


def test_pytest_plugin_is_inert_without_the_option(pytester):
    pytester.makepyfile("def test_nothing():\n    pass\n")
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)


def _fake_distribution(root) -> None:
    """An installed package that registers an implementation under the entry-point group."""
    (root / "fake_port.py").write_text(
        textwrap.dedent("""
        from m2po_oracle.core.loss import m2po_loss
        def loss(*args, **kwargs):
            return m2po_loss(*args, **kwargs)
    """)
    )
    info = root / "fake_port-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-port\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[m2po_oracle.implementations]\nfake-port = fake_port:loss\n")


def _cli(root, *args, env_extra=None):
    env = {**os.environ, "PYTHONPATH": str(root), **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "m2po_oracle", *args], capture_output=True, text=True, env=env, timeout=300)


def test_an_entry_point_registered_implementation_is_found_by_name(tmp_path):
    _fake_distribution(tmp_path)
    done = _cli(tmp_path, "compare", "--impl", "fake-port", "--examples", "10", "--in-process")
    assert done.returncode == 0, done.stdout + done.stderr
    typo = _cli(tmp_path, "compare", "--impl", "fake-prot", "--in-process")
    assert typo.returncode == 2 and "closest matches: fake-port" in typo.stderr
    off = _cli(tmp_path, "compare", "--impl", "fake-port", "--in-process", env_extra={"M2PO_ORACLE_NO_PLUGINS": "1"})
    assert off.returncode == 2 and "unknown implementation 'fake-port'" in off.stderr


POLICY_LOSS_PORT = """
import os
import torch


def policy_loss_port(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config):
    from m2po_oracle.core.loss import select_tokens

    mask = response_mask.bool()
    selection = select_tokens(log_prob.detach(), old_log_prob, advantages, mask, tau=config.m2_threshold)
    ratio = torch.exp(torch.where(selection.keep, log_prob - old_log_prob, torch.zeros_like(log_prob)))
    return -(torch.where(selection.keep, ratio * advantages, torch.zeros_like(log_prob))).sum() / mask.sum().clamp(min=1)


def counted_core(logp, behavior_logp, advantages, mask, *, tau):
    # One line per call, naming the process: a battery run in two xdist workers shows two pids.
    with open(os.environ["M2PO_CALL_LOG"], "a") as log:
        log.write(f"{os.getpid()}\\n")
    from m2po_oracle.core.loss import m2po_loss
    return m2po_loss(logp, behavior_logp, advantages, mask, tau=tau)
"""


def test_pytest_plugin_honours_the_adapter(pytester):
    pytester.makepyfile(port=POLICY_LOSS_PORT)
    result = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "--m2po-impl",
        "port:policy_loss_port",
        "--m2po-adapter",
        "policy_loss",
        "--m2po-examples",
        "15",
        "--m2po-in-process",
    )
    # A policy loss returns no metrics, and its mask is read from the gradient on valid tokens
    # only: those checks never ran, and say so instead of passing.
    from m2po_oracle.adapters import ADAPTERS

    skipped = {name for name in CHECKS if name.startswith("metrics.")} | set(ADAPTERS["policy_loss"].not_run())
    result.assert_outcomes(passed=len(CHECKS) + 1 - len(skipped), skipped=len(skipped))
    result.stdout.no_fnmatch_line("*unexpected keyword argument*")


def test_pytest_plugin_honours_the_topology(pytester):
    from m2po_oracle.distributed.runner import DistributedRunner

    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--m2po-impl", "core", "--m2po-topology", "dp=2", "--m2po-examples", "5"
    )
    result.assert_outcomes(passed=len(DistributedRunner.checks) + 1)
    refused = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--m2po-impl", "core", "--m2po-topology", "dp=2", "--m2po-adapter", "mask_only"
    )
    refused.stdout.fnmatch_lines(["*usage error*cannot honour --adapter*"])


def test_under_xdist_the_battery_runs_once(pytester, tmp_path):
    pytester.makepyfile(port=POLICY_LOSS_PORT)
    log = tmp_path / "calls.log"
    os.environ["M2PO_CALL_LOG"] = str(log)
    try:
        result = pytester.runpytest_subprocess(
            "-p", "no:cacheprovider", "-n", "2", "--m2po-impl", "port:counted_core", "--m2po-examples", "10", "--m2po-in-process"
        )
    finally:
        del os.environ["M2PO_CALL_LOG"]
    result.assert_outcomes(passed=len(CHECKS) + 1)
    assert len(set(log.read_text().split())) == 1, "more than one xdist worker ran the battery"
