"""The production torch core against the oracle, its gradient, and its fail-closed rules."""

from __future__ import annotations

import math
from unittest import mock

import numpy as np
import pytest
import torch
from core_passes import PASSES, core_passes  # beside this file
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from m2po_oracle import oracle, strategies
from m2po_oracle.core.loss import m2po_loss
from m2po_oracle.judge.battery import assert_battery_passes
from m2po_oracle.judge.contract import rounded_batch, to_tensors
from m2po_oracle.judge.equivalence import selection_bounds
from m2po_oracle.oracle.batch import Batch

FAMILIES = {
    "grpo": strategies.grpo_batches(),
    "token_advantages": strategies.token_advantage_batches(),
    "dyadic": strategies.dyadic_batches(),
    "ties": strategies.tie_batches(),
    "extreme": strategies.extreme_batches(),
    "degenerate": strategies.degenerate_batches(),
}


@pytest.mark.parametrize("family", FAMILIES)
@given(data=st.data())
def test_core_equals_oracle_float64(family, data):
    batch = data.draw(FAMILIES[family], label="batch")
    assert_battery_passes(m2po_loss, batch, impl="core", dtype="float64")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@given(batch=strategies.batches())
def test_core_equals_oracle_reduced_precision(dtype, batch):
    # The core selects in float64 on the values it received, so its selection is held to
    # float64 exactness; loss and gradient use the dtype's tolerances.
    if dtype == "float16":
        # float16 overflows above 65504: keep to batches whose valid values and exp(d) fit.
        seen = rounded_batch(batch, dtype)
        finite = np.isfinite(seen.logp[seen.valid]).all() and np.isfinite(seen.advantages[seen.valid]).all()
        with np.errstate(invalid="ignore"):
            assume(finite and np.abs(seen.logp - seen.behavior_logp, where=seen.valid, out=np.zeros(seen.shape)).max() < 10)
    assert_battery_passes(m2po_loss, batch, impl="core", dtype=dtype, compute_dtype="float64")


def _boundary_margin(batch: Batch) -> float:
    """Distance of the selection from any decision a small perturbation of logp could flip."""
    bounds = selection_bounds(batch)
    d = oracle.log_ratio(batch.logp, batch.behavior_logp, batch.valid)
    margins = [np.abs(d[batch.valid]).min(initial=math.inf)]
    k = bounds.k_min
    if k < bounds.prefix_means.size:
        margins.append(abs(bounds.prefix_means[k] - batch.tau))
    if k:
        margins.append(abs(bounds.prefix_means[k - 1] - batch.tau))
    if 0 < k < bounds.sorted_m2.size:
        margins.append(bounds.sorted_m2[k] - bounds.sorted_m2[k - 1])
    return float(min(margins))


@st.composite
def _batches_off_the_boundary(draw):
    """|d| and |A| bounded away from 0, so gradcheck's perturbation cannot change T."""
    shape = (draw(st.integers(1, 3)), draw(st.integers(1, 5)))
    magnitude = hnp.arrays(np.float64, shape, elements=st.floats(0.02, 0.8))
    signs = hnp.arrays(np.float64, shape, elements=st.sampled_from((-1.0, 1.0)))
    d = draw(magnitude) * draw(signs)
    advantages = draw(hnp.arrays(np.float64, shape, elements=st.floats(0.5, 2.0))) * draw(signs)
    behavior = draw(hnp.arrays(np.float64, shape, elements=st.floats(-4.0, -0.1)))
    return Batch(behavior + d, behavior, advantages, np.ones(shape, bool), draw(st.floats(0.0, 0.3)))


@given(_batches_off_the_boundary())
def test_gradcheck_away_from_the_selection_boundary(batch):
    assume(_boundary_margin(batch) > 1e-4)
    tensors = to_tensors(batch, "float64")
    behavior, advantages, mask = tensors["behavior_logp"], tensors["advantages"], tensors["mask"]
    logp = torch.where(mask, tensors["logp"].detach(), torch.zeros(())).requires_grad_(True)

    def loss(x):
        return m2po_loss(x, behavior, advantages, mask, tau=batch.tau).loss

    assert torch.autograd.gradcheck(loss, (logp,), eps=1e-7, atol=1e-7, rtol=1e-5)


