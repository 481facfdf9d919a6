"""Fail-closed probes: reported apart from equivalence, counted only when asked to."""

from __future__ import annotations

import textwrap

import pytest
import torch

from m2po_oracle.call.isolation import InProcess, Isolated
from m2po_oracle.call.planted import planted
from m2po_oracle.cli.main import EXIT_DIVERGENT, EXIT_EQUIVALENT, main
from m2po_oracle.compare.search import run_compare
from m2po_oracle.core.loss import m2po_loss
from m2po_oracle.explain.deviations import Deviation
from m2po_oracle.judge.validation import PROBES


def _permissive(*args, **kwargs):
    """Algorithm 1 without any input validation."""
    return planted(*args, **kwargs, deviation=Deviation())


@pytest.mark.parametrize("probe", [p.name for p in PROBES])
def test_the_core_rejects_every_invalid_input(probe):
    result = InProcess(m2po_loss).probe(probe)
    assert result.status == "rejected", f"{probe}: {result.message}"
    assert result.message.startswith("ValueError: "), f"{probe}: expected a ValueError naming the argument, got {result.message}"


def test_accepted_invalid_input_is_a_warning_unless_strict():
    lenient = run_compare(_permissive, "permissive", examples=15)
    assert lenient.verdict == "equivalent" and lenient.exit_status == 0
    accepted = {p.probe for p in lenient.validation_warnings}
    assert {"nan_logp_on_valid_token", "negative_tau", "nan_tau"} <= accepted
    strict = run_compare(_permissive, "permissive", examples=15, strict_validation=True)
    assert strict.verdict == "divergent" and strict.exit_status == 1
    assert strict.to_json()["validation"]["strict"] is True


def test_a_probe_that_hangs_is_reported_not_waited_for(tmp_path):
    source = tmp_path / "hangs_on_bad_tau.py"
    source.write_text(
        textwrap.dedent("""
        import math, time
        from m2po_oracle.core.loss import m2po_loss
        def port(logp, behavior_logp, advantages, mask, *, tau):
            if not tau >= 0:
                time.sleep(600)
            return m2po_loss(logp, behavior_logp, advantages, mask, tau=tau)
    """)
    )
    with Isolated(f"{source}:port", timeout_s=1.0) as runner:
        assert runner.probe("negative_tau").status == "hung"
        assert runner.probe("nan_logp_on_valid_token").status == "rejected"


def test_cli_strict_validation_exit_status(tmp_path):
    source = tmp_path / "permissive.py"
    source.write_text(
        "from m2po_oracle.call.planted import planted\nfrom m2po_oracle.explain.deviations import Deviation\n"
        "def port(*a, **k):\n    return planted(*a, **k, deviation=Deviation())\n"
    )
    assert main(["compare", "--impl", f"{source}:port", "--examples", "10", "--in-process"]) == EXIT_EQUIVALENT
    assert main(["compare", "--impl", f"{source}:port", "--examples", "10", "--in-process", "--strict-validation"]) == EXIT_DIVERGENT


def _fails_on_three_columns(logp, behavior_logp, advantages, mask, *, tau):
    """Algorithm 1 that crashes on every batch of three columns (the probes' clean batch
    has three), valid or not, as a port whose logging code breaks on some shapes does."""
    if logp.shape[-1] == 3:
        raise RuntimeError("The size of tensor a (3) must match the size of tensor b (2) at non-singleton dimension 1")
    return m2po_loss(logp, behavior_logp, advantages, mask, tau=tau)


def test_a_probe_on_a_batch_the_port_fails_anyway_is_not_run_not_crashed(capsys):
    """A probe's exception is a refusal (or a crash on invalid input) only where the same
    call without the invalid input goes through: otherwise the probe is not run, says why,
    and no summary claims the implementation fails closed (seen on an untuned public port
    whose ratio statistics crash whenever rows != columns: seven probes read 'crashed on
    invalid input'). The pytest plugin skips validation rather than passing it."""
    from m2po_oracle.cli import options
    from m2po_oracle.cli.config import ProjectConfig
    from m2po_oracle.cli.pytest_plugin import item_outcomes

    report = run_compare(_fails_on_three_columns, "three", examples=10)
    assert {p.status for p in report.validation} == {"not run"} and not report.validation_warnings
    assert all("raises on the valid batch this probe starts from too (RuntimeError" in p.message for p in report.validation)
    from rich.console import Console

    from m2po_oracle.cli.console import print_validation

    console = Console(record=True, width=200)
    print_validation(console, report.to_json())
    text = console.export_text()
    assert "no invalid-input probe could run" in text and "fails closed" not in text
    assert InProcess(m2po_loss).probe("nan_tau").status == "rejected"  # a port that runs on the clean batch is judged as before
    values = ProjectConfig().merged({o.name: None for o in options.COMPARE_OPTIONS + options.RUN_SETTINGS})
    outcome = item_outcomes("property_tests.judge.test_validation:_fails_on_three_columns", {**values, "examples": 10, "in_process": True})
    assert (
        outcome["items"]["validation"]["status"] == "skip"
        and "no invalid-input probe could run" in outcome["items"]["validation"]["message"]
    )


def _subtracts_none(logp, behavior_logp, advantages, mask, *, tau):
    """No check at all: a missing behavior_logp meets `logp - None`, a TypeError from the operation."""
    d = logp - behavior_logp
    return m2po_loss(logp, logp.detach() - d.detach(), advantages, mask, tau=tau)


def _hands_none_to_torch(logp, behavior_logp, advantages, mask, *, tau):
    """No check at all: torch's own argument check raises the TypeError."""
    d = torch.sub(logp, behavior_logp)
    return m2po_loss(logp, logp.detach() - d.detach(), advantages, mask, tau=tau)


def _refuses_none(logp, behavior_logp, advantages, mask, *, tau):
    if behavior_logp is None:
        raise TypeError("behavior_logp: required")
    return m2po_loss(logp, behavior_logp, advantages, mask, tau=tau)


def test_a_type_error_from_an_operation_is_a_crash_not_a_refusal():
    """A ValueError/TypeError counts as a refusal only where a raise statement outside torch
    and NumPy raised it; `None - tensor` or torch's own argument check is the port meeting
    the invalid input unguarded (it used to read "rejected as it should be")."""
    for port, where in ((_subtracts_none, "test_validation.py"), (_hands_none_to_torch, "test_validation.py")):
        result = InProcess(port).probe("behavior_logp_missing")
        assert result.status == "crashed" and "not a raise statement" in result.message and where in result.message, result
    assert InProcess(_refuses_none).probe("behavior_logp_missing").status == "rejected"
    # The rule is is_rejection's, which the distributed and trainer probes share.
    from m2po_oracle.judge.validation import accidental_origin, is_rejection

    with pytest.raises(TypeError) as raised:
        _subtracts_none(torch.zeros(1), None, torch.zeros(1), torch.ones(1, dtype=torch.bool), tau=0.04)
    assert not is_rejection(raised.value) and is_rejection(TypeError("declared"), ()) is True  # no traceback: the benefit of the doubt
    # A raise statement inside torch's own code is torch checking what the port handed it.

    with pytest.raises(ValueError) as raised:
        torch.nn.functional.interpolate(torch.ones(1, 1, 2))  # neither size nor scale_factor
    assert accidental_origin(raised.value).startswith("inside torch's own code at functional.py:")
