"""The fused CPU passes (``m2po_oracle.core.fused``) against the torch operators they replace:
every field of the result and the gradient, bit for bit, on drawn batches forced through
every branch, on large batches, and at the edges the fused passes must refuse."""

from __future__ import annotations

import shlex
import shutil
import sysconfig
from unittest import mock

import numpy as np
import pytest
import torch
from core_passes import core_passes  # beside this file
from hypothesis import given
from hypothesis import strategies as st

from m2po_oracle import strategies
from m2po_oracle.core import fast_selection, fused
from m2po_oracle.core.loss import CoreResult, m2po_loss
from m2po_oracle.judge.contract import to_tensors
from m2po_oracle.oracle.batch import Batch

FIELDS = [name for name in CoreResult.__dataclass_fields__ if name != "loss"]


def _compiler() -> str | None:
    command = shlex.split(sysconfig.get_config_var("CC") or "cc")
    return shutil.which(command[0]) if command else None


def test_the_extension_is_built_wherever_a_compiler_is():
    """The extension is optional at install (no compiler: the torch operators run), so a
    build that failed on a machine with a compiler would pass unnoticed: not here."""
    if _compiler() is None:
        pytest.skip("no C compiler on this machine: the core runs its torch operators")
    assert fused.built(), f"a C compiler is here ({_compiler()}) but m2po_oracle.core.fused_c is not built: {fused.why_not_built()}"


def _both_ways(tensors: dict[str, torch.Tensor], tau: float) -> tuple[list, int]:
    """The forward and gradient with the fused passes and with the torch operators, and how
    many times the fused first level ran."""
    results = []
    calls = 0
    for passes in ("fused", "torch operators"):
        logp = tensors["logp"].clone().requires_grad_(True)
        with core_passes(passes), mock.patch.object(fused, "first_level", wraps=fused.first_level) as spy:
            result = m2po_loss(logp, tensors["behavior_logp"], tensors["advantages"], tensors["mask"], tau=tau)
            (grad,) = torch.autograd.grad(result.loss, logp)
        calls += spy.call_count if passes == "fused" else 0
        results.append((result, grad))
    return results, calls


def _assert_identical(results: list, where: str) -> None:
    (fused_result, fused_grad), (torch_result, torch_grad) = results
    for name in ["loss", *FIELDS]:
        ours, theirs = getattr(fused_result, name).detach(), getattr(torch_result, name).detach()
        assert (ours.dtype == theirs.dtype and torch.equal(ours, theirs)) or (
            name == "loss" and bool(torch.isnan(ours)) and bool(torch.isnan(theirs))
        ), (
            f"{where}: {name} fused {ours if ours.numel() == 1 else ours.nonzero()[:5].tolist()}, "
            f"torch operators {theirs if theirs.numel() == 1 else theirs.nonzero()[:5].tolist()}"
        )
    differ = (fused_grad != torch_grad) & ~(fused_grad.isnan() & torch_grad.isnan())
    assert fused_grad.dtype == torch_grad.dtype and not bool(differ.any()), (
        f"{where}: gradient differs at {differ.nonzero()[:3].tolist()}: fused {fused_grad[differ][:3].tolist()}, "
        f"torch operators {torch_grad[differ][:3].tolist()}"
    )


@pytest.mark.parametrize("small", [0, 4], ids=["first level always", "few candidates sorted"])
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@given(batch=strategies.batches(), padding=st.sampled_from([0.0, float("nan"), float("inf"), -1e30]))
def test_the_fused_passes_are_the_torch_operators_to_the_last_bit(small, dtype, batch, padding):
    """Every batch of more than ``small`` tokens goes through the first level (fused: one
    pass), then the finish: all candidates sorted (at most ``small``) or the crossing
    bucket's; padding of any value."""
    if not fused.built():
        pytest.skip(f"the fused passes are not built: {fused.why_not_built()}")
    tensors = to_tensors(batch.with_padding(padding), dtype)
    with mock.patch.object(fast_selection, "SMALL", small):
        results, calls = _both_ways(tensors, batch.tau)
    _assert_identical(results, f"{dtype}, SMALL={small}, padding {padding}, shape {batch.shape}, tau {batch.tau}")
    assert calls == (1 if batch.logp.size > small else 0), "the fused first level did not run where it applies"


