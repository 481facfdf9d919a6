"""One registry of checks, one of deviations, each knob's roles declared once, and the
diagnosis as one typed record: every world draws on them, and a name missing from them fails."""

from __future__ import annotations

import json
from dataclasses import FrozenInstanceError, fields

import pytest

from m2po_oracle.explain import deviations, step_deviations
from m2po_oracle.explain.record import EXPLAINING, Diagnosis, Match, Share
from m2po_oracle.judge import checks


def test_every_step_name_a_world_gives_is_registered_and_accepted():
    from m2po_oracle.audit import diagnosis as audit_diagnosis
    from m2po_oracle.cli.config import known_deviations
    from m2po_oracle.distributed.diagnosis import DESCRIPTIONS
    from m2po_oracle.trainer.diagnosis import TRAINER_VARIANTS

    scope_names = {n for t in audit_diagnosis.SCOPE_NAMES.values() for n in t if n}
    assert scope_names <= set(step_deviations.described("audit")), scope_names - set(step_deviations.described("audit"))
    assert list(DESCRIPTIONS) == list(step_deviations.described("distributed"))
    assert [v.name for v in TRAINER_VARIANTS] == list(step_deviations.described("trainer"))
    every = {d.name for d in step_deviations.STEP_DEVIATIONS} | {v.name for v in deviations.VARIANTS if v.name != "algorithm_1"}
    assert set(known_deviations()) == every  # `accept` takes what any world names, the audit's own included


def test_a_name_the_registry_lacks_is_refused():
    with pytest.raises(ValueError, match="no step deviation audit names"):
        step_deviations.said("audit", "kl_k1_estimator")
    with pytest.raises(ValueError, match="said: expected descriptions"):
        step_deviations.StepDeviation("planted", {"nowhere": "a world no runner is"})


def test_the_check_registry_holds_the_audits_checks():
    from m2po_oracle.audit import CHECK_NAMES

    assert tuple(checks.AUDIT_CHECKS) == CHECK_NAMES
    assert set(checks.AUDIT_CHECKS) <= set(checks.ALL_CHECKS)


def unroled_knobs(deviation: type) -> list[str]:
    """The knobs of ``deviation`` that neither the judge's memo keys nor a check shows."""
    return [f.name for f in fields(deviation) if not (f.metadata["selection"] or f.metadata["objective"] or f.metadata["shown_by"])]


def test_each_knob_declares_its_roles_once_and_the_lists_follow():
    knobs = {f.name: f.metadata for f in fields(deviations.Deviation)}
    assert set(deviations.SELECTION_KNOBS) == {n for n, m in knobs.items() if m["selection"]}
    assert set(deviations.LOSS_EFFECTS) <= set(deviations.OBJECTIVE_KNOBS)  # a loss effect is judged by the objective's memo
    assert set(deviations.BEHAVIOURAL.values()) <= set(checks.CHECKS)
    unroled = unroled_knobs(deviations.Deviation)
    assert not unroled, f"knobs with no role: no memo keys them and no check shows them: {unroled}"


def test_a_knob_without_a_role_is_seen():
    """Planted: a knob declared with no role is one the judge's memo would ignore."""
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Planted(deviations.Deviation):
        forgotten: bool = deviations.knob(False)

    assert unroled_knobs(Planted) == ["forgotten"]


def test_the_diagnosis_is_a_frozen_record_with_one_json_shape():
    d = Diagnosis(
        "matched",
        examples_compared=3,
        examples_searched=3,
        components=("strict_stop",),
        by_check={"selection.minimal": ("strict_stop",)},
        shares={"selection.minimal": Share(3, 3, 0, 3, 1.0, ("strict_stop",))},
        matches=(Match("strict_stop", "d", "s", "e", ("selection.minimal",), ()),),
        alternatives_reason="r",
        summary="explained",
    )
    with pytest.raises(FrozenInstanceError):
        d.status = "not_run"  # type: ignore[misc]  # the planted write a frozen record refuses
    record = d.to_json()
    assert json.loads(json.dumps(record)) == record  # plain JSON: lists, not tuples, once written
    assert record["shares"]["selection.minimal"] == {
        "explained": 3,
        "failing": 3,
        "contradicted": 0,
        "of": 3,
        "share": 1.0,
        "components": ["strict_stop"],
        "held_out": None,
    }
    assert Diagnosis.not_run().to_json() == {"status": "not_run", "examples_compared": 0, "matches": [], "closest": []}
    assert Diagnosis.not_run().status not in EXPLAINING and d.status in EXPLAINING
