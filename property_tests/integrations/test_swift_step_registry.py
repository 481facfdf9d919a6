"""``trainer:swift`` where ms-swift is not installed (the main environment): a usage error that
says so and how to install it, never a traceback; and its registry of controls, which reads
without ms-swift, plants the same faults as TRL's."""

from __future__ import annotations

import importlib.util

import pytest

from m2po_oracle.integrations.swift_step import SWIFT_CONTROLS, swift_trainer

INSTALL = "pip install -e '.[swift]' -c constraints-swift.txt"


def _swift_installed() -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("ms-swift")
    except PackageNotFoundError:
        return False
    return True


@pytest.mark.parametrize("spec", ["trainer:swift", "trainer:swift:per_micro_batch_mask"])
@pytest.mark.parametrize("absent", ["really", "hidden"])
def test_trainer_swift_without_ms_swift_is_a_usage_error_saying_how_to_install_it(spec, absent, capsys, monkeypatch):
    from m2po_oracle.cli import launch
    from m2po_oracle.cli.main import main

    if absent == "really" and _swift_installed():
        pytest.skip("ms-swift is installed here; the 'hidden' case hides it")
    if absent == "hidden":
        installed = launch.is_installed
        monkeypatch.setattr(launch, "is_installed", lambda distribution: distribution != "ms-swift" and installed(distribution))
    assert main(["compare", "--impl", spec, "--examples", "1"]) == 2
    err = capsys.readouterr().err
    assert f"impl: {spec} needs ms-swift 4.6, which is not installed in this environment" in err, err
    assert INSTALL in err and "Traceback" not in err, err


def test_the_swift_controls_plant_trls_faults_and_read_without_ms_swift():
    if importlib.util.find_spec("trl") is None:
        pytest.skip("needs TRL (the test extra) to compare with trainer:trl's controls")
    from m2po_oracle.integrations.trl_step import TRL_CONTROLS

    assert list(SWIFT_CONTROLS) == list(TRL_CONTROLS)
    for name, control in SWIFT_CONTROLS.items():
        assert (control.caught_by, control.variant, control.beta, control.faults) == (
            TRL_CONTROLS[name].caught_by,
            TRL_CONTROLS[name].variant,
            TRL_CONTROLS[name].beta,
            TRL_CONTROLS[name].faults,
        ), name


def test_the_swift_factory_declares_its_dtype_and_refuses_an_unknown_control():
    make = swift_trainer("kl_k1_estimator")
    assert (make.computes_in, make.kl_coefficient) == ("float32", 0.1)
    with pytest.raises(ValueError, match=r"^control: unknown ms-swift control 'nope'; known: per_micro_batch_mask, "):
        swift_trainer("nope")
