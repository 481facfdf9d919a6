"""A name is a claim about someone's code: it must hold on the examples the search did not
choose on, with a value a port would plausibly write, and the simplest bugs have names of
their own. Every stand-in here is self-written; none is derived from a port's code.
"""

from __future__ import annotations

import pytest
import torch

from m2po_oracle.call.runner import RunOptions
from m2po_oracle.cli.launch import open_runner
from m2po_oracle.compare.search import run_compare
from m2po_oracle.explain import fitting, shares
from m2po_oracle.explain.deviations import VARIANTS, variant

EXAMPLES = 150
VALUE_VARIANTS = {v.name.split("(")[0] for v in VARIANTS if not v.is_behavioural}


def _zeroed(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, torch.zeros_like(x))


def _loss(keep, logp, behavior_logp, advantages, mask, dtype=torch.float64):
    d = _zeroed(logp, mask).to(dtype) - _zeroed(behavior_logp, mask).to(dtype)
    term = torch.where(keep, torch.exp(d) * _zeroed(advantages, mask).to(dtype), torch.zeros_like(d))
    return (-term.sum() / mask.sum().clamp(min=1)).double()


def _select(d, advantages, mask, budget, *, strict=False, every_valid=False, per_row=False):
    """The loop 'remove the largest d^2 while the mean exceeds the budget', written here."""
    keep = mask.clone()
    for rows in [slice(i, i + 1) for i in range(d.shape[0])] if per_row else [slice(None)]:
        dd, aa, mm = d[rows], advantages[rows], mask[rows]
        candidates = mm.clone() if every_valid else mm & (((aa > 0) & (dd > 0)) | ((aa < 0) & (dd < 0)))
        values = (dd * dd)[candidates]
        if values.numel() == 0:
            continue
        ordered, order = torch.sort(values)
        means = torch.cumsum(ordered, 0) / torch.arange(1, values.numel() + 1, dtype=values.dtype)
        kept = int(((means < budget) if strict else (means <= budget)).sum())
        removed_flat = torch.ones_like(values, dtype=torch.bool)
        removed_flat[order[:kept]] = False
        removed = torch.zeros_like(candidates)
        removed[candidates] = removed_flat
        keep[rows] = keep[rows] & ~removed
    return keep


def never_selects(logp, behavior_logp, advantages, mask, *, tau):
    """The selection is never run: every valid token kept, the loss right on that mask."""
    return {"loss": _loss(mask.clone(), logp, behavior_logp, advantages, mask), "keep": mask.clone()}


def nan_and_keeps_all(logp, behavior_logp, advantages, mask, *, tau):
    """Broken: a NaN loss, every valid token kept."""
    return {"loss": _loss(mask.clone(), logp, behavior_logp, advantages, mask) * float("nan"), "keep": mask.clone()}


def twice_the_budget(logp, behavior_logp, advantages, mask, *, tau):
    """The mean compared with 2 tau."""
    d = (_zeroed(logp, mask) - _zeroed(behavior_logp, mask)).detach()
    keep = _select(d, advantages, mask, 2 * tau)
    return {"loss": _loss(keep, logp, behavior_logp, advantages, mask), "keep": keep}


def clamped_at_ten(logp, behavior_logp, advantages, mask, *, tau):
    """A straight-through clamp of d at 10 nats, seen by the selection and the loss."""
    d = _zeroed(logp, mask) - _zeroed(behavior_logp, mask)
    clamped = d + (d.clamp(-10, 10) - d).detach()
    keep = _select(clamped.detach(), advantages, mask, tau)
    term = torch.where(keep, torch.exp(clamped) * _zeroed(advantages, mask), torch.zeros_like(d))
    return {"loss": -term.sum() / mask.sum().clamp(min=1), "keep": keep}


def trainer_policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config):
    """A trainer's registered policy loss (no mask returned): every valid token a candidate,
    per row, a strict stop, PPO's clip still on kept tokens, and the loss in float32."""
    mask = response_mask.bool()
    d = _zeroed(log_prob.float(), mask) - _zeroed(old_log_prob.float(), mask)
    d64 = (_zeroed(log_prob, mask) - _zeroed(old_log_prob, mask)).detach()
    keep = _select(d64, advantages, mask, config.tau, strict=True, every_valid=True, per_row=True)
    ratio, a = torch.exp(d), advantages.float()
    term = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2))
    return torch.where(keep, term, torch.zeros_like(term)).sum() / mask.sum().clamp(min=1)


def _diagnosis(fn, examples=EXAMPLES):
    report = run_compare(fn, fn.__name__, examples=examples, shrink=False)
    assert report.verdict == "divergent", f"{fn.__name__}: the stand-in must deviate for the test to mean anything"
    return report.diagnosis.to_json()


def test_a_port_that_never_selects_is_named_so_not_as_a_clip_that_never_binds():
    d = _diagnosis(never_selects)
    assert d["components"] == ["never_removes"] and not d["unexplained"], d["summary"]


