"""The clip family (algorithm.md §4) and the deviations real ports combine, as planted torch
controls (``call.planted``) and, where it exists, the NumPy variant (``variants.m2po``).

Golden cases in fixtures/golden/clip/ (a separate folder: test_golden.py's non-recursive
glob judges its cases against Algorithm 1, which these are not) carry their derivation by
hand. Every check here comes with a planted bug that makes it fail: a check that rejects
no wrong answer is not a check.
"""

from __future__ import annotations

import json
import math
import random
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, assume, find, given, settings
from hypothesis.errors import NoSuchExample

from m2po_oracle import strategies
from m2po_oracle.call import planted as torch_port
from m2po_oracle.call.planted import planted
from m2po_oracle.explain.deviations import DENOMINATOR_EPSILON, Deviation
from m2po_oracle.judge.contract import to_tensors
from m2po_oracle.oracle.batch import Batch

CLIP_GOLDEN = sorted((Path(__file__).parents[2] / "fixtures" / "golden" / "clip").glob("*.json"))
RTOL, ATOL = 1e-12, 1e-15
METRICS = ("m2_before", "m2_after", "masked_fraction", "trust_region_fraction", "cap_squared")
COUNTS = ("valid_count", "trust_region_count", "kept_trust_region_count")
# Searching for a batch that exposes a planted bug: detection only, no shrinking.
SEARCH = settings(max_examples=600, database=None, deadline=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck))


# --- helpers ------------------------------------------------------------------------------


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def deviation_of(knobs: dict[str, Any]) -> Deviation:
    knobs = dict(knobs)
    if knobs.get("clip_floors") is not None:
        knobs["clip_floors"] = tuple(knobs["clip_floors"])
    return Deviation(**knobs)


def run_planted(batch: Batch, dev: Deviation, dtype: str = "float64") -> dict[str, Any]:
    """planted on ``batch``: keep, loss, autograd gradient w.r.t. logp and every metric."""
    t = to_tensors(batch, dtype)
    raw = planted(t["logp"], t["behavior_logp"], t["advantages"], t["mask"], tau=batch.tau, deviation=dev)
    (grad,) = torch.autograd.grad(raw["loss"], t["logp"], allow_unused=True)
    grad = np.zeros(batch.shape) if grad is None else grad.detach().double().numpy()
    out = {k: v for k, v in raw.items() if k not in ("loss", "keep")}
    return {**out, "keep": raw["keep"].numpy().copy(), "loss": float(raw["loss"].detach().double()), "grad": grad}


