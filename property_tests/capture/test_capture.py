"""m2po_oracle.capture.recorder: what a training run records comes back bit for bit, skipped steps
touch nothing, every bad argument and every bad capture is named, and nothing is pickled."""

from __future__ import annotations

import ast
import json
import math
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from m2po_oracle.capture import recorder
from m2po_oracle.capture.reader import check_capture, load_capture
from m2po_oracle.capture.recorder import SCHEMA, TENSOR_NAMES, CaptureError, Recorder

TOPOLOGY = "dp=2,cp=1,tp=1"


def _batch(seed: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logp = -torch.rand(shape, generator=generator, dtype=torch.float64).to(dtype)
    behavior = logp + 0.1 * torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)
    mask = torch.rand(shape, generator=generator) < 0.8
    if logp.numel():
        # Padding may hold NaN / inf in a real run; the capture must keep those bits too.
        logp[~mask] = float("nan")
        behavior.view(-1)[0] = float("-inf")
    advantages = torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)
    keep = mask & (torch.rand(shape, generator=generator) < 0.9)
    return {"logp": logp, "behavior_logp": behavior, "advantages": advantages, "mask": mask, "keep": keep}


def _record(recorder: Recorder, step: int, micro_batch: int, batch: dict[str, torch.Tensor], **overrides) -> Path | None:
    arguments = dict(batch, loss=0.25 + step, tau=0.04, metrics={"m2_before": 0.1, "valid_count": 7})
    arguments.update(overrides)
    return recorder.record(step=step, micro_batch=micro_batch, **arguments)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    # torch.equal says NaN != NaN; comparing the bit patterns is what "bit-identical" means.
    if tensor.dtype == torch.bool or not tensor.is_floating_point():
        return tensor
    return tensor.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])


