"""``trainer:verl`` where verl is not installed (the main environment): a usage error that says so
and how to install it, never a traceback; and its registry of controls, which reads without verl,
plants the same faults as ms-swift's."""

from __future__ import annotations

import pytest

from m2po_oracle.integrations.swift_step import SWIFT_CONTROLS
from m2po_oracle.integrations.verl_step import VERL_CONTROLS, verl_trainer

INSTALL = "pip install -e '.[verl]' -c constraints-verl.txt"


def _verl_installed() -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("verl")
    except PackageNotFoundError:
        return False
    return True


@pytest.mark.parametrize("spec", ["trainer:verl", "trainer:verl:per_micro_batch_mask"])
@pytest.mark.parametrize("absent", ["really", "hidden"])
def test_trainer_verl_without_verl_is_a_usage_error_saying_how_to_install_it(spec, absent, capsys, monkeypatch):
    from m2po_oracle.cli import launch
    from m2po_oracle.cli.main import main

    if absent == "really" and _verl_installed():
        pytest.skip("verl is installed here; the 'hidden' case hides it")
    if absent == "hidden":
        installed = launch.is_installed
        monkeypatch.setattr(launch, "is_installed", lambda distribution: distribution != "verl" and installed(distribution))
    assert main(["compare", "--impl", spec, "--examples", "1"]) == 2
    err = capsys.readouterr().err
    assert f"impl: {spec} needs verl 0.9.1, which is not installed in this environment" in err, err
    assert INSTALL in err and "Traceback" not in err, err


def test_the_verl_controls_plant_the_other_integrations_faults_and_read_without_verl():
    # ms-swift's controls, then verl's own: the kept count handed to agg_loss as its token count,
    # and each micro-batch's own metrics, which verl averages with equal weight (named for the averaging).
    assert list(VERL_CONTROLS) == [*SWIFT_CONTROLS, "kept_count_denominator", "micro_batch_metrics"]
    assert VERL_CONTROLS["kept_count_denominator"].variant == "kept_count_denominator"
    assert VERL_CONTROLS["micro_batch_metrics"].variant == "unweighted_micro_batch_metric_mean"
    for name, control in SWIFT_CONTROLS.items():
        assert (control.caught_by, control.variant, control.beta, control.faults) == (
            VERL_CONTROLS[name].caught_by,
            VERL_CONTROLS[name].variant,
            VERL_CONTROLS[name].beta,
            VERL_CONTROLS[name].faults,
        ), name


def test_the_verl_factory_declares_its_dtype_and_refuses_an_unknown_control():
    make = verl_trainer("kl_k1_estimator")
    assert (make.computes_in, make.kl_coefficient) == ("float32", 0.1)
    with pytest.raises(ValueError, match=r"^control: unknown verl control 'nope'; known: per_micro_batch_mask, "):
        verl_trainer("nope")