def golden_mismatches(expected: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """What differs from a golden case's expected values (empty: it matches)."""
    problems = []
    keep = np.array(expected["keep"], dtype=bool)
    if not np.array_equal(np.asarray(got["keep"], dtype=bool), keep):
        problems.append(f"keep {np.asarray(got['keep']).astype(int).tolist()} != {keep.astype(int).tolist()}")
    if not math.isclose(got["loss"], expected["loss"], rel_tol=RTOL, abs_tol=ATOL):
        problems.append(f"loss {got['loss']!r} != {expected['loss']!r}")
    grad = np.asarray(got["grad"], dtype=float)
    want = np.array(expected["grad"], dtype=float)
    if grad.shape != want.shape or not np.allclose(grad, want, rtol=RTOL, atol=ATOL, equal_nan=False):
        problems.append(f"grad {grad.tolist()} != {want.tolist()}")
    for name in METRICS:
        if name in expected and got.get(name) is not None and not math.isclose(got[name], expected[name], rel_tol=RTOL, abs_tol=ATOL):
            problems.append(f"{name} {got[name]!r} != {expected[name]!r}")
        elif name in expected and got.get(name) is None and name != "cap_squared":
            problems.append(f"{name} missing")
    if "cap_squared" in expected and "cap_squared" in got and got["cap_squared"] is None:
        problems.append("cap_squared None (unconstrained) but the case is constrained")
    for name in COUNTS:
        if name in expected and got.get(name) != expected[name]:
            problems.append(f"{name} {got.get(name)!r} != {expected[name]!r}")
    return problems


# --- golden cases -------------------------------------------------------------------------


def test_there_are_clip_golden_cases_with_derivations():
    assert len(CLIP_GOLDEN) >= 4
    kinds = set()
    for path in CLIP_GOLDEN:
        case = load(path)
        assert path.stem.startswith("clip_") and case["derivation"], f"{path.name}: a golden case needs its derivation"
        kinds.add(case["deviation"]["selection_kind"])
        assert {"keep", "loss", "grad", "m2_before", "m2_after", "cap_squared"} <= set(case["expected"]), path.name
    assert kinds == {"clip_below", "clip_exact"}


def test_clip_cases_are_outside_the_algorithm_1_golden_glob():
    """test_golden.py globs fixtures/golden/*.json (not recursive) and judges against Algorithm 1."""
    top = {p.resolve() for p in (Path(__file__).parents[2] / "fixtures" / "golden").glob("*.json")}
    assert not top & {p.resolve() for p in CLIP_GOLDEN}


@pytest.mark.parametrize("path", CLIP_GOLDEN, ids=lambda p: p.stem)
def test_planted_matches_the_golden_case(path):
    case = load(path)
    got = run_planted(Batch.from_dict(case["batch"]), deviation_of(case["deviation"]))
    assert not golden_mismatches(case["expected"], got), f"{path.stem}: {golden_mismatches(case['expected'], got)}"


def _variant_or_skip(batch: Batch, dev: Deviation):
    """The NumPy variant's result; skip (only) if it does not yet realise these knobs."""
    from m2po_oracle.explain import variants

    try:
        return variants.m2po(batch, dev)
    except NotImplementedError as error:
        pytest.skip(f"variants.m2po does not yet realise {dev}: {error}")


@pytest.mark.parametrize("path", CLIP_GOLDEN, ids=lambda p: p.stem)
def test_numpy_variant_matches_the_golden_case(path):
    """Second, independent realisation (another engineer's NumPy variant): keep, loss,
    gradient and m2_after must equal the hand derivation."""
    case = load(path)
    expected = case["expected"]
    result = _variant_or_skip(Batch.from_dict(case["batch"]), deviation_of(case["deviation"]))
    np.testing.assert_array_equal(result.keep, np.array(expected["keep"], dtype=bool), err_msg=f"{path.stem}: keep")
    assert result.loss == pytest.approx(expected["loss"], rel=RTOL, abs=ATOL), f"{path.stem}: loss"
    np.testing.assert_allclose(result.grad, np.array(expected["grad"]), rtol=RTOL, atol=ATOL, err_msg=f"{path.stem}: grad")
    assert result.m2_after == pytest.approx(expected["m2_after"], rel=RTOL, abs=ATOL), f"{path.stem}: m2_after"


# --- planted bugs the golden check must reject ---------------------------------------------


def _swap_kind(dev: Deviation) -> Deviation:
    return replace(dev, selection_kind={"clip_below": "clip_exact", "clip_exact": "clip_below"}[dev.selection_kind])


def _with(**knobs) -> Callable[[Deviation], Deviation]:
    return lambda dev: replace(dev, **knobs)


def _gradient_not_zeroed(batch: Batch, dev: Deviation, monkeypatch) -> dict[str, Any]:
    """Beyond-the-cap tokens keep their value AND the unclipped gradient -A r / N."""
    got = run_planted(batch, dev)
    d = np.where(batch.valid, batch.logp - batch.behavior_logp, 0.0)
    a = np.where(batch.valid, batch.advantages, 0.0)
    n = batch.valid.sum() + (DENOMINATOR_EPSILON if dev.denominator == "valid_epsilon" else 0.0)
    got["grad"] = np.where(batch.valid, -a * np.exp(d) / n, 0.0)
    got["keep"] = batch.valid.copy()
    return got


def _patched(name: str, value) -> Callable[..., dict[str, Any]]:
    def run(batch: Batch, dev: Deviation, monkeypatch) -> dict[str, Any]:
        monkeypatch.setattr(torch_port, name, value)
        return run_planted(batch, dev)

    return run


def _deviated(change: Callable[[Deviation], Deviation]) -> Callable[..., dict[str, Any]]:
    return lambda batch, dev, monkeypatch: run_planted(batch, change(dev))


def _cap_at_breakpoint_above(values: torch.Tensor, tau: float, kind: str) -> torch.Tensor:
    """A wrong cap: the breakpoint ABOVE the exact cap (capped mean over the budget)."""
    n = values.numel()
    below = torch.cat([torch.zeros(1, dtype=values.dtype), torch.cumsum(values, 0)])
    g = below[:n] + (n - torch.arange(n, dtype=values.dtype)) * values
    k = int((g <= tau * n).sum())
    return values[min(k, n - 1)]


#: (bug, how to compute with it, the golden cases it must be rejected on).
PLANTED_BUGS = {
    "wrong cap formula (kinds swapped)": (
        _deviated(_swap_kind),
        [
            "clip_below_clips_more_than_algorithm_1",
            "clip_exact_water_filling",
            "clip_floors_widen_the_range",
            "clip_release_column0_sign_epsilon",
        ],
    ),
    "breakpoint without the 1e-12 offset": (
        _patched("CLIP_BELOW_OFFSET", 0.0),
        ["clip_below_clips_more_than_algorithm_1", "clip_release_column0_sign_epsilon"],
    ),
    "cap at the breakpoint above": (_patched("cap_squared", _cap_at_breakpoint_above), [p.stem for p in CLIP_GOLDEN]),
    "Algorithm 1's mask instead of the clip": (_deviated(_with(selection_kind="mask", clip_floors=None)), [p.stem for p in CLIP_GOLDEN]),
    "floors ignored": (_deviated(_with(clip_floors=None)), ["clip_floors_widen_the_range"]),
    "floors applied to every case": (
        _deviated(_with(clip_floors=(0.3, 0.5))),
        [
            "clip_below_clips_more_than_algorithm_1",
            "clip_exact_water_filling",
            "clip_exact_zero_budget",
            "clip_release_column0_sign_epsilon",
        ],
    ),
    "per-token sign instead of column 0": (_deviated(_with(candidates="trust_region")), ["clip_release_column0_sign_epsilon"]),
    "denominator N without the epsilon": (_deviated(_with(denominator="valid")), ["clip_release_column0_sign_epsilon"]),
    "beyond-the-cap tokens keep their gradient": (_gradient_not_zeroed, [p.stem for p in CLIP_GOLDEN]),
}


@pytest.mark.parametrize("bug", PLANTED_BUGS)
def test_the_golden_check_rejects_a_planted_bug(bug, monkeypatch):
    compute, rejected_on = PLANTED_BUGS[bug]
    assert rejected_on
    for path in CLIP_GOLDEN:
        if path.stem not in rejected_on:
            continue
        case = load(path)
        with monkeypatch.context() as patch:
            got = compute(Batch.from_dict(case["batch"]), deviation_of(case["deviation"]), patch)
        assert golden_mismatches(case["expected"], got), f"planted bug {bug!r} passes golden case {path.stem}"


def test_every_golden_case_rejects_some_planted_bug():
    for path in CLIP_GOLDEN:
        assert any(path.stem in cases for _, cases in PLANTED_BUGS.values()), path.stem


# --- Hypothesis: the capped mean -----------------------------------------------------------


def capped_mean_problem(batch: Batch, got: dict[str, Any], kind: str) -> str | None:
    """clip_exact: a constrained budget gives capped mean == tau; clip_below: <= tau; and
    an unconstrained one has M2_now <= tau + 1e-12 with the capped mean equal to M2_now."""
    tau, after, before = batch.tau, got["m2_after"], got["m2_before"]
    if got["cap_squared"] is None:
        if before > tau + 1e-12 * (1 + 1e-9):
            return f"unconstrained, but M2_now {before!r} > tau {tau!r} + 1e-12"
        return None if after == before else f"unconstrained: m2_after {after!r} != M2_now {before!r}"
    if kind == "clip_exact" and not math.isclose(after, tau, rel_tol=1e-9, abs_tol=1e-15):
        return f"clip_exact: capped mean {after!r} != tau {tau!r}"
    if kind == "clip_below" and after > tau * (1 + 1e-12) + 1e-15:
        return f"clip_below: capped mean {after!r} > tau {tau!r}"
    return None


@pytest.mark.parametrize("kind", ["clip_exact", "clip_below"])
@given(batch=strategies.batches())
def test_the_capped_mean_meets_the_budget(kind, batch):
    got = run_planted(batch, Deviation(selection_kind=kind))
    problem = capped_mean_problem(batch, got, kind)
    assert problem is None, f"{problem}\n{batch.describe()}"


def _search(property_fails: Callable[[Batch], bool]) -> Batch | None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return find(strategies.batches(), property_fails, settings=SEARCH, random=random.Random(0))
        except NoSuchExample:
            return None


@pytest.mark.parametrize("kind, bug", [("clip_exact", "breakpoint below"), ("clip_below", "breakpoint above")])
def test_the_capped_mean_check_catches_a_planted_cap(kind, bug, monkeypatch):
    """clip_exact computed with the release's cap (mean under tau), clip_below with the
    breakpoint above the exact cap (mean over tau): the Hypothesis property must fail."""
    original = torch_port.cap_squared
    wrong = (lambda values, tau, _kind: original(values, tau, "clip_below")) if bug == "breakpoint below" else _cap_at_breakpoint_above
    monkeypatch.setattr(torch_port, "cap_squared", wrong)
    found = _search(lambda batch: capped_mean_problem(batch, run_planted(batch, Deviation(selection_kind=kind)), kind) is not None)
    assert found is not None, f"{kind} with the cap at the {bug} escaped the capped-mean property"


# --- Hypothesis: the torch control against the NumPy variant (where it exists) ---------------


def _near_the_cap(batch: Batch, got: dict[str, Any]) -> bool:
    """A token whose d^2 lies within rounding of the cap: r against e^c is decided by the
    last ulp of exp, on which two realisations may legitimately differ."""
    if got["cap_squared"] is None:
        return False
    with np.errstate(invalid="ignore"):
        d = np.where(batch.valid, batch.logp - batch.behavior_logp, 0.0)
    c2 = got["cap_squared"]
    return bool(np.any(batch.valid & np.isclose(d * d, c2, rtol=1e-9, atol=1e-300)))


@pytest.mark.parametrize(
    "knobs",
    [
        {"selection_kind": "clip_below"},
        {"selection_kind": "clip_exact"},
        {"selection_kind": "clip_below", "clip_floors": (0.3, 0.5)},
        {"selection_kind": "clip_below", "candidates": "column0_sign", "denominator": "valid_epsilon"},
    ],
    ids=lambda k: "-".join(f"{v}" for v in k.values()),
)
@given(batch=strategies.batches())
def test_planted_clip_agrees_with_the_numpy_variant(knobs, batch):
    """The two realisations of each clip deviation agree at the diagnosis tolerance
    (float64: rtol 1e-10) on keep, loss, gradient and m2_after."""
    dev = Deviation(**knobs)
    got = run_planted(batch, dev)
    assume(not _near_the_cap(batch, got))
    result = _variant_or_skip(batch, dev)
    assert np.array_equal(result.keep, got["keep"]), (
        f"keep: variant {result.keep.astype(int).tolist()} planted {got['keep'].astype(int).tolist()}\n{batch.describe()}"
    )
    scale = float(np.sum(np.abs(result.grad)))
    assert abs(got["loss"] - result.loss) <= 1e-10 * max(abs(result.loss), scale) + 1e-300, f"loss {got['loss']!r} vs {result.loss!r}"
    np.testing.assert_allclose(got["grad"], result.grad, rtol=1e-10, atol=1e-10 * float(np.max(np.abs(result.grad), initial=0.0)) + 1e-300)
    assert got["m2_after"] == pytest.approx(result.m2_after, rel=1e-10, abs=1e-300)


# --- the other knobs of algorithm.md §4 -------------------------------------------------------


def _batch(d, advantages, valid, tau, behavior=None) -> Batch:
    d = np.array(d, dtype=float)
    behavior = np.full(d.shape, -1.0) if behavior is None else np.array(behavior, dtype=float)
    return Batch(behavior + d, behavior, np.array(advantages, dtype=float), np.array(valid, dtype=bool), float(tau))


def hard_clamp_problems(got: dict[str, Any]) -> list[str]:
    """Batch CLAMP: d = [25, -25, 19] with A = [-1, +1, -1] (no candidates), N = 3: values
    exp(+-20) A and exp(19) A; gradient 0 beyond the clamp, -A e^19 / 3 inside."""
    problems = []
    want_loss = -(-math.exp(20) + math.exp(-20) - math.exp(19)) / 3
    if not math.isclose(got["loss"], want_loss, rel_tol=1e-12):
        problems.append(f"loss {got['loss']!r} != {want_loss!r}")
    want_grad = [[0.0, 0.0, math.exp(19) / 3]]
    if not np.allclose(got["grad"], want_grad, rtol=1e-12, atol=0.0):
        problems.append(f"grad {got['grad'].tolist()} != {want_grad}")
    return problems


CLAMP = _batch([[25.0, -25.0, 19.0]], [[-1.0, 1.0, -1.0]], [[1, 1, 1]], 0.04)


def test_hard_clamp_zeroes_the_gradient_beyond_it():
    assert not hard_clamp_problems(run_planted(CLAMP, Deviation(clamp_log_ratio=20.0, hard_clamp=True)))


def test_hard_clamp_check_rejects_the_straight_through_clamp():
    assert hard_clamp_problems(run_planted(CLAMP, Deviation(clamp_log_ratio=20.0)))  # identity gradient beyond +-20
    assert hard_clamp_problems(run_planted(CLAMP, Deviation()))  # no clamp at all


def test_hard_clamp_also_clamps_the_selection():
    # One candidate d = 30 (A = +1) with tau = 400 = 20^2: the clamped M2 is 400 <= tau, so it is kept.
    batch = _batch([[30.0]], [[1.0]], [[1]], 400.0)
    assert run_planted(batch, Deviation(clamp_log_ratio=20.0, hard_clamp=True))["keep"].tolist() == [[True]]
    assert run_planted(batch, Deviation())["keep"].tolist() == [[False]]


def column0_problems(got_nan: dict[str, Any], got_negative: dict[str, Any]) -> list[str]:
    """Row valid [0, 1, 1], d = [pad, 0.5, 0.25], A = [pad, 1, 1], tau = 0. Column 0 holding
    NaN: NaN compares False, no candidate, nothing masked. Holding -1: the sign is negative
    and both d > 0, no candidate either. Per-token (or first-valid-token) sign masks both."""
    problems = []
    for label, got in (("NaN", got_nan), ("-1", got_negative)):
        if got["keep"].tolist() != [[False, True, True]]:
            problems.append(f"column 0 = {label}: keep {got['keep'].astype(int).tolist()}")
    return problems


def _column0_batches() -> tuple[Batch, Batch]:
    logp = np.array([[0.0, -0.5, -0.75]])
    behavior = np.array([[0.0, -1.0, -1.0]])
    valid = np.array([[False, True, True]])
    make = lambda a0: Batch(logp, behavior, np.array([[a0, 1.0, 1.0]]), valid, 0.0)  # noqa: E731
    return make(math.nan), make(-1.0)


def test_column0_sign_reads_column_0_even_when_it_is_padding():
    nan_batch, negative_batch = _column0_batches()
    dev = Deviation(candidates="column0_sign")
    assert not column0_problems(run_planted(nan_batch, dev), run_planted(negative_batch, dev))
    positive = Batch(negative_batch.logp, negative_batch.behavior_logp, np.array([[1.0, 1.0, 1.0]]), negative_batch.valid, 0.0)
    assert run_planted(positive, dev)["keep"].tolist() == [[False, False, False]]  # +1 in column 0: both are candidates


@pytest.mark.parametrize("candidates", ["trust_region", "first_token_sign"])
def test_column0_check_rejects_other_sign_sources(candidates):
    nan_batch, negative_batch = _column0_batches()
    dev = Deviation(candidates=candidates)
    assert column0_problems(run_planted(nan_batch, dev), run_planted(negative_batch, dev))


def epsilon_problems(batch: Batch, got: dict[str, Any]) -> list[str]:
    """loss = -sum keep e^d A / (N + 1e-8); an all-padding batch gives loss 0, no NaN."""
    d = np.where(batch.valid, batch.logp - batch.behavior_logp, 0.0)
    a = np.where(batch.valid, batch.advantages, 0.0)
    want = -math.fsum(np.where(got["keep"], np.exp(d) * a, 0.0).ravel()) / (batch.valid.sum() + DENOMINATOR_EPSILON)
    return [] if math.isclose(got["loss"], want, rel_tol=1e-13, abs_tol=0.0) else [f"loss {got['loss']!r} != {want!r}"]


EPSILON = _batch([[0.125, -0.25, 0.5]], [[1.0, 1.0, -1.0]], [[1, 1, 1]], 0.04)


def test_valid_epsilon_denominator():
    assert not epsilon_problems(EPSILON, run_planted(EPSILON, Deviation(denominator="valid_epsilon")))
    empty = _batch([[0.0, 0.0]], [[1.0, 1.0]], [[0, 0]], 0.04).with_padding(math.nan)
    got = run_planted(empty, Deviation(denominator="valid_epsilon"))
    assert got["loss"] == 0.0 and not np.isnan(got["grad"]).any()


def test_epsilon_check_rejects_the_plain_denominator():
    assert epsilon_problems(EPSILON, run_planted(EPSILON, Deviation()))  # N: 1.4e-9 relative off


def _is_float32(x: float) -> bool:
    return float(np.float32(x)) == x


# d = 0.2 - 1e-10 (behavior 0): in float64 M2 = 0.03999999996 <= 0.04 keeps the token; in
# float32 d rounds to 0.2f and M2 = 0.0400000012 > float32(0.04) = 0.0399999991 masks it.
FLOAT32_EDGE = Batch(np.array([[0.2 - 1e-10, 0.1]]), np.zeros((1, 2)), np.array([[1.0, -1.0]]), np.array([[True, True]]), 0.04)


def float32_selection_problems(got: dict[str, Any]) -> list[str]:
    return [] if got["keep"].tolist() == [[False, True]] else [f"keep {got['keep'].astype(int).tolist()}: the float32 decision masks (0,0)"]


def test_float32_selection_decides_in_float32():
    assert not float32_selection_problems(run_planted(FLOAT32_EDGE, Deviation(selection_dtype="float32")))
    assert float32_selection_problems(run_planted(FLOAT32_EDGE, Deviation()))  # float64 keeps it


def float32_metrics_problems(got: dict[str, Any]) -> list[str]:
    """Metrics are float32 values: m2_before of d = 0.2 - 1e-10 is float32(0.2)^2 rounded to
    float32, not the float64 0.03999999996 (the planted float64 metrics)."""
    problems = [
        f"{name} {got[name]!r} is not a float32 value"
        for name in ("m2_before", "m2_after", "masked_fraction", "trust_region_fraction")
        if not _is_float32(got[name])
    ]
    want = float(np.float32(0.2) * np.float32(0.2))
    if got["m2_before"] != want:
        problems.append(f"m2_before {got['m2_before']!r} != {want!r}")
    return problems


def test_float32_metrics_are_float32_values():
    assert not float32_metrics_problems(run_planted(FLOAT32_EDGE, Deviation(metrics_dtype="float32")))
    assert float32_metrics_problems(run_planted(FLOAT32_EDGE, Deviation()))


def test_float32_metrics_on_the_clip_kinds():
    case = load(CLIP_GOLDEN[0])
    got = run_planted(Batch.from_dict(case["batch"]), Deviation(selection_kind="clip_below", metrics_dtype="float32"))
    assert all(_is_float32(got[name]) for name in ("m2_before", "m2_after", "masked_fraction", "trust_region_fraction"))
    assert got["m2_after"] == pytest.approx(case["expected"]["m2_after"], rel=1e-6)


@pytest.mark.parametrize(
    "knobs",
    [
        {"selection_kind": "clip_below"},
        {"selection_kind": "clip_exact"},
        {"selection_kind": "clip_below", "clip_floors": (0.3, 0.5)},
        {"selection_kind": "clip_exact", "denominator": "valid_epsilon"},
        {"selection_kind": "clip_exact", "clamp_log_ratio": 20.0, "hard_clamp": True},
        {"selection_kind": "clip_below", "selection_dtype": "float32", "metrics_dtype": "float32"},
    ],
    ids=lambda k: "-".join(f"{v}" for v in k.values()),
)
@given(batch=strategies.batches())
def test_clip_kinds_are_immune_to_padding(knobs, batch):
    """NaN/inf padding reaches neither the loss nor the gradient (same mask, loss, gradient
    for every padding fill). Not for ``column0_sign``: it reads column 0 even where that is
    padding, by design (the release), so a padding fill there changes its candidates."""
    dev = Deviation(**knobs)
    reference = run_planted(batch.with_padding(0.0), dev)
    for fill in (math.nan, math.inf, -math.inf):
        got = run_planted(batch.with_padding(fill), dev)
        assert np.array_equal(got["keep"], reference["keep"]), f"padding {fill}: keep changed\n{batch.describe()}"
        assert np.array_equal(got["grad"], reference["grad"]), f"padding {fill}: gradient changed\n{batch.describe()}"
        assert got["loss"] == reference["loss"], f"padding {fill}: loss {got['loss']!r} != {reference['loss']!r}"


def test_padding_immunity_check_rejects_the_multiplying_port():
    case = load(CLIP_GOLDEN[0])
    got = run_planted(Batch.from_dict(case["batch"]), Deviation(selection_kind="clip_below", zero_padding_by_multiplying=True))
    assert math.isnan(got["loss"]) or np.isnan(got["grad"]).any()


def test_clip_kinds_refuse_mask_only_knobs_and_floors_need_a_clip():
    case = load(CLIP_GOLDEN[0])
    batch = Batch.from_dict(case["batch"])
    with pytest.raises(ValueError, match="mask selection"):
        run_planted(batch, Deviation(selection_kind="clip_exact", scope_rows=1))
    with pytest.raises(ValueError, match="clip_floors"):
        run_planted(batch, Deviation(clip_floors=(0.3, 0.5)))