@given(strategies.batches())
def test_only_kept_tokens_carry_gradient_and_padding_never_reaches_it(batch):
    tensors = to_tensors(batch.with_padding(float("nan")), "float32")
    result = m2po_loss(**{k: v for k, v in tensors.items()}, tau=batch.tau)
    (grad,) = torch.autograd.grad(result.loss, tensors["logp"], allow_unused=False)
    assert torch.isfinite(grad).all(), f"non-finite gradient at {torch.nonzero(~torch.isfinite(grad))[:3].tolist()}"
    assert torch.all(grad[~result.keep] == 0), "a masked or padding token carries gradient"
    assert result.loss.dim() == 0 and result.keep.dtype == torch.bool and result.keep.shape == tensors["logp"].shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_spec_worked_example(dtype):
    logp = torch.tensor([[0.1, 0.3], [0.2, 0.4]], dtype=dtype, requires_grad=True)
    result = m2po_loss(logp, torch.zeros(2, 2, dtype=dtype), torch.ones(2, 2, dtype=dtype), torch.ones(2, 2, dtype=torch.bool), tau=0.04)
    result.loss.backward()
    assert result.keep.tolist() == [[True, False], [True, False]]
    if dtype == torch.float32:
        # The worked example's figures (algorithm.md §1) are float32 results printed to 8 decimals.
        assert np.round(logp.grad.double().numpy(), 8).tolist() == [[-0.27629274, 0.0], [-0.30535069, 0.0]]
    else:
        # Exact: -e^0.1/4 = -0.2762927295..., 1e-8 from the worked example's float32 figure.
        assert logp.grad.tolist() == [[-math.exp(0.1) / 4, 0.0], [-math.exp(0.2) / 4, 0.0]]
    assert (result.valid_count.item(), result.trust_region_count.item(), result.kept_trust_region_count.item()) == (4, 4, 2)
    assert math.isclose(result.m2_before.item(), 0.075, rel_tol=1e-6) and math.isclose(result.m2_after.item(), 0.025, rel_tol=1e-6)
    assert result.masked_fraction.item() == 0.5


def _inputs(**overrides):
    base = {
        "logp": torch.tensor([[-0.5, -1.0]], requires_grad=True),
        "behavior_logp": torch.tensor([[-0.6, -1.0]]),
        "advantages": torch.tensor([[1.0, -1.0]]),
        "mask": torch.tensor([[True, True]]),
    }
    tau = overrides.pop("tau", 0.04)
    base.update(overrides)
    return base, tau


FAIL_CLOSED = {
    "behavior_logp missing": ({"behavior_logp": None}, "behavior_logp: required"),
    "shape mismatch": ({"advantages": torch.ones(1, 3)}, "advantages: expected shape (1, 2)"),
    "mask not boolean": ({"mask": torch.ones(1, 2)}, "mask: expected dtype torch.bool"),
    "mask as int": ({"mask": torch.ones(1, 2, dtype=torch.int64)}, "mask: expected dtype torch.bool"),
    "logp not a tensor": ({"logp": [[-0.5, -1.0]]}, "logp: expected a torch.Tensor"),
    "integer advantages": ({"advantages": torch.ones(1, 2, dtype=torch.int64)}, "advantages: expected a floating dtype"),
    "nan logp on a valid token": ({"logp": torch.tensor([[float("nan"), -1.0]])}, "logp: expected finite values on valid tokens"),
    "inf behavior_logp on a valid token": (
        {"behavior_logp": torch.tensor([[-0.6, float("-inf")]])},
        "behavior_logp: expected finite values on valid tokens",
    ),
    "nan advantage on a valid token": (
        {"advantages": torch.tensor([[1.0, float("nan")]])},
        "advantages: expected finite values on valid tokens",
    ),
    "tau negative": ({"tau": -0.1}, "tau: expected a finite Python number >= 0"),
    "tau nan": ({"tau": float("nan")}, "tau: expected a finite Python number >= 0"),
    "tau inf": ({"tau": float("inf")}, "tau: expected a finite Python number >= 0"),
    "tau a tensor": ({"tau": torch.tensor(0.04)}, "tau: expected a finite Python number >= 0"),
    "tau a bool": ({"tau": True}, "tau: expected a finite Python number >= 0"),
}
# The meta device stands in for a second device, so this runs without a GPU.
FAIL_CLOSED["device mismatch"] = (
    {"advantages": torch.empty(1, 2, device="meta")},
    "advantages: expected device cpu (the device of logp), got meta",
)


