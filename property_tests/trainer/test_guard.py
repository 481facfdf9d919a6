"""The trainer option guard: each refusal declared once, naming its option, silent on the
neutral settings; the rules several frameworks share are one object, not two copies."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from m2po_oracle.trainer.guard import NO_ENTROPY_MASK, TOKEN_LEVEL_RATIOS, Refusal, full_distribution, refuse

trl = pytest.importorskip("m2po_oracle.integrations.trl", reason="TRL is not installed")


def test_neutral_settings_pass_and_each_refusal_names_its_option():
    refuse(SimpleNamespace(), trl.TRL_REFUSALS)  # a framework version without any of the options
    for refusal in trl.TRL_REFUSALS:
        assert refusal.says(SimpleNamespace()).startswith(f"{refusal.option}: ")
    assert len({r.option for r in trl.TRL_REFUSALS}) == len(trl.TRL_REFUSALS), "an option refused twice"


def test_the_first_refused_option_is_named():
    with pytest.raises(ValueError, match=r"^importance_sampling_level: .* got 'sequence'"):
        refuse(SimpleNamespace(importance_sampling_level="sequence", top_p=0.9), trl.TRL_REFUSALS)
    with pytest.raises(ValueError, match=r"^top_p: the sampler must draw from the full distribution \(got top_p=0.9\); TRL's"):
        refuse(SimpleNamespace(top_p=0.9), trl.TRL_REFUSALS)


def test_shared_rules_are_declared_once():
    assert TOKEN_LEVEL_RATIOS in trl.TRL_REFUSALS and NO_ENTROPY_MASK in trl.TRL_REFUSALS
    top_k = full_distribution("top_k", -1, "a framework", also_neutral=(0,), fix=" (set it to -1)")
    assert not top_k.refuses(SimpleNamespace(top_k=0)) and not top_k.refuses(SimpleNamespace(top_k=None))
    assert top_k.refuses(SimpleNamespace(top_k=5)) and top_k.says(SimpleNamespace(top_k=5)).endswith("(set it to -1)")
    custom = Refusal("x", lambda a: getattr(a, "x", 0) > 1, lambda a: f"x: {a.x} is too many")
    with pytest.raises(ValueError, match="^x: 2 is too many$"):
        refuse(SimpleNamespace(x=2), (custom,))