def _large_batch(
    seed: int, shape: tuple[int, int], *, ties: bool = False, padding: float | None = None, few_candidates: bool = False, tau: float = 0.04
) -> Batch:
    rng = np.random.default_rng(seed)
    behavior = -rng.exponential(2.0, size=shape)
    d = 0.3 * rng.standard_t(3, size=shape)
    if ties:
        d[:, ::3] = 0.25  # thousands of equal M2 (0.0625): the cut falls among them
    advantages = np.where(rng.random(shape) < 0.5, 1.0, -1.0)
    if few_candidates:
        advantages[rng.random(shape) < 0.995] = 0.0  # a few hundred candidates among 65k tokens
    valid = np.arange(shape[1])[None, :] < rng.integers(shape[1] // 4, shape[1] + 1, size=(shape[0], 1))
    batch = Batch(behavior + d, behavior, advantages, valid, tau)
    return batch.with_padding(padding) if padding is not None else batch


LARGE = {
    "crossing bucket sorted": dict(seed=0, shape=(16, 4096)),
    "exact ties at the cut": dict(seed=1, shape=(16, 4096), ties=True, tau=0.0625),
    "NaN padding": dict(seed=2, shape=(16, 4096), padding=float("nan")),
    "few candidates": dict(seed=3, shape=(16, 4096), few_candidates=True),
    "everything fits": dict(seed=4, shape=(16, 4096), tau=1e6),
    "nothing fits": dict(seed=5, shape=(16, 4096), tau=0.0),
}


@pytest.mark.parametrize("finish", ["sorted", "radix levels"])
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("case", LARGE)
def test_large_batches_agree_bit_for_bit(case, dtype, finish):
    """65,536 tokens, the core's own SMALL; the crossing bucket finished by sorting or by
    the remaining radix levels (SORT_AT_MOST = 0)."""
    if not fused.built():
        pytest.skip(f"the fused passes are not built: {fused.why_not_built()}")
    batch = _large_batch(**LARGE[case])
    at_most = fast_selection.SORT_AT_MOST if finish == "sorted" else 0
    with mock.patch.object(fast_selection, "SORT_AT_MOST", at_most):
        results, calls = _both_ways(to_tensors(batch, dtype), batch.tau)
    _assert_identical(results, f"{case}, {dtype}, {finish}")
    assert calls == 1


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("case", LARGE)
def test_large_batches_through_the_fused_passes_pass_the_battery(case, dtype):
    """Bit for bit the torch operators is not yet right: the battery holds the fused
    forward at 65,536 tokens to Algorithm 1 (the oracle), as compare holds small batches."""
    if not fused.built():
        pytest.skip(f"the fused passes are not built: {fused.why_not_built()}")
    from m2po_oracle.judge.battery import assert_battery_passes

    with mock.patch.object(fused, "first_level", wraps=fused.first_level) as spy:
        assert_battery_passes(m2po_loss, _large_batch(**LARGE[case]), impl="core", dtype=dtype)
    assert spy.call_count >= 1, "the battery's calls did not take the fused passes"


def test_threads_running_the_fused_forward_at_once_get_their_own_results():
    """The C passes release the GIL and their scratch is per thread: forwards running at
    once in several threads give each the result it gets alone."""
    if not fused.built():
        pytest.skip(f"the fused passes are not built: {fused.why_not_built()}")
    import threading

    batches = [to_tensors(_large_batch(10 + i, (64, 4096), tau=0.02 * (i + 1)), "float32") for i in range(4)]
    alone = [m2po_loss(**t, tau=0.02 * (i + 1)) for i, t in enumerate(batches)]
    together: dict[int, list[CoreResult]] = {i: [] for i in range(len(batches))}
    start = threading.Barrier(len(batches))

    def run(i: int) -> None:
        start.wait()
        for _ in range(8):
            together[i].append(m2po_loss(**batches[i], tau=0.02 * (i + 1)))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(batches))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i, expected in enumerate(alone):
        assert len(together[i]) == 8, f"batch {i}: a thread failed"
        for repeat, result in enumerate(together[i]):
            for name in ["loss", *FIELDS]:
                assert torch.equal(getattr(result, name), getattr(expected, name)), (
                    f"batch {i}, repeat {repeat}: {name} differs when run beside other threads"
                )