@pytest.mark.parametrize("case", FAIL_CLOSED)
def test_fails_closed_with_an_error_naming_the_argument(case):
    overrides, message = FAIL_CLOSED[case]
    inputs, tau = _inputs(**dict(overrides))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        m2po_loss(**inputs, tau=tau)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=str)
@pytest.mark.parametrize("argument", ["logp", "behavior_logp", "advantages"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_a_large_batch_fails_closed_too(argument, value, dtype):
    """Above SMALL tokens the verdict comes from the first level's checksum (d + 0 * A over
    valid tokens, chunk by chunk): one non-finite value on one valid token in the last
    chunk still raises, naming the argument; the same values on padding do not."""
    generator = torch.Generator().manual_seed(0)
    shape = (8, 1200)  # above SMALL, and three CPU chunks of 4096
    behavior = -torch.empty(shape).exponential_(0.5, generator=generator)
    inputs = {
        "logp": (behavior + 0.3 * torch.randn(shape, generator=generator)).to(dtype),
        "behavior_logp": behavior.to(dtype),
        "advantages": torch.where(torch.rand(shape, generator=generator) < 0.5, 1.0, -1.0).to(dtype),
        "mask": torch.ones(shape, dtype=torch.bool),
    }
    inputs["mask"][-1, -1] = False
    from m2po_oracle.core import scratch

    with mock.patch.object(scratch, "CPU_CHUNK", 4096):
        padded = dict(inputs, **{argument: inputs[argument].clone()})
        padded[argument][-1, -1] = value
        assert torch.isfinite(m2po_loss(**padded, tau=0.04).loss)
        invalid = dict(inputs, **{argument: inputs[argument].clone()})
        invalid[argument][-1, -2] = value
        with pytest.raises(
            ValueError, match=rf"{argument}: expected finite values on valid tokens \(mask True\), got {value} at index \(7, 1198\)"
        ):
            m2po_loss(**invalid, tau=0.04)


def test_nan_on_padding_is_accepted():
    inputs, tau = _inputs(logp=torch.tensor([[-0.5, float("nan")]], requires_grad=True), mask=torch.tensor([[True, False]]))
    assert torch.isfinite(m2po_loss(**inputs, tau=tau).loss)


def test_core_never_mutates_its_inputs():
    inputs, tau = _inputs()
    before = {k: v.detach().clone() for k, v in inputs.items()}
    m2po_loss(**inputs, tau=tau)
    for name, value in inputs.items():
        assert torch.equal(value.detach(), before[name]), f"{name} was modified"


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_core_on_cuda_equals_oracle_at_one_million_tokens(dtype):
    batch = strategies.random_grpo_batch(np.random.default_rng(0), rows=1024, length=1024, staleness=0.3)
    assert_battery_passes(m2po_loss, batch, impl="core", dtype=dtype, compute_dtype="float64", device="cuda")


def test_float16_gradient_underflow_is_within_tolerance():
    # Found by the thorough profile: -(1/2) * 6e-8 underflows to -0.0 in float16.
    batch = Batch(
        np.array([[-1.3598638079378191, -2.0391942029317294]]),
        np.array([[-1.3598638079378191, -2.0391942029317294]]),
        np.array([[5.960464477539063e-08, 5.960464477539063e-08]]),
        np.ones((1, 2), bool),
        0.04,
    )
    assert_battery_passes(m2po_loss, batch, impl="core", dtype="float16", compute_dtype="float64")


def _forward_and_gradient(batch: Batch, dtype: str):
    tensors = to_tensors(batch.with_padding(float("nan")), dtype)
    result = m2po_loss(**tensors, tau=batch.tau)
    (grad,) = torch.autograd.grad(result.loss, tensors["logp"])
    return result, grad


@pytest.mark.parametrize("passes", PASSES)
@pytest.mark.parametrize("chunk", [1, 5, 64])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@given(batch=strategies.batches())
def test_chunk_by_chunk_the_forward_is_the_one_pass_forward(chunk, dtype, passes, batch):
    """On CPU the first level and the loss run chunk by chunk (core.scratch.CPU_CHUNK tokens):
    whatever the chunk, the selection and its metrics are the one-pass ones bit for bit,
    the gradient too; the loss adds the chunks' sums, so it may round differently."""
    # Every batch through the first level; the chunk is read where the scratch buffers are sized.
    from m2po_oracle.core import fast_selection, scratch

    with mock.patch.object(fast_selection, "SMALL", 0), core_passes(passes):
        with mock.patch.object(scratch, "CPU_CHUNK", 1 << 30):
            whole, whole_grad = _forward_and_gradient(batch, dtype)
        with mock.patch.object(scratch, "CPU_CHUNK", chunk):
            chunked, chunked_grad = _forward_and_gradient(batch, dtype)
    for name in (
        "keep",
        "valid_count",
        "trust_region_count",
        "kept_trust_region_count",
        "m2_before",
        "m2_after",
        "masked_fraction",
        "trust_region_fraction",
    ):
        assert torch.equal(getattr(chunked, name), getattr(whole, name)), (
            f"{name}: {getattr(chunked, name)} chunked by {chunk}, {getattr(whole, name)} in one pass"
        )
    assert torch.equal(chunked_grad, whole_grad)
    loss, whole_loss = float(chunked.loss.detach()), float(whole.loss.detach())
    if not math.isfinite(whole_loss):  # exp overflowed: the same infinity either way
        assert loss == whole_loss
        return
    scale = float(torch.abs(whole_grad).sum()) + 1e-300  # sum of |loss terms| / N
    assert abs(loss - whole_loss) <= (1e-12 if dtype == "float64" else 1e-5) * scale


@pytest.mark.parametrize("passes", PASSES)
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@given(batch=strategies.batches())
def test_the_hand_written_loss_is_autograd_s_to_the_last_bit(dtype, passes, batch):
    """loss_from_selection's forward and backward are written by hand (bit masks, one
    pass per chunk); autograd on the plain expression must give the same loss and the
    same gradient, bit for bit, with NaN on padding."""
    from m2po_oracle.core.loss import loss_from_selection, select_tokens

    tensors = to_tensors(batch.with_padding(float("nan")), dtype)
    logp, behavior, advantages, mask = (tensors[k] for k in ("logp", "behavior_logp", "advantages", "mask"))
    keep = select_tokens(logp, behavior, advantages, mask, tau=batch.tau).keep
    n = max(int(mask.sum()), 1)
    compute = torch.float64 if dtype == "float64" else torch.float32
    ratio = (logp.to(compute) - behavior.to(compute)).masked_fill(~keep, 0.0).exp()
    reference = -(ratio * torch.where(keep, advantages.to(compute), torch.zeros((), dtype=compute))).sum() / torch.tensor(
        float(n), dtype=compute
    )
    (reference_grad,) = torch.autograd.grad(reference, logp)
    with core_passes(passes):
        loss = loss_from_selection(logp, behavior, advantages, keep, mask.sum())
        (grad,) = torch.autograd.grad(loss, logp)

    # Bit for bit, a NaN where autograd's is NaN too (kept tokens whose exp overflows to +inf and -inf).
    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.equal(a, b) or (torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a[~torch.isnan(a)], b[~torch.isnan(b)]))

    assert same(loss, reference), f"loss {loss.item()!r}, autograd's {reference.item()!r}"
    assert grad.dtype == logp.dtype and same(grad, reference_grad), (
        f"gradient differs at {torch.nonzero((grad != reference_grad) & ~(grad.isnan() & reference_grad.isnan()))[:3].tolist()}"
    )


@pytest.mark.parametrize("tau", [0.0, 5e-321, 1e-300])
def test_a_crossing_bucket_shared_with_non_candidates_gathers_candidates_only(tau):
    """Each token keeps its own bucket (M2's top 16 bits), non-candidates too: when the cut
    falls in a bucket that non-candidates share (here bucket 0: subnormal or zero M2,
    float64 inputs), only candidates may be gathered from it or kept below it. 6,000
    candidates (above SMALL) interleaved with 6,000 non-candidates of the same |d| and the
    wrong sign."""
    from m2po_oracle.bench.baselines import kept_candidates_by_sorting
    from m2po_oracle.core.loss import select_tokens

    n = 12000
    d = torch.where(torch.arange(n) % 2 == 0, torch.tensor(1e-160, dtype=torch.float64), torch.tensor(-1e-160, dtype=torch.float64))
    d[::6] = 1e-170  # M2 underflows to +0: candidates that always fit
    d[2::6] = 3e-161  # M2 about 9e-322
    d[1::6] = -1e-170  # non-candidates with M2 +0
    behavior = torch.zeros(n, dtype=torch.float64)  # logp is d itself
    advantages = torch.ones(n, dtype=torch.float64)
    mask = torch.ones(n, dtype=torch.bool)
    selection = select_tokens(behavior + d, behavior, advantages, mask, tau=tau)
    d_seen = (behavior + d) - behavior
    trust = d_seen > 0
    expected = mask.clone()
    expected[trust] = kept_candidates_by_sorting(d_seen[trust] ** 2, tau)
    assert torch.equal(selection.keep, expected), f"{int((selection.keep != expected).sum())} tokens differ"
    assert int(selection.trust_region_count) == int(trust.sum()) and int(selection.kept_trust_region_count) == int(expected[trust].sum())


@pytest.mark.parametrize("passes", PASSES)
@pytest.mark.parametrize("argument", ["behavior_logp", "advantages"])
def test_writing_into_an_input_before_the_backward_never_changes_the_gradient(argument, passes):
    """The loss's backward recomputes its terms from the inputs it saved: an input written
    into between the forward and the backward must make it raise (autograd's in-place
    check) or leave the gradient the forward's, never give one of values it did not see."""
    generator = torch.Generator().manual_seed(0)
    logp = torch.randn(8, 1024, generator=generator).requires_grad_(True)
    tensors = {
        "behavior_logp": logp.detach() + 0.1 * torch.randn(8, 1024, generator=generator),
        "advantages": torch.sign(torch.randn(8, 1024, generator=generator)),
    }
    mask = torch.ones(8, 1024, dtype=torch.bool)
    with core_passes(passes):
        (expected,) = torch.autograd.grad(m2po_loss(logp, **tensors, mask=mask, tau=0.04).loss, logp)
        result = m2po_loss(logp, **tensors, mask=mask, tau=0.04)
        tensors[argument].mul_(2.0)
        try:
            (grad,) = torch.autograd.grad(result.loss, logp)
        except RuntimeError as error:
            assert "modified by an inplace operation" in str(error), error
        else:
            assert torch.equal(grad, expected), "the backward used the input as written after the forward"


def test_a_ratio_beyond_float32_is_inf_there_and_algorithm_1_in_float64():
    # The project's decision (docs/explanation/algorithm.md §2, Overflow): exp(d) unguarded in the
    # input's dtype. d = 100 on a kept token outside the trust region (A < 0).

    batch = Batch(np.array([[0.0, -0.1]]), np.array([[-100.0, -0.2]]), np.array([[-1.0, 1.0]]), np.ones((1, 2), dtype=bool), 0.04)
    expected = oracle.m2po(batch)
    assert expected.keep.all() and np.isfinite(expected.loss)
    for dtype, finite in ((torch.float64, True), (torch.float32, False)):
        logp = torch.tensor(batch.logp, dtype=dtype, requires_grad=True)
        out = m2po_loss(
            logp,
            torch.tensor(batch.behavior_logp, dtype=dtype),
            torch.tensor(batch.advantages, dtype=dtype),
            torch.ones(1, 2, dtype=torch.bool),
            tau=0.04,
        )
        out.loss.backward()
        assert out.keep.all()
        if finite:
            assert out.loss.item() == pytest.approx(expected.loss, rel=1e-12)
        else:
            assert out.loss.item() == float("inf") and logp.grad[0, 0].item() == float("inf")
            assert torch.isfinite(logp.grad[0, 1])  # only the overflowing token's gradient