def test_a_broken_port_gets_no_name_for_what_it_breaks():
    d = _diagnosis(nan_and_keeps_all)
    assert set(d["components"]) <= {"never_removes"}, d["summary"]
    assert {"loss", "gradient"} <= set(d["unexplained"]), d["summary"]


@pytest.mark.parametrize(("fn", "name"), [(twice_the_budget, "scaled_budget(2)"), (clamped_at_ten, "clamped_log_ratio(10)")])
def test_a_known_deviation_at_another_value_is_named_with_its_value(fn, name):
    d = _diagnosis(fn, examples=300 if fn is clamped_at_ten else EXAMPLES)
    assert name in d["components"] and set(d["components"]) == {name}, d["summary"]


def test_zeros_the_loss_explains_are_not_read_as_masking():
    """Through an adapter that reads the mask from zero gradients, PPO's clip and float32
    underflow zero kept tokens' gradients: attributed to them, the selection is named in full."""
    runner = open_runner(f"{__file__}:trainer_policy_loss", RunOptions.from_values({"adapter": "policy_loss", "in_process": True}))
    with runner:
        report = run_compare(runner, "trainer_policy_loss", examples=300, shrink=False)
    d = report.diagnosis.to_json()
    expected = {"all_valid_candidates", "strict_stop", "per_sequence_selection", "ppo_clip_still_applied", "float32_loss"}
    assert set(d["components"]) == expected and not d["unexplained"], d["summary"]


def test_a_name_must_hold_on_the_held_out_examples():
    """Planted: a share that holds on every example together but not on the held-out ones
    alone (fitted to the sample) is refused; one with no failing example held out too."""
    fitted = shares.Measured("keep", list(range(20)), 24, 0, [], shares.HeldOut(2, 6, 0))
    holds = shares.Measured("keep", list(range(20)), 24, 0, [], shares.HeldOut(5, 6, 0))
    nothing_held = shares.Measured("keep", [0], 1, 0, [], None)
    assert not shares.named(fitted) and shares.named(holds) and not shares.named(nothing_held)


def test_an_implausible_value_is_no_fit():
    floors = fitting.PARAMETERS["clip_floors"]
    assert floors.plausible((0.2, 0.28)) and not floors.plausible((1.0, 9.8e16)) and not floors.plausible((0.2, 4e8))
    for name, parameter in fitting.PARAMETERS.items():
        assert parameter.reason, f"{name}: a plausible range says why"
        assert all(parameter.plausible(v) for v in parameter.grid), f"{name}: its grid lies in its plausible range"
        default = next(getattr(v.deviation, name) for v in VARIANTS if v.parameter == name)
        assert parameter.plausible(default), f"{name}: its default is plausible"
    assert variant("scaled_budget(2)").deviation.budget_scale == 2.0