@pytest.mark.parametrize("flags", [["-msse2", "-mno-avx"], ["-mavx2"]], ids=["SSE2", "AVX2"])
def test_every_instruction_set_s_build_gives_the_same_bits(flags, tmp_path):
    """The extension picks its AVX-512, AVX2 or SSE2 clone at load: this machine runs one.
    The others, built alone with the extension's flags, must give the torch operators' bits."""
    if not fused.built():
        pytest.skip(f"the fused passes are not built: {fused.why_not_built()}")
    import importlib.machinery
    import importlib.util
    import platform
    import subprocess
    from pathlib import Path

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the instruction-set clones are x86-64's")
    source = Path(fused.__file__).with_name("fused_c.c")
    if not source.exists():
        pytest.skip("an installed wheel: the extension's source is not here")
    target = tmp_path / f"fused_c{sysconfig.get_config_var('EXT_SUFFIX')}"
    compiler = shlex.split(sysconfig.get_config_var("CC") or "cc")
    subprocess.run(
        [
            *compiler,
            "-O3",
            "-ffp-contract=off",
            *flags,
            "-DM2PO_FUSED_ONE_TARGET",
            "-shared",
            "-fPIC",
            f"-I{sysconfig.get_paths()['include']}",
            str(source),
            "-o",
            str(target),
        ],
        check=True,
        capture_output=True,
    )
    loader = importlib.machinery.ExtensionFileLoader("m2po_oracle.core.fused_c", str(target))
    built = importlib.util.module_from_spec(importlib.util.spec_from_loader("m2po_oracle.core.fused_c", loader))
    loader.exec_module(built)
    with mock.patch.object(fused, "_extension", built):
        for case in ("crossing bucket sorted", "exact ties at the cut", "NaN padding"):
            for dtype in ("float64", "float32", "bfloat16"):
                batch = _large_batch(**LARGE[case])
                results, calls = _both_ways(to_tensors(batch, dtype), batch.tau)
                _assert_identical(results, f"{case}, {dtype}, built with {' '.join(flags)}")
                assert calls == 1


@pytest.mark.parametrize("argument, value", [("logp", float("nan")), ("behavior_logp", float("inf")), ("advantages", float("-inf"))])
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_a_non_finite_valid_token_is_refused_with_the_same_message(argument, value, dtype):
    if not fused.built():
        pytest.skip(f"the fused passes are not built: {fused.why_not_built()}")
    tensors = to_tensors(_large_batch(6, (8, 2048)), dtype)
    tensors[argument] = tensors[argument].clone()
    tensors[argument][3, 700] = value
    messages = []
    for passes in ("fused", "torch operators"):
        with core_passes(passes), pytest.raises(ValueError) as refused:
            m2po_loss(**tensors, tau=0.04)
        messages.append(str(refused.value))
    assert messages[0] == messages[1] and argument in messages[0] and "(3, 700)" in messages[0], messages


def test_the_fused_passes_take_only_what_they_were_written_for():
    """float16, mixed dtypes, strided views, another device: the torch operators run."""
    if not fused.built():
        pytest.skip(f"the fused passes are not built: {fused.why_not_built()}")
    x32, mask = torch.zeros(8), torch.ones(8, dtype=torch.bool)
    assert fused.applies(x32, x32, x32, mask)
    assert not fused.applies(x32.half(), x32.half(), x32.half(), mask)
    assert not fused.applies(x32, x32.double(), x32, mask)
    assert not fused.applies(torch.zeros(16)[::2], x32, x32, mask)
    assert not fused.applies(x32, x32, x32, mask.float())
    assert not fused.applies(x32, x32, x32, torch.ones(9, dtype=torch.bool))
    with fused.disabled():
        assert not fused.applies(x32, x32, x32, mask)
    assert fused.applies(x32, x32, x32, mask)
    with mock.patch.dict("os.environ", {"M2PO_ORACLE_FUSED": "0"}):
        assert not fused.applies(x32, x32, x32, mask)
    # Anything but 0 or 1 is an error naming the variable, not silently "on".
    for setting in ("false", "off", ""):
        with (
            mock.patch.dict("os.environ", {"M2PO_ORACLE_FUSED": setting}),
            pytest.raises(ValueError, match=f"^M2PO_ORACLE_FUSED: expected 0 .* got {setting!r}"),
        ):
            fused.applies(x32, x32, x32, mask)
    # A float16 batch large enough for the first level runs the torch operators.
    tensors = to_tensors(_large_batch(7, (8, 2048)), "float16")
    with mock.patch.object(fused, "first_level", wraps=fused.first_level) as spy:
        m2po_loss(**tensors, tau=0.04)
    assert spy.call_count == 0


