"""Adapters for the signature families real ports use, tested with stand-ins of each shape."""

from __future__ import annotations

import json
import math
import shlex

import numpy as np
import torch
from hypothesis import given

from m2po_oracle import strategies
from m2po_oracle.adapters import ADAPTERS, adapt
from m2po_oracle.cli.main import EXIT_DIVERGENT, EXIT_EQUIVALENT, EXIT_UNUSABLE, main
from m2po_oracle.core.loss import loss_from_selection, select_tokens
from m2po_oracle.judge.battery import assert_battery_passes, run_battery

# --- stand-ins, one per signature family ------------------------------------------------


def mask_only_port(log_ratio, advantages, mask, tau):
    """A correct mask-only port (Algorithm 1's selection from the log ratio)."""
    zeros = torch.zeros_like(log_ratio)
    return select_tokens(log_ratio, zeros, advantages, mask, tau=tau).keep


def mask_only_port_strict(log_ratio, advantages, mask, tau):
    """Planted bug: stops only when the mean is < tau; returns a float mask, as many ports do."""
    below = math.nextafter(tau, -math.inf)  # mean < tau  <=>  mean <= the float just below tau
    if below < 0:  # nothing satisfies mean < 0: every candidate is removed
        trust = mask & (((advantages > 0) & (log_ratio > 0)) | ((advantages < 0) & (log_ratio < 0)))
        return (mask & ~trust).float()
    return mask_only_port(log_ratio, advantages, mask, below).float()


def mask_function_port(behavior_logp, proximal_logp, loss_mask, threshold):
    """No advantages (AReaL's shape): every valid token with d != 0 is a candidate."""
    every_token_a_candidate = torch.sign(proximal_logp - behavior_logp)
    return select_tokens(proximal_logp, behavior_logp, every_token_a_candidate, loss_mask, tau=threshold).keep


def policy_loss_port(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config):
    """verl-registry shape: returns (loss, metrics); the mask stays inside."""
    mask = response_mask.bool()
    selection = select_tokens(log_prob, old_log_prob, advantages, mask, tau=config.m2_threshold)
    loss = loss_from_selection(log_prob, old_log_prob, advantages, selection.keep, mask.sum())
    return loss, {"m2po/masked_fraction": float(selection.masked_fraction)}


def policy_loss_port_kept_denominator(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config):
    mask = response_mask.bool()
    selection = select_tokens(log_prob, old_log_prob, advantages, mask, tau=config.m2_threshold)
    return loss_from_selection(log_prob, old_log_prob, advantages, selection.keep, selection.keep.sum()), {}


@given(strategies.batches())
def test_a_correct_mask_only_port_passes(batch):
    assert_battery_passes(adapt(mask_only_port, "mask_only"), batch, impl="mask_only_port")


@given(strategies.batches())
def test_a_correct_policy_loss_port_passes(batch):
    assert_battery_passes(adapt(policy_loss_port, "policy_loss"), batch, impl="policy_loss_port")


def test_a_mask_function_without_advantages_is_caught_masking_outside_the_trust_region():
    from m2po_oracle.oracle.batch import Batch

    # A > 0 with d < 0 is not a candidate; a port without advantages may still mask it.
    batch = Batch(np.array([[-2.0, -0.5]]), np.array([[-1.0, -1.0]]), np.array([[1.0, 1.0]]), np.ones((1, 2), bool), 0.04)
    outcome = run_battery(adapt(mask_function_port, "mask_function"), batch)
    assert "selection.only_trust_region_masked" in outcome.failed_checks


def test_policy_loss_bugs_are_caught_on_loss_and_gradient():
    from m2po_oracle.oracle.batch import Batch

    batch = Batch(np.array([[0.1, 0.3], [0.2, 0.4]]), np.zeros((2, 2)), np.ones((2, 2)), np.ones((2, 2), bool), 0.04)
    failed = run_battery(adapt(policy_loss_port_kept_denominator, "policy_loss"), batch).failed_checks
    assert {"loss", "gradient"} <= set(failed)


def test_the_mask_is_inferred_from_zero_gradients():
    from m2po_oracle.oracle.batch import Batch

    batch = Batch(np.array([[0.1, 0.3], [0.2, 0.4]]), np.zeros((2, 2)), np.ones((2, 2)), np.ones((2, 2), bool), 0.04)
    outcome = run_battery(adapt(policy_loss_port, "policy_loss"), batch)
    assert outcome.passed and outcome.measurement.result.keep.tolist() == [[True, False], [True, False]]


def test_a_non_mask_return_is_a_finding():
    bad = adapt(lambda log_ratio, advantages, mask, tau: log_ratio * 2, "mask_only")
    from m2po_oracle.oracle.batch import Batch

    outcome = run_battery(bad, Batch(np.array([[0.5, 0.1]]), np.zeros((1, 2)), np.ones((1, 2)), np.ones((1, 2), bool), 0.04))
    assert outcome.failed_checks == ("call",) and "expected a bool or 0/1 mask" in outcome.mismatches[0].summary