def _halves(logp, behavior_logp, advantages, mask, *, tau):
    """Selection run on each half of the rows apart (two micro-batches), the loss right."""
    from m2po_oracle.core.loss import m2po_loss

    rows = logp.shape[0]
    keep = torch.zeros_like(mask)
    for part in (slice(0, rows // 2), slice(rows // 2, rows)):
        if mask[part].numel():
            keep[part] = m2po_loss(logp[part].detach(), behavior_logp[part], advantages[part], mask[part], tau=tau).keep
    return {"loss": _loss(keep, logp, behavior_logp, advantages, mask), "keep": keep}


def _per_row(logp, behavior_logp, advantages, mask, *, tau):
    d = (_zeroed(logp, mask) - _zeroed(behavior_logp, mask)).detach()
    keep = _select(d, advantages, mask, tau, per_row=True)
    return {"loss": _loss(keep, logp, behavior_logp, advantages, mask), "keep": keep}


@pytest.mark.parametrize("fn", [_halves, _per_row])
def test_scope_bugs_are_caught_within_50_examples_whatever_the_seed(fn):
    """The run's first examples rotate through the families (a stratified start): a seed
    whose free search draws no split-scope batch early no longer passes a scope bug."""
    late = {}
    for seed in range(1, 11):
        report = run_compare(fn, fn.__name__, examples=50, seed=seed, shrink=False, until_first_failure=True)
        if report.verdict != "divergent":
            late[seed] = report.verdict
    assert not late, f"{fn.__name__}: passed 50 examples on seeds {sorted(late)}"


def _clip_with_floors_and_float32_bound():
    from m2po_oracle.explain.deviations import combine

    return combine(["authors_release_clip", "clip_floors", "clip_bound_float32"])


def _observed(batch, dev, quirk: float = 1.0):
    """What a port with ``dev`` returns on ``batch`` (its loss times ``quirk``), and the checks it fails."""
    from dataclasses import replace

    from m2po_oracle.explain import evidence, variants
    from m2po_oracle.judge.equivalence import compare_to_oracle

    result = variants.m2po(batch, dev)
    result = replace(result, loss=result.loss * quirk)
    return evidence.Observation(batch, result, frozenset(m.check for m in compare_to_oracle(batch, result, "float64")))


def _early_batches(count: int):
    """Small log ratios: the budget's cap lies inside the floors, which decide the range."""
    import numpy as np

    from m2po_oracle.oracle.batch import Batch

    rng = np.random.default_rng(0)
    return [
        Batch(rng.normal(0, 0.3, (2, 6)) - 1.0, np.full((2, 6), -1.0), rng.choice([-1.0, 1.0], (2, 6)), np.ones((2, 6), bool), 0.02)
        for _ in range(count)
    ]


def _late_batches(count: int):
    """One row, A = +1, d = [0.125, x, 2.0] with x in (0.41, 0.5): the cap c^2 = x^2 - 1e-12
    lies beyond the 1.5 floor, and float32's exp of c rounded to float32 reaches over the
    token at the cap, which float64's range clips (the float32 bound decides its gradient)."""
    from dataclasses import replace

    import numpy as np

    from m2po_oracle.explain import variants
    from m2po_oracle.oracle.batch import Batch

    dev = _clip_with_floors_and_float32_bound()
    wide = replace(dev, clip_bound_float32=False)
    found = []
    for k in range(410, 500):
        logp = np.array([[-0.875, -1.0 + k / 1000, 1.0]])
        v = np.sort(((logp + 1.0) ** 2).ravel())
        tau = round((v[0] + 2 * v[1] + v.sum()) / 6, 2)  # S = 3 tau between g(1) and g(2): the cap is v_1's breakpoint
        batch = Batch(logp, np.full((1, 3), -1.0), np.ones((1, 3)), np.ones((1, 3), bool), tau)
        if variants.m2po(batch, dev).keep[0, 1] and not variants.m2po(batch, wide).keep[0, 1]:
            found.append(batch)
    assert len(found) >= count
    return found[:count]


def test_a_deviation_the_sample_never_shows_is_named_from_the_held_out_examples(monkeypatch):
    """The sample is the run's first examples; a float32 clip bound shows only on batches met
    later. The held-out failing examples the sample's explanation leaves unreproduced: half
    join the sample for a second search, and the name must hold on the other half."""
    from m2po_oracle.explain import diagnosis, evidence

    dev = _clip_with_floors_and_float32_bound()
    observations = [_observed(b, dev) for b in _early_batches(8) + _late_batches(6)]
    failed = tuple(dict.fromkeys(c for o in observations for c in sorted(o.failed)))
    examples = evidence.Examples(tuple(observations[:6]), failed, held_out=tuple(observations[6:]))
    d = diagnosis.diagnose(examples, evidence.Reading("float64"), divergent=True)
    assert {"authors_release_clip", "clip_floors", "clip_bound_float32"} <= set(d.components), d.summary
    assert not d.unexplained and all(s.explained == s.failing for s in d.shares.values()), d.summary
    held = d.shares["loss"].held_out
    assert held is not None and held.explained == held.failing >= 3, "it holds on the late examples it was not chosen on"
    # The planted bug: a search on the sample alone never sees the float32 bound, and its
    # float64 range contradicts the late examples' selection, which is Algorithm 1's.
    monkeypatch.setattr(diagnosis, "WIDEN_AT_LEAST", len(observations) + 1)
    alone = diagnosis.diagnose(examples, evidence.Reading("float64"), divergent=True)
    assert "clip_bound_float32" not in alone.components and {"loss", "selection.budget"} <= set(alone.unexplained), alone.summary


def test_a_second_search_fitted_to_the_examples_it_moved_in_leaves_the_first_standing():
    """Late failing examples of two kinds, alternating: rows of unequal length whose loss is
    divided by rows x padded length (names the vocabulary has; on the early, full rows it is
    N), then a loss off by a factor of its own (a quirk no name describes). The second search
    names the divisor from the half it moved in; the other half does not have it, so the
    sample's explanation and its held-out examples stand."""
    from dataclasses import replace

    import numpy as np

    from m2po_oracle.explain import diagnosis, evidence
    from m2po_oracle.explain.deviations import combine

    dev = _clip_with_floors_and_float32_bound()
    row_mean = combine(["authors_release_clip", "clip_floors", "clip_bound_float32", "seq_mean_token_sum_norm"])
    valid = np.array([[True] * 6, [True] * 2 + [False] * 4])
    ragged = [replace(b, valid=valid) for b in _early_batches(14)[8:]]
    late = [_observed(b, row_mean) if k % 2 == 0 else _observed(b, dev, quirk=1.0 + 0.37 * (k + 1) ** 1.5) for k, b in enumerate(ragged)]
    judge = evidence.Judge(
        [_observed(b, dev) for b in _early_batches(8)] + late, dtype="float64", compute_dtype=None, supplied=None, sample=6
    )
    names = [v.name for v in VARIANTS if v.name != "algorithm_1" and not v.is_behavioural]
    first = diagnosis.search(judge, names)
    left = diagnosis.unreproduced_held_out(judge, evidence.merge(first.components))
    assert left == list(range(8, 14)), "every late example is left unreproduced, the divisor's moved in"
    fitted = diagnosis.search(judge.widened(left[::2]), names).components
    assert {"padded_denominator", "seq_mean_token_sum_norm"} & set(fitted), f"the second search fits the moved half: {fitted}"
    wider, second = diagnosis.second_search(judge, first, names)
    assert wider is judge and second is first