def test_the_wrappers_check_every_buffer_before_the_extension_touches_it():
    """The extension reads and writes raw memory: a wrong size, dtype, layout or device is
    a ValueError naming the buffer, never a write past its end."""
    if not fused.built():
        pytest.skip(f"the fused passes are not built: {fused.why_not_built()}")
    n = 64
    x, mask = torch.zeros(n), torch.ones(n, dtype=torch.bool)
    sums, counts = torch.empty(fused.BUCKETS, dtype=torch.float64), torch.empty(fused.BUCKETS, dtype=torch.float64)
    trust, bucket = torch.empty(n, dtype=torch.bool), torch.empty(n, dtype=torch.int16)
    assert fused.first_level(x, x, x, mask, sums, counts, trust, bucket) == (0, n, True)
    wrong = {
        "bucket": dict(bucket=torch.empty(n - 1, dtype=torch.int16)),
        "trust": dict(trust=torch.empty(n, dtype=torch.uint8)),
        "sums": dict(sums=torch.zeros(fused.BUCKETS - 1, dtype=torch.float64)),
        "counts": dict(counts=torch.zeros(fused.BUCKETS, dtype=torch.float32)),
        "behavior_logp": dict(behavior_logp=torch.zeros(2 * n)[::2]),
        "advantages": dict(advantages=torch.zeros(n, dtype=torch.float64)),
    }
    arguments = dict(logp=x, behavior_logp=x, advantages=x, mask=mask, sums=sums, counts=counts, trust=trust, bucket=bucket)
    for name, change in wrong.items():
        with pytest.raises(ValueError, match=f"^{name}: expected"):
            fused.first_level(**{**arguments, **change})
    with pytest.raises(ValueError, match="^logp: expected float64, float32 or bfloat16"):
        fused.first_level(**{**arguments, "logp": x.half(), "behavior_logp": x.half(), "advantages": x.half()})
    keep = torch.empty(n, dtype=torch.bool)
    with pytest.raises(ValueError, match="^keep: expected"):
        fused.finish(bucket, trust, mask, crossing=None, size=0, keep=torch.empty(n + 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="^size: expected"):
        fused.finish(bucket, trust, mask, crossing=None, size=n + 1, keep=keep)
    # A size that disagrees with the data is an error, not a short or overlong write.
    trust.fill_(True)
    with pytest.raises(RuntimeError, match="64 candidates to decide where the first level counted 3"):
        fused.finish(bucket, trust, mask, crossing=None, size=3, keep=keep)
    with pytest.raises(ValueError, match="^ratio: expected"):
        fused.loss_terms(x, x, x, keep, torch.empty(n, dtype=torch.float64), torch.empty(n))


def _histogram(rng: np.random.Generator, values: int, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A first level's histogram of ``values`` drawn M2 spread over random buckets, and the values."""
    index = torch.from_numpy(rng.integers(0, fused.BUCKETS, size=values))
    m2 = torch.from_numpy(rng.exponential(scale, size=values))
    sums, counts = (torch.zeros(fused.BUCKETS, dtype=torch.float64) for _ in range(2))
    sums.scatter_add_(0, index, m2)
    counts.scatter_add_(0, index, torch.ones(values, dtype=torch.float64))
    return sums, counts, m2


@pytest.mark.parametrize("seed", range(40))
def test_the_fused_first_cut_is_the_descent_s_first_step(seed):
    """Every field of the state ``Descent.step`` reaches at level 0, and its crossing
    bucket: something crosses, nothing does, the first bucket does, an infinite sum."""
    if not fused.built():
        pytest.skip(f"the fused passes are not built: {fused.why_not_built()}")
    rng = np.random.default_rng(seed)
    sums, counts, m2 = _histogram(rng, int(rng.integers(1, 5000)), float(rng.choice([1e-3, 0.05, 1.0, 1e30])))
    if seed % 5 == 0:
        sums[int(rng.integers(0, fused.BUCKETS))] = float("inf")
    for tau in (0.0, 0.01, 0.04, 1.0, 1e300, float(m2.mean()), float(sums[sums > 0][0] / counts[sums > 0][0])):
        expected, crossing = fast_selection.Descent.start(torch.device("cpu")).step(sums, counts, tau, 0)
        cut = fused.first_cut(sums, counts, tau)
        assert cut.crossing == int(crossing), f"seed {seed}, tau {tau}: crossing {cut.crossing}, Descent.step {int(crossing)}"
        for name, value in vars(expected).items():
            ours = getattr(cut.descent(), name)
            assert ours.dtype == value.dtype and torch.equal(ours, value), f"seed {seed}, tau {tau}: {name} {ours}, Descent.step {value}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("seed", range(30))
def test_the_fused_sorted_cut_is_the_crossing_bucket_s_sorted_cut(seed, dtype):
    """The kept tokens, their count and sum of ``cut_of_crossing_bucket`` (which sorts up
    to SORT_AT_MOST values), from the tokens' positions; exact ties straddling the cut; and
    no token outside ``positions`` written."""
    if not fused.built():
        pytest.skip(f"the fused passes are not built: {fused.why_not_built()}")
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 3 * fast_selection.SORT_AT_MOST))
    logp = torch.from_numpy(rng.normal(size=n) * rng.choice([0.01, 0.3, 3.0])).to(dtype)
    behavior = torch.from_numpy(rng.normal(size=n) * 0.1).to(dtype)
    if seed % 3 == 0:
        logp[::3], behavior[::3] = 0.5, 0.25  # M2 0.0625 on a third of the tokens: ties at the cut
    size = int(rng.integers(0, min(n, fast_selection.SORT_AT_MOST) + 1))
    positions = torch.from_numpy(np.sort(rng.choice(n, size=size, replace=False))).to(torch.int64)
    kept_sum, kept_count = float(rng.choice([0.0, 3.5, 100.0])), float(rng.choice([0.0, 100.0, 1000.0]))
    descent = fused.FirstCut(5, kept_sum, kept_count, float(size)).descent()
    d = logp.index_select(0, positions).double() - behavior.index_select(0, positions).double()
    keep = torch.from_numpy(rng.random(n) < 0.5)
    untouched = torch.ones(n, dtype=torch.bool).index_fill_(0, positions, False)
    before = keep.clone()
    for tau in (0.0, 0.01, 0.04, 0.0625, 1.0):
        expected = fast_selection.cut_of_crossing_bucket(d * d, tau, descent)
        fits, fitted_sum = fused.sorted_cut(logp, behavior, positions, keep, kept_sum=kept_sum, kept_count=kept_count, tau=tau)
        where = f"seed {seed}, {n} tokens, {size} to decide, tau {tau}"
        assert torch.equal(keep[positions], expected.kept), (
            f"{where}: kept {keep[positions].nonzero()[:5].tolist()}, expected {expected.kept.nonzero()[:5].tolist()}"
        )
        assert kept_count + fits == float(expected.kept_count), f"{where}: count {kept_count + fits}, expected {float(expected.kept_count)}"
        assert torch.equal(torch.tensor(fitted_sum, dtype=torch.float64), expected.kept_sum), (
            f"{where}: sum {fitted_sum!r}, expected {expected.kept_sum}"
        )
        assert torch.equal(keep[untouched], before[untouched]), f"{where}: a token outside positions was written"