def test_cli_adapter_end_to_end_with_replay(tmp_path, capsys):
    spec = "property_tests.adapters.test_adapters"  # the stand-ins above, loaded by module:function
    assert main(["compare", "--impl", f"{spec}:mask_only_port", "--adapter", "mask_only", "--examples", "30"]) == EXIT_EQUIVALENT
    report = tmp_path / "strict.json"
    assert (
        main(["compare", "--impl", f"{spec}:mask_only_port_strict", "--adapter", "mask_only", "--examples", "60", "--json", str(report)])
        == EXIT_DIVERGENT
    )
    data = json.loads(report.read_text())
    assert data["adapter"]["name"] == "mask_only" and data["adapter"]["checked"] == list(ADAPTERS["mask_only"].checked)
    assert set(data["adapter"]["not_run"]) == {"loss", "gradient"}  # built by the adapter: not run, never pass
    assert {c["name"]: c["status"] for c in data["checks"]}["loss"] == "not run"
    replay = shlex.split(data["counterexamples"][0]["replay"])
    assert "--adapter" in replay and main(replay[1:]) == EXIT_DIVERGENT
    assert main(["compare", "--impl", f"{spec}:policy_loss_port", "--adapter", "policy_loss", "--examples", "20"]) == EXIT_EQUIVALENT
    assert main(["compare", "--impl", "core", "--adapter", "mask_onyl"]) == EXIT_UNUSABLE
    assert "closest matches: mask_only" in capsys.readouterr().err


def test_every_adapter_documents_what_it_checks():
    from m2po_oracle.judge.checks import CHECKS, result_field

    for adapter in ADAPTERS.values():
        assert adapter.signature.startswith("fn(") and adapter.checked and adapter.params and adapter.outputs
        assert adapter.supplies <= {"keep", "loss", "grad"} | set(_metric_names())
        # Every field is either the port's or built by the adapter (saying how), never neither.
        for field in ("keep", "loss", "grad"):
            assert (field in adapter.supplies) != (field in adapter.builds), f"{adapter.name}: {field}"
        assert set(adapter.unobservable) <= set(CHECKS)
        assert set(adapter.runs()) | set(adapter.not_run()) == set(adapter.judged_by) and "call" in adapter.runs()
        assert all(
            result_field(c) in adapter.builds or c in adapter.unobservable or result_field(c) not in adapter.supplies
            for c in adapter.not_run()
        )


def _metric_names() -> tuple[str, ...]:
    from m2po_oracle.oracle.record import COUNT_FIELDS, METRIC_FIELDS

    return METRIC_FIELDS + COUNT_FIELDS


def test_the_adapters_command_lists_each_family(capsys):
    assert main(["adapters"]) == EXIT_EQUIVALENT
    out = capsys.readouterr().out
    for adapter in ADAPTERS.values():
        assert f"\n{adapter.name}\n  signature:  {adapter.signature}\n" in out
    assert "not run:    loss: the adapter builds loss" in out and "M2_now -> m2_before" in out and "--bind KEY=VALUE" in out


def test_the_adapter_option_names_every_adapter():
    from m2po_oracle.cli.options import COMPARE_OPTIONS

    (option,) = [o for o in COMPARE_OPTIONS if o.name == "adapter"]
    assert all(name in option.help for name in ADAPTERS), option.help


def mask_function_port_m2_as_sum(behavior_logp, proximal_logp, loss_mask, threshold, advantages):
    """Algorithm 1's mask, but the port logs 'm2' as the sum of M2 over its valid tokens
    (read as m2_before by name, as some ports log it), and no other metric."""
    keep = select_tokens(proximal_logp, behavior_logp, advantages, loss_mask, tau=threshold).keep
    d = torch.where(loss_mask, proximal_logp - behavior_logp, torch.zeros_like(proximal_logp))
    return keep, {"m2": (d * d).sum(), "clip_count": 0.0}


def test_a_report_says_which_value_of_the_port_each_metric_read_and_never_calls_the_adapter_s_values_actual(tmp_path):
    """A metric read under the port's own name says so (console, mismatch, JSON, HTML);
    ``supplies`` lists only the metrics the port returned; the loss and gradient an adapter
    builds are shown as the adapter's, never as the port's "actual"."""
    from m2po_oracle.report.html import render_html

    path = tmp_path / "r.json"
    assert (
        main(
            [
                "compare",
                "--impl",
                "property_tests.adapters.test_adapters:mask_function_port_m2_as_sum",
                "--adapter",
                "mask_function",
                "--examples",
                "40",
                "--json",
                str(path),
            ]
        )
        == EXIT_DIVERGENT
    )
    data = json.loads(path.read_text())
    adapter = data["adapter"]
    assert adapter["metrics_read"] == {"m2_before": "[1]['m2']"}
    assert adapter["supplies"] == ["keep", "m2_before"] and adapter["builds"] == dict(ADAPTERS["mask_function"].builds)
    statuses = {c["name"]: c["status"] for c in data["checks"]}
    assert statuses["metrics.m2_before"] == "fail" and statuses["metrics.masked_fraction"] == "not run"
    failing = [m for cx in data["counterexamples"] for m in cx["mismatches"] if m["check"] == "metrics.m2_before"]
    assert failing and all(m["details"][0] == "read from the port's [1]['m2']" for m in failing)
    page = render_html(data)
    assert "metrics read" in page and "m2_before \u2190 [1][&#39;m2&#39;]" in page
    assert "(the adapter's, not the port's)</span>" in page  # the loss cell
    assert "grad (the adapter&#39;s, not the port&#39;s)</th>" in page
    assert "not run: no result the port returned carried masked_fraction" in page  # a metric it never returned says why