def _assert_bit_identical(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, f"{name}: {got.dtype} {list(got.shape)} != {want.dtype} {list(want.shape)}"
    assert torch.equal(_bits(got), _bits(want)), f"{name}: bits differ at {(_bits(got) != _bits(want)).nonzero()[:5].tolist()}"


def _same_scalar(got: float, want: float) -> bool:
    return (math.isnan(got) and math.isnan(want)) or got == want


def _clean_capture(directory: Path) -> None:
    """2 ranks x 2 steps x 2 micro-batches, one gradient watched per record."""
    for rank in range(2):
        recorder = Recorder(directory, rank=rank, world_size=2, topology=TOPOLOGY)
        for step in range(2):
            for micro_batch in range(2):
                batch = _batch(100 * rank + 10 * step + micro_batch, (2, 3))
                batch["logp"] = torch.zeros(2, 3, requires_grad=True)
                _record(recorder, step, micro_batch, batch)
                recorder.watch_gradient(batch["logp"])
                (batch["logp"] * 2).sum().backward()


# ---------------------------------------------------------------------------------------------
# Round trip


def test_round_trip_two_ranks_bit_identical(tmp_path: Path) -> None:
    shapes = {0: (3, 5), 1: (0, 5), 2: (1, 7)}  # micro-batch 1 is empty, as a trainer's split may be
    dtypes = {0: torch.float32, 1: torch.bfloat16, 2: torch.float64}
    written: dict[tuple[int, int, int], dict] = {}
    for rank in range(2):
        recorder = Recorder(tmp_path, rank=rank, world_size=2, topology=TOPOLOGY, every=1)
        for step in (0, 1, 7):
            for micro_batch in range(3):
                batch = _batch(1000 * rank + 10 * step + micro_batch, shapes[micro_batch], dtypes[step % 3])
                if micro_batch == 2:
                    # On-policy: behaviour is logp itself and keep is mask (shared memory).
                    batch["behavior_logp"] = batch["logp"].detach()
                    batch["keep"] = batch["mask"]
                loss = float("nan") if (rank, step, micro_batch) == (1, 7, 0) else 0.5 * step - micro_batch
                metrics = {
                    "m2_before": 0.125 * step,
                    "masked_fraction": float("inf") if step == 7 else 0.0,
                    "valid_count": int(batch["mask"].sum()),
                    "as_tensor": torch.tensor(1.5),
                }
                path = _record(recorder, step, micro_batch, batch, loss=torch.tensor(loss), tau=0.04 * rank, metrics=metrics)
                assert path is not None and path.is_file(), f"record of rank {rank} step {step} mb {micro_batch} wrote {path}"
                written[(rank, step, micro_batch)] = {
                    **{k: v.clone() for k, v in batch.items()},
                    "loss": loss,
                    "tau": 0.04 * rank,
                    "metrics": {**metrics, "as_tensor": 1.5},
                }

    assert check_capture(tmp_path) == []
    capture = load_capture(tmp_path)
    assert (capture.world_size, capture.topology, capture.every) == (2, TOPOLOGY, 1)
    assert sorted(capture.manifests) == [0, 1]
    assert capture.steps() == [0, 1, 7]
    assert set(capture.keys()) == set(written) and len(capture) == len(written)
    assert capture.keys() == sorted(written, key=lambda k: (k[1], k[0], k[2])), "keys are ordered by step, rank, micro-batch"
    seen = 0
    for key, record in capture.records():
        want = written[key]
        for name in TENSOR_NAMES:
            _assert_bit_identical(f"{key} {name}", record[name], want[name])
        assert "grad" not in record, f"{key}: no gradient was watched"
        assert _same_scalar(record["loss"], want["loss"]), f"{key}: loss {record['loss']} != {want['loss']}"
        assert record["tau"] == want["tau"], f"{key}: tau {record['tau']} != {want['tau']}"
        assert record["metrics"].keys() == want["metrics"].keys()
        for name, value in want["metrics"].items():
            assert _same_scalar(record["metrics"][name], value), f"{key}: metric {name} {record['metrics'][name]} != {value}"
        assert type(record["metrics"]["valid_count"]) is int, "counts stay integers"
        assert (record["rank"], record["step"], record["micro_batch"]) == key
        seen += 1
    assert seen == len(written)
    assert [key for key, _ in capture.records(step=7, rank=1)] == [(1, 7, 0), (1, 7, 1), (1, 7, 2)]

    manifest = json.loads((tmp_path / "manifest.rank-001.json").read_text())
    assert manifest["schema"] == SCHEMA and manifest["world_size"] == 2 and manifest["topology"] == TOPOLOGY
    assert manifest["versions"]["torch"] == torch.__version__ and "m2po-oracle" in manifest["versions"]
    assert manifest["records"][0]["tensors"]["logp"] == {"dtype": "float32", "shape": [3, 5]}
    assert (tmp_path / "step-000007" / "rank-001.mb-002.safetensors").is_file(), "the documented layout"
    with pytest.raises(KeyError, match="rank=0, step=3"):
        capture.load(0, 3, 0)


def test_topology_is_normalised_and_a_silent_rank_still_has_a_manifest(tmp_path: Path) -> None:
    for rank in range(4):
        Recorder(tmp_path, rank=rank, world_size=4, topology=" tp=2 , dp=2 ")
    capture = load_capture(tmp_path)
    assert capture.topology == "dp=2,cp=1,tp=2" and len(capture) == 0 and sorted(capture.manifests) == [0, 1, 2, 3]


def test_resume_continues_and_still_refuses_duplicates(tmp_path: Path) -> None:
    _record(Recorder(tmp_path, rank=0, world_size=1, topology="dp=1"), 0, 0, _batch(0, (2, 2)))
    with pytest.raises(ValueError, match="resume=True"):
        Recorder(tmp_path, rank=0, world_size=1, topology="dp=1")
    with pytest.raises(ValueError, match="every"):
        Recorder(tmp_path, rank=0, world_size=1, topology="dp=1", every=2, resume=True)
    recorder = Recorder(tmp_path, rank=0, world_size=1, topology="dp=1", resume=True)
    with pytest.raises(ValueError, match="step=0, micro_batch=0 is already recorded"):
        _record(recorder, 0, 0, _batch(0, (2, 2)))
    _record(recorder, 1, 0, _batch(1, (2, 2)))
    assert load_capture(tmp_path).keys() == [(0, 0, 0), (0, 1, 0)]


@pytest.mark.cuda
def test_round_trip_from_cuda(tmp_path: Path) -> None:
    batch = {k: v.cuda() for k, v in _batch(3, (4, 6)).items()}
    logp = batch["logp"].nan_to_num(0.0).requires_grad_()
    batch["logp"] = logp
    recorder = Recorder(tmp_path, rank=0, world_size=1, topology="dp=1")
    _record(recorder, 0, 0, batch, loss=torch.tensor(0.5, device="cuda"), tau=torch.tensor(0.04, device="cuda"))
    recorder.watch_gradient(logp)
    loss = (logp.exp() * batch["advantages"]).sum()
    logp.retain_grad()
    loss.backward()  # the hook runs on the autograd engine's CUDA thread
    record = load_capture(tmp_path)[(0, 0, 0)]
    for name in TENSOR_NAMES:
        _assert_bit_identical(name, record[name], batch[name].detach().cpu())
    _assert_bit_identical("grad", record["grad"], logp.grad.cpu())
    assert load_capture(tmp_path).info(0, 0, 0).device.startswith("cuda")


# ---------------------------------------------------------------------------------------------
# Gradients


def _m2po_loss(logp: torch.Tensor, batch: dict[str, torch.Tensor], n: int) -> torch.Tensor:
    ratio = torch.exp(logp - batch["behavior_logp"])
    return -(torch.where(batch["keep"], ratio * batch["advantages"], 0.0)).sum() / n


def test_watch_gradient_captures_the_autograd_gradient_of_each_micro_batch(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path, rank=0, world_size=1, topology="dp=1")
    parameter = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    logps, batches, watches = [], [], []
    for micro_batch in range(2):
        batch = {
            k: v.nan_to_num(0.0, neginf=0.0) if v.is_floating_point() else v for k, v in _batch(micro_batch, (2, 5), torch.float64).items()
        }
        logp = parameter * (micro_batch + 1) - 1.0  # a non-leaf, as a model's output is
        logp.retain_grad()
        batch["logp"] = logp
        _record(recorder, 4, micro_batch, batch)
        watches.append(recorder.watch_gradient(logp))
        logps.append(logp)
        batches.append(batch)
    n = sum(int(b["mask"].sum()) for b in batches)
    loss = sum(_m2po_loss(logp, batch, n) for logp, batch in zip(logps, batches))
    loss.backward()  # one backward for both micro-batches: each record gets its own gradient

    capture = load_capture(tmp_path)
    for micro_batch, (logp, batch, watch) in enumerate(zip(logps, batches, watches)):
        record = capture[(0, 4, micro_batch)]
        _assert_bit_identical(f"grad of micro-batch {micro_batch}", record["grad"], logp.grad)
        analytic = -torch.where(batch["keep"], torch.exp(logp.detach() - batch["behavior_logp"]) * batch["advantages"], 0.0) / n
        torch.testing.assert_close(record["grad"], analytic, rtol=1e-12, atol=0.0)
        assert watch.backward_calls == 1 and watch.path == capture.info(0, 4, micro_batch).grad_path
    assert check_capture(tmp_path) == []


def test_a_second_backward_adds_and_a_reused_tensor_moves_its_hook(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path, rank=0, world_size=1, topology="dp=1")
    logp = torch.zeros(3, requires_grad=True)  # a leaf recorded twice, as a test loop might
    batch = dict(_batch(0, (3,)), logp=logp)
    _record(recorder, 0, 0, batch)
    watch = recorder.watch_gradient(logp)
    loss = (logp * torch.tensor([1.0, 2.0, 3.0])).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    assert watch.backward_calls == 2
    _record(recorder, 1, 0, batch)
    recorder.watch_gradient(logp)
    (logp * 10).sum().backward()
    capture = load_capture(tmp_path)
    assert capture[(0, 0, 0)]["grad"].tolist() == [2.0, 4.0, 6.0], "two backward passes sum, as .grad does"
    assert capture[(0, 1, 0)]["grad"].tolist() == [10.0, 10.0, 10.0], "the step-0 hook no longer fires"
    assert json.loads(recorder.manifest_path.read_text())["records"][0]["grad"]["backward_calls"] == 2


def test_watch_gradient_refusals(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path, rank=0, world_size=1, topology="dp=1")
    batch = _batch(0, (2, 2))
    with pytest.raises(ValueError, match="watch_gradient.*passed as logp= to record"):
        recorder.watch_gradient(batch["logp"])
    _record(recorder, 0, 0, batch)
    with pytest.raises(ValueError, match="does not require grad"):
        recorder.watch_gradient(batch["logp"])
    logp = torch.zeros(2, 2, requires_grad=True)
    _record(recorder, 0, 1, dict(batch, logp=logp))
    recorder.watch_gradient(logp)
    with pytest.raises(ValueError, match="already watched"):
        recorder.watch_gradient(logp)


# ---------------------------------------------------------------------------------------------
# Skipped steps


class _Poison:
    """Any attribute access, conversion or comparison on a skipped step is a failure."""

    def __getattribute__(self, name: str):
        raise AssertionError(f"a skipped step touched its argument (.{name})")


class _Tripwire(torch.Tensor):
    """A tensor whose every torch operation (detach, .to, .shape, ...) raises."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise AssertionError(f"a skipped step called {getattr(func, '__name__', func)} on a tensor")


def test_every_2_records_even_steps_and_skipped_steps_touch_nothing(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path, rank=0, world_size=1, topology="dp=1", every=2)
    tripwire = torch.zeros(4, requires_grad=True).as_subclass(_Tripwire)
    for step in range(6):
        if step % 2:
            poison = _Poison()
            assert (
                recorder.record(
                    step=step,
                    micro_batch=0,
                    logp=tripwire,
                    behavior_logp=poison,
                    advantages=poison,
                    mask=poison,
                    keep=poison,
                    loss=poison,
                    tau=poison,
                    metrics=poison,
                )
                is None
            )
            assert recorder.watch_gradient(tripwire) is None, "no hook on a skipped step"
        else:
            logp = torch.zeros(4, requires_grad=True)
            assert _record(recorder, step, 0, dict(_batch(step, (4,)), logp=logp)) is not None
            assert recorder.watch_gradient(logp) is not None
    assert load_capture(tmp_path).steps() == [0, 2, 4]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step-000000", "step-000002", "step-000004"]

    calls = 20_000
    start = time.perf_counter()
    for _ in range(calls):
        recorder.record(
            step=1,
            micro_batch=0,
            logp=tripwire,
            behavior_logp=tripwire,
            advantages=tripwire,
            mask=tripwire,
            keep=tripwire,
            loss=0.0,
            tau=0.04,
        )
    per_call = (time.perf_counter() - start) / calls
    # Measured at about 0.2 us; the bound only catches a skipped step that started doing work.
    assert per_call < 50e-6, f"a skipped record() took {per_call * 1e6:.1f} us"


# ---------------------------------------------------------------------------------------------
# Argument validation: (id, Recorder overrides, record overrides, what the message must name)

_GOOD_RECORDER = {"rank": 0, "world_size": 2, "topology": TOPOLOGY, "every": 1}
_SHAPE = (2, 3)

VALIDATION = [
    ("rank-negative", {"rank": -1}, None, r"rank must be an integer >= 0, got -1"),
    ("rank-too-large", {"rank": 2}, None, r"rank must be in \[0, world_size\) = \[0, 2\), got 2"),
    ("rank-bool", {"rank": True}, None, r"rank must be an integer"),
    ("world-size-zero", {"world_size": 0, "rank": 0}, None, r"world_size must be an integer >= 1, got 0"),
    (
        "topology-mismatch",
        {"topology": "dp=2,cp=2,tp=1"},
        None,
        r"topology 'dp=2,cp=2,tp=1' has dp\*cp\*tp = 2\*2\*1 = 4 ranks, expected world_size = 2",
    ),
    ("topology-unknown-key", {"topology": "dp=2,pp=1"}, None, r"topology 'dp=2,pp=1': bad part 'pp=1'"),
    ("topology-empty", {"topology": ""}, None, r"topology must be a string"),
    ("topology-zero", {"topology": "dp=0"}, None, r"bad part 'dp=0'"),
    ("every-zero", {"every": 0}, None, r"every must be an integer >= 1, got 0"),
    ("every-float", {"every": 1.5}, None, r"every must be an integer >= 1, got 1.5"),
    ("step-negative", None, {"step": -1}, r"step must be an integer >= 0, got -1"),
    ("step-float", None, {"step": 2.0}, r"step must be an integer >= 0, got 2.0"),
    ("micro-batch-negative", None, {"micro_batch": -3}, r"micro_batch must be an integer >= 0, got -3"),
    (
        "behavior-shape",
        None,
        {"behavior_logp": torch.zeros(2, 4)},
        r"behavior_logp must have the shape of logp \[2, 3\].*behavior_logp \[2, 4\]",
    ),
    ("advantages-per-row", None, {"advantages": torch.zeros(2)}, r"advantages must have the shape of logp \[2, 3\]"),
    (
        "mask-and-keep-shape",
        None,
        {"mask": torch.ones(3, 2, dtype=torch.bool), "keep": torch.ones(6, dtype=torch.bool)},
        r"mask, keep must have the shape of logp",
    ),
    ("mask-float", None, {"mask": torch.ones(_SHAPE)}, r"mask must be a bool tensor, got dtype torch.float32"),
    ("keep-uint8", None, {"keep": torch.ones(_SHAPE, dtype=torch.uint8)}, r"keep must be a bool tensor, got dtype torch.uint8"),
    ("logp-int", None, {"logp": torch.zeros(_SHAPE, dtype=torch.int64)}, r"logp must be a floating-point tensor"),
    ("logp-list", None, {"logp": [[0.0] * 3] * 2}, r"logp must be a torch.Tensor, got list"),
    ("tau-negative", None, {"tau": -0.01}, r"tau must be a finite number >= 0, got -0.01"),
    ("tau-nan", None, {"tau": float("nan")}, r"tau must be a finite number >= 0, got nan"),
    ("tau-inf", None, {"tau": torch.tensor(float("inf"))}, r"tau must be a finite number >= 0, got inf"),
    ("tau-string", None, {"tau": "0.04"}, r"tau must be a number"),
    ("tau-bool", None, {"tau": True}, r"tau must be a number"),
    ("loss-vector", None, {"loss": torch.zeros(2)}, r"loss must be a number or a one-element tensor, got a tensor of shape \[2\]"),
    ("loss-none", None, {"loss": None}, r"loss must be a number"),
    ("metrics-list", None, {"metrics": [1.0]}, r"metrics must be None or a mapping"),
    ("metrics-value", None, {"metrics": {"m2_after": "low"}}, r"metrics\['m2_after'\] must be a number"),
    ("metrics-key", None, {"metrics": {3: 1.0}}, r"metrics keys must be strings, got 3"),
]


@pytest.mark.parametrize(
    "recorder_overrides, record_overrides, message", [case[1:] for case in VALIDATION], ids=[case[0] for case in VALIDATION]
)
def test_validation_errors_name_the_argument(tmp_path: Path, recorder_overrides, record_overrides, message) -> None:
    with pytest.raises(ValueError, match=message):
        recorder = Recorder(tmp_path, **{**_GOOD_RECORDER, **(recorder_overrides or {})})
        arguments = dict(step=0, micro_batch=0, **_batch(0, _SHAPE), loss=0.0, tau=0.04)
        arguments.update(record_overrides or {})
        recorder.record(**arguments)
    assert recorder_overrides is not None or list(tmp_path.glob("step-*/*")) == [], "a refused record writes no file"


def test_duplicate_record_and_bad_directory(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path, **_GOOD_RECORDER)
    _record(recorder, 0, 0, _batch(0, _SHAPE))
    with pytest.raises(ValueError, match=r"step=0, micro_batch=0 is already recorded by rank 0"):
        _record(recorder, 0, 0, _batch(1, _SHAPE))
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        Recorder(tmp_path / "a_file", **_GOOD_RECORDER)


# ---------------------------------------------------------------------------------------------
# Bad captures


def _truncate(root: Path) -> Path:
    path = root / "step-000001" / "rank-000.mb-001.safetensors"
    path.write_bytes(path.read_bytes()[:-5])
    return path


def _other_schema(root: Path) -> Path:
    path = root / "manifest.rank-001.json"
    manifest = json.loads(path.read_text())
    manifest["schema"] = "m2po-oracle/capture/0"
    path.write_text(json.dumps(manifest))
    return path


def _delete_rank_manifest(root: Path) -> Path:
    path = root / "manifest.rank-001.json"
    path.unlink()
    return path


def _delete_record_file(root: Path) -> Path:
    path = root / "step-000000" / "rank-000.mb-000.safetensors"
    path.unlink()
    return path


def _corrupt_header(root: Path) -> Path:
    path = root / "step-000001" / "rank-000.mb-000.grad.safetensors"
    data = bytearray(path.read_bytes())
    data[8:12] = b"\xff\xfe{["
    path.write_bytes(bytes(data))
    return path


def _swap_files(root: Path) -> Path:
    # A file moved over another record's name: its header still says where it belongs.
    path = root / "step-000000" / "rank-000.mb-001.safetensors"
    shutil.copyfile(root / "step-000001" / "rank-000.mb-001.safetensors", path)
    return path


def _garbage_manifest(root: Path) -> Path:
    path = root / "manifest.rank-000.json"
    path.write_text('{"schema": "m2po-oracle/capture/1", "rank": 0,')
    return path


BAD = [
    ("truncated-file", _truncate, r"not a readable safetensors file \(truncated or corrupt\)"),
    ("other-schema", _other_schema, r"manifest schema is 'm2po-oracle/capture/0', expected 'm2po-oracle/capture/1'"),
    ("missing-rank-manifest", _delete_rank_manifest, r"manifest is missing: world_size = 2 needs one manifest per rank 0..1"),
    ("missing-record-file", _delete_record_file, r"listed in manifest.rank-000.json \(step 0, micro-batch 0\) but the file is missing"),
    ("corrupt-grad-header", _corrupt_header, r"not a readable safetensors file"),
    (
        "swapped-file",
        _swap_files,
        r"header metadata does not match manifest.rank-000.json \(step 0, micro-batch 1\): step '1' \(expected '0'\)",
    ),
    ("garbage-manifest", _garbage_manifest, r"manifest is not readable JSON"),
]


@pytest.mark.parametrize("damage, message", [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_a_bad_capture_raises_capture_error_naming_the_file(tmp_path: Path, damage, message) -> None:
    _clean_capture(tmp_path)
    assert check_capture(tmp_path) == []
    path = damage(tmp_path)
    with pytest.raises(CaptureError, match=message) as raised:
        load_capture(tmp_path)
    assert raised.value.path == str(path), f"CaptureError names {raised.value.path}, expected {path}"
    assert str(raised.value).startswith(f"{path}: "), str(raised.value)
    problems = check_capture(tmp_path)
    assert len(problems) == 1 and problems[0].startswith(f"{path}: "), problems


def test_check_capture_lists_every_problem(tmp_path: Path) -> None:
    _clean_capture(tmp_path)
    damaged = [damage(tmp_path) for damage in (_truncate, _other_schema, _delete_record_file, _corrupt_header)]
    problems = check_capture(tmp_path)
    assert len(problems) == len(damaged), "\n".join(problems)
    for path in damaged:
        assert any(problem.startswith(f"{path}: ") for problem in problems), f"{path} not in\n" + "\n".join(problems)
    with pytest.raises(CaptureError, match=r"and 3 more problems: check_capture\(\) lists them all"):
        load_capture(tmp_path)
    _delete_rank_manifest(tmp_path)  # the manifest whose schema was wrong: now it is missing instead
    assert sum("manifest is missing" in problem for problem in check_capture(tmp_path)) == 1


def test_not_a_capture_and_a_file_damaged_after_loading(tmp_path: Path) -> None:
    assert check_capture(tmp_path / "nowhere") == [f"{tmp_path / 'nowhere'}: capture directory does not exist or is not a directory"]
    assert check_capture(tmp_path) == [f"{tmp_path}: no manifest.rank-*.json: not a capture directory (or nothing was recorded)"]
    _clean_capture(tmp_path)
    capture = load_capture(tmp_path)
    path = _truncate(tmp_path)
    with pytest.raises(CaptureError, match=r"CRC-32 0x[0-9a-f]{8} differs from the manifest's 0x[0-9a-f]{8}") as raised:
        capture.load(0, 1, 1)
    assert raised.value.path == str(path)


def test_a_flipped_bit_in_tensor_data_is_caught_by_the_checksum(tmp_path: Path) -> None:
    # Same size, valid header: only the CRC-32 of the manifest can tell the data changed.
    _clean_capture(tmp_path)
    path = tmp_path / "step-000000" / "rank-001.mb-000.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10
    path.write_bytes(bytes(data))
    assert check_capture(tmp_path) == [], "the header check reads no data: the flip is invisible to it"
    with pytest.raises(CaptureError, match="CRC-32 .* the file changed after it was written") as raised:
        load_capture(tmp_path).load(1, 0, 0)
    assert raised.value.path == str(path)
    # A capture written before checksums (no crc32 in its manifest) still loads.
    manifest = tmp_path / "manifest.rank-001.json"
    text = json.loads(manifest.read_text())
    for entry in text["records"]:
        entry.pop("crc32")
    manifest.write_text(json.dumps(text))
    load_capture(tmp_path).load(1, 0, 0)


def test_optional_tensors_a_passed_gradient_and_parameter_norms_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(3)
    shape = (2, 5)
    logp, behavior, advantages = torch.randn(shape), torch.randn(shape), torch.randn(shape)
    mask = torch.ones(shape, dtype=torch.bool)
    selection, rollout, grad = torch.randn(shape), torch.randn(shape), torch.randn(shape)
    recorder = Recorder(tmp_path, rank=0, world_size=1, topology="dp=1")
    recorder.record(
        step=0,
        micro_batch=0,
        logp=logp,
        behavior_logp=behavior,
        advantages=advantages,
        mask=mask,
        keep=mask,
        loss=0.5,
        tau=0.04,
        selection_logp=selection,
        rollout_logp=rollout,
        grad=grad,
    )
    model = torch.nn.Linear(3, 2)
    model(torch.randn(4, 3)).sum().backward()
    model.bias.grad.zero_()
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    recorder.record_parameter_gradients(
        step=0, named_parameters=[*model.named_parameters(), ("frozen", frozen), ("unused", torch.nn.Parameter(torch.ones(1)))]
    )
    capture = load_capture(tmp_path)
    record = capture.load(0, 0, 0)
    for name, value in (("selection_logp", selection), ("rollout_logp", rollout), ("grad", grad)):
        assert torch.equal(record[name], value), name
    norms = capture.parameter_gradients(0)[0]
    assert set(norms) == {"weight", "bias", "unused"}, "frozen parameters are not listed"
    assert norms["bias"] == {"numel": 2, "norm": 0.0} and norms["unused"]["norm"] is None
    assert norms["weight"]["norm"] == pytest.approx(float(model.weight.grad.double().norm()))
    with pytest.raises(ValueError, match="selection_logp must have the shape of logp"):
        recorder.record(
            step=1,
            micro_batch=0,
            logp=logp,
            behavior_logp=behavior,
            advantages=advantages,
            mask=mask,
            keep=mask,
            loss=0.5,
            tau=0.04,
            selection_logp=torch.zeros(3),
        )
    with pytest.raises(ValueError, match="named_parameters must be"):
        recorder.record_parameter_gradients(step=1, named_parameters=[("w", 3)])


# ---------------------------------------------------------------------------------------------
# No pickle, no other dependency


def test_every_file_is_safetensors_or_json(tmp_path: Path) -> None:
    _clean_capture(tmp_path)
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert files and not [p for p in files if p.name.startswith(".")], "no temporary file is left behind"
    for path in files:
        data = path.read_bytes()
        if path.suffix == ".json":
            assert json.loads(data)["schema"] == SCHEMA, path
            continue
        assert path.suffix == ".safetensors", f"unexpected file {path}"
        # safetensors: an 8-byte little-endian header length, then a JSON header. A pickle
        # starts with 0x80 and a torch.save zip with "PK".
        (length,) = struct.unpack("<Q", data[:8])
        assert data[8:9] == b"{" and 8 + length <= len(data), f"{path} does not start with a safetensors header"
        header = json.loads(data[8 : 8 + length])
        assert header["__metadata__"]["schema"] == SCHEMA, path


def test_module_imports_only_torch_safetensors_and_the_standard_library() -> None:
    source = Path(recorder.__file__).read_text()
    tree = ast.parse(source)
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "a relative import would tie the module to the package"
            imported.add(node.module.split(".")[0])
    allowed = {"torch", "safetensors", "__future__", *sys.stdlib_module_names} - {"pickle", "marshal", "shelve", "copyreg"}
    assert imported <= allowed, f"unexpected imports {sorted(imported - allowed)}"
    calls = {
        f"{node.value.id}.{node.attr}" for node in ast.walk(tree) if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
    }
    assert not calls & {"torch.save", "torch.load", "pickle.dump", "pickle.load"}, calls


def test_vendored_copy_works_alone(tmp_path: Path) -> None:
    # A framework copies the one file: it must import and record without m2po_oracle, and the
    # package's reader must read what it wrote.
    shutil.copyfile(recorder.__file__, tmp_path / "vendored_capture.py")
    script = (
        "import sys, torch, vendored_capture as c\n"
        "r = c.Recorder(sys.argv[1], rank=0, world_size=1, topology='dp=1')\n"
        "b = torch.ones(2, dtype=torch.bool)\n"
        "r.record(step=0, micro_batch=0, logp=torch.zeros(2), behavior_logp=torch.zeros(2), advantages=torch.ones(2), mask=b, keep=b, loss=0.0, tau=0.04)\n"
        "print(sorted(m for m in sys.modules if m.startswith('m2po_oracle')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "run")], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"the vendored copy imported {result.stdout}"
    assert len(load_capture(tmp_path / "run")) == 1


def test_vendored_watch_works_as_one_package_folder(tmp_path: Path) -> None:
    # The recorder, watching.py and watch_reading.py copied into a framework's own folder
    # under another name: watch records a call without m2po_oracle.
    from m2po_oracle.capture import watch_reading, watching

    folder = tmp_path / "thirdparty_m2po"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    for module in (recorder, watching, watch_reading):
        shutil.copyfile(module.__file__, folder / Path(module.__file__).name)
    script = (
        "import sys, types, torch\n"
        "from thirdparty_m2po import recorder, watching\n"
        "lib = types.SimpleNamespace(loss=lambda logp, behavior_logp, advantages, mask, tau: "
        "((torch.exp(logp - behavior_logp) * advantages)[mask].sum() / mask.sum(), mask.clone()))\n"
        "r = recorder.Recorder(sys.argv[1], rank=0, world_size=1, topology='dp=1')\n"
        "logp = torch.zeros(1, 3, requires_grad=True)\n"
        "with watching.watch(lib, 'loss', r, step=lambda: 0):\n"
        "    loss, keep = lib.loss(logp, torch.zeros(1, 3), torch.ones(1, 3), torch.ones(1, 3, dtype=torch.bool), 0.04)\n"
        "    loss.backward()\n"
        "print(sorted(m for m in sys.modules if m.startswith('m2po_oracle')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "run")], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"the vendored copy imported {result.stdout}"
    assert len(load_capture(tmp_path / "run")) == 1