def test_the_cut_wrappers_check_their_arguments():
    """A position outside the batch is a ValueError before the extension writes anything;
    a non-float tau or a wrong buffer too."""
    if not fused.built():
        pytest.skip(f"the fused passes are not built: {fused.why_not_built()}")
    n = 64
    x, keep = torch.zeros(n), torch.zeros(n, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"^positions: expected indices in 0 \.\. 63, got 64 at 1"):
        fused.sorted_cut(x, x, torch.tensor([3, 64]), keep, kept_sum=0.0, kept_count=0.0, tau=0.04)
    with pytest.raises(ValueError, match=r"^positions: expected indices in 0 \.\. 63, got -1 at 0"):
        fused.sorted_cut(x, x, torch.tensor([-1]), keep, kept_sum=0.0, kept_count=0.0, tau=0.04)
    assert not bool(keep.any()), "a refused call wrote into keep"
    with pytest.raises(ValueError, match="^positions: expected a contiguous 1-d CPU tensor"):
        fused.sorted_cut(x, x, torch.tensor([[1]]), keep, kept_sum=0.0, kept_count=0.0, tau=0.04)
    with pytest.raises(ValueError, match="^tau: expected a float, got int"):
        fused.sorted_cut(x, x, torch.tensor([1]), keep, kept_sum=0.0, kept_count=0.0, tau=1)
    with pytest.raises(ValueError, match="^keep: expected dtype torch.bool"):
        fused.sorted_cut(x, x, torch.tensor([1]), keep.to(torch.uint8), kept_sum=0.0, kept_count=0.0, tau=0.04)
    sums = torch.zeros(fused.BUCKETS, dtype=torch.float64)
    with pytest.raises(ValueError, match="^counts: expected"):
        fused.first_cut(sums, sums[:-1], 0.04)
    with pytest.raises(ValueError, match="^tau: expected a float"):
        fused.first_cut(sums, sums, 0)
