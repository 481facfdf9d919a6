"""Record what a real training run fed its M2PO loss, for an offline audit.

This module depends on torch and safetensors only and imports no other ``m2po_oracle``
module, so that a framework can vendor this one file (``capture/reader.py`` reads what it
writes). Tensors are written as safetensors (never pickle); every rank writes its own files
and its own manifest, so ranks never write the same file and no collective is needed.

Recording (in every rank)::

    recorder = Recorder("runs/capture", rank=rank, world_size=world, topology="dp=4,cp=2,tp=1", every=10)
    loss, keep, metrics = framework_m2po_loss(logp, behavior_logp, advantages, mask, tau=tau)
    recorder.record(step=step, micro_batch=mb, logp=logp, behavior_logp=behavior_logp,
                    advantages=advantages, mask=mask, keep=keep, loss=loss, tau=tau, metrics=metrics)
    recorder.watch_gradient(logp)                                              # after record, before backward
    loss.backward()                                                            # the hook writes d loss / d logp

Every file is written to a temporary name and moved into place with ``os.replace``, and the
manifest (with a CRC-32 of every file) is rewritten after every record and every captured
gradient, so a run that dies leaves a capture whose manifest lists only complete files.
Non-finite scalars are written as "NaN", "Infinity", "-Infinity", so the manifest stays
strict JSON. ``watch_gradient(logp)`` binds to the record whose ``logp=`` was this very tensor
(held through a weak reference) and writes d loss / d logp beside it when backward reaches
it; a second backward (``retain_graph``) adds to the file. ``every=k`` records the steps with
``step % k == 0``; any other step returns at once without touching a tensor (no copy, no
``.item()``, no device synchronisation). The files, and what recording costs, are described
in the documentation (how-to "Auditing a training run", internals "Performance";
``python -m m2po_oracle.bench.capture_overhead`` measures it).
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import operator
import os
import platform
import re
import threading
import weakref
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, SupportsIndex, TypeVar, cast

import safetensors
import torch
from safetensors.torch import load, save_file

__all__ = ["OPTIONAL_TENSOR_NAMES", "SCHEMA", "TENSOR_NAMES", "CaptureError", "GradientWatch", "Recorder"]

#: The manifest schema this module writes and reads; a reader refuses any other.
SCHEMA = "m2po-oracle/capture/1"
#: The tensors of one record file, in the order they are validated and written.
TENSOR_NAMES: tuple[str, ...] = ("logp", "behavior_logp", "advantages", "mask", "keep")
#: Tensors a record holds only when the caller passes them (shape of logp, floating point):
#: ``selection_logp``, the log-probs the M2PO selection saw when that was another forward
#: than the loss's (a mask prepass), and ``rollout_logp``, the log-probs the sampler reported
#: at generation, which the behaviour log-probs must equal.
OPTIONAL_TENSOR_NAMES: tuple[str, ...] = ("selection_logp", "rollout_logp")
_FLOAT_TENSORS = ("logp", "behavior_logp", "advantages", "selection_logp", "rollout_logp")
_BOOL_TENSORS = ("mask", "keep")
GRAD = "grad"
_T = TypeVar("_T")

MANIFEST_FILE = re.compile(r"manifest\.rank-([0-9]+)\.json")
_AXES = ("dp", "cp", "tp")
_PART = re.compile(r"\s*([A-Za-z_]\w*)\s*=\s*([0-9]+)\s*")
_TOPOLOGY_FORM = "'dp=N,cp=N,tp=N' (keys in any order, a missing key means 1, N an integer >= 1)"
# Strict JSON has no NaN/inf; these spellings are JavaScript's and Python's float() reads them.
_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
# torch dtype name -> safetensors header code, to compare a file's header with its manifest.
SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}


# ---------------------------------------------------------------------------------------------
# Argument checks. Every message names the argument and what was expected.


def _integer(name: str, value: object, minimum: int) -> int:
    # bool is an int subclass; True as a step or rank is always a caller's mistake.
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    try:
        number = operator.index(cast(SupportsIndex, value))
    except TypeError:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}") from None
    if number < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {number}")
    return number


def _scalar(name: str, value: object) -> float | int:
    """A Python number from a number or a one-element tensor (``.item()`` syncs: recorded steps only)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number or a one-element tensor, got a tensor of shape {list(value.shape)}")
        if value.dtype == torch.bool:
            raise ValueError(f"{name} must be a number, got a bool tensor")
        value = value.detach().item()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    if not isinstance(value, (bool, str, bytes)) and getattr(getattr(value, "dtype", None), "kind", None) != "b":
        # A NumPy scalar is accepted through __index__ / __float__, without importing NumPy.
        for convert in (operator.index, float):
            try:
                return convert(cast(Any, value))
            except (TypeError, ValueError):
                pass
    raise ValueError(f"{name} must be a number (int, float or a one-element tensor), got {value!r}")


def _tau(value: object) -> float:
    tau = float(_scalar("tau", value))
    if not math.isfinite(tau) or tau < 0:
        raise ValueError(f"tau must be a finite number >= 0, got {tau!r}")
    return tau


def _parse_topology(topology: object, world_size: int) -> str:
    if not isinstance(topology, str) and all(hasattr(topology, axis) for axis in _AXES):
        # m2po_oracle.distributed.topology.Topology (or any object with dp, cp, tp), duck-typed
        # so that this module stays importable without the rest of the package.
        topology = ",".join(f"{axis}={getattr(topology, axis)}" for axis in _AXES)
    if not isinstance(topology, str) or not topology.strip():
        raise ValueError(f"topology must be a string {_TOPOLOGY_FORM}, got {topology!r}")
    sizes: dict[str, int] = {}
    for part in topology.split(","):
        match = _PART.fullmatch(part)
        if match is None or match.group(1) not in _AXES or match.group(1) in sizes or int(match.group(2)) < 1:
            raise ValueError(f"topology {topology!r}: bad part {part.strip()!r}, expected {_TOPOLOGY_FORM}")
        sizes[match.group(1)] = int(match.group(2))
    dp, cp, tp = (sizes.get(axis, 1) for axis in _AXES)
    if dp * cp * tp != world_size:
        raise ValueError(f"topology {topology!r} has dp*cp*tp = {dp}*{cp}*{tp} = {dp * cp * tp} ranks, expected world_size = {world_size}")
    return f"dp={dp},cp={cp},tp={tp}"


def _check_tensors(tensors: Mapping[str, torch.Tensor]) -> None:
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    for name in _FLOAT_TENSORS:
        if name in tensors and not tensors[name].is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {tensors[name].dtype}")
    for name in _BOOL_TENSORS:
        if tensors[name].dtype != torch.bool:
            raise ValueError(f"{name} must be a bool tensor, got dtype {tensors[name].dtype}")
    shape = tensors["logp"].shape
    wrong = [name for name in list(tensors)[1:] if tensors[name].shape != shape]
    if wrong:
        # Advantages per sequence must be broadcast by the caller: the audit compares token by token.
        shapes = ", ".join(f"{name} {list(value.shape)}" for name, value in tensors.items())
        raise ValueError(f"{', '.join(wrong)} must have the shape of logp {list(shape)}; got {shapes}")


def _metrics(metrics: object) -> dict[str, float | int]:
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise ValueError(f"metrics must be None or a mapping of str to numbers, got {type(metrics).__name__}")
    out: dict[str, float | int] = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise ValueError(f"metrics keys must be strings, got {key!r}")
        out[key] = _scalar(f"metrics[{key!r}]", value)
    return out


# ---------------------------------------------------------------------------------------------
# Files.


def _encode(value: float) -> float | str:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value


def decode_number(value: _T) -> _T | float:
    if isinstance(value, str) and value in _NON_FINITE:
        return _NON_FINITE[value]
    return value


def _replace_atomically(path: Path, write: Callable[[Path], object]) -> None:
    # The temporary name is hidden and per process, so a reader never sees a partial file
    # under the final name and two processes that (wrongly) share a rank cannot collide on it.
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> int:
    """Write one safetensors file; return the CRC-32 of its bytes, which the reader checks."""
    crc = 0

    def write(tmp: Path) -> None:
        nonlocal crc
        save_file(tensors, tmp, metadata=metadata)
        # Read back from the page cache: safetensors' save() to bytes and one write costs
        # about twice as much as save_file at 1M tokens (measured: 32 ms against 11 ms).
        with tmp.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 22), b""):
                crc = zlib.crc32(block, crc)

    _replace_atomically(path, write)
    return crc


def _cpu_copies(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, tensor in tensors.items():
        copy = tensor.detach().to("cpu", non_blocking=False).contiguous()
        storage = copy.untyped_storage().data_ptr()
        if storage in storages and copy.numel():
            # A CPU tensor is not copied by .to("cpu"): behavior_logp=logp.detach() (on-policy)
            # or keep=mask would share memory, which safetensors refuses to write.
            copy = copy.clone()
            storage = copy.untyped_storage().data_ptr()
        storages.add(storage)
        out[name] = copy
    return out


def describe_tensor(tensor: torch.Tensor) -> dict[str, Any]:
    return {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape)}


def _versions() -> dict[str, str | None]:
    try:
        # The distribution's metadata, not an import: a vendored copy has no package to import.
        oracle: str | None = importlib.metadata.version("m2po-oracle")
    except importlib.metadata.PackageNotFoundError:
        oracle = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "safetensors": safetensors.__version__,
        "m2po-oracle": oracle,
    }


def manifest_line(entry: Mapping[str, Any]) -> str:
    return json.dumps(entry, separators=(",", ":"), allow_nan=False)


def record_name(step: int, micro_batch: int, rank: int, suffix: str = "") -> str:
    return f"step-{step:06d}/rank-{rank:03d}.mb-{micro_batch:03d}{suffix}.safetensors"


def manifest_name(rank: int) -> str:
    return f"manifest.rank-{rank:03d}.json"


class CaptureError(ValueError):
    """A capture directory that cannot be audited as it is; the message names the file."""

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


def parse_manifest(path: Path) -> dict[str, Any]:
    """One rank's manifest, checked field by field; :class:`CaptureError` names the first problem."""
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CaptureError(path, f"manifest is not readable JSON: {error}") from None
    if not isinstance(manifest, dict):
        raise CaptureError(path, f"manifest must be a JSON object, got {type(manifest).__name__}")
    if manifest.get("schema") != SCHEMA:
        raise CaptureError(path, f"manifest schema is {manifest.get('schema')!r}, expected {SCHEMA!r}")
    for key, kind in (("rank", int), ("world_size", int), ("topology", str), ("every", int), ("records", list)):
        if not isinstance(manifest.get(key), kind) or isinstance(manifest.get(key), bool):
            raise CaptureError(path, f"manifest field {key!r} must be a {kind.__name__}, got {manifest.get(key)!r}")
    return manifest


# ---------------------------------------------------------------------------------------------
# Recording.


class GradientWatch:
    """The tensor hook of one record: writes d loss / d logp when backward reaches ``logp``."""

    def __init__(self, recorder: Recorder, step: int, micro_batch: int, handle: Any) -> None:
        self.step = step
        self.micro_batch = micro_batch
        #: How many backward passes reached ``logp`` (their gradients are summed in the file).
        self.backward_calls = 0
        self._recorder = recorder
        self._handle = handle

    @property
    def path(self) -> Path:
        """The gradient file (it exists once backward has run)."""
        return self._recorder.directory / record_name(self.step, self.micro_batch, self._recorder.rank, ".grad")

    def remove(self) -> None:
        """Stop capturing (a backward that already ran stays recorded)."""
        self._handle.remove()

    def _hook(self, grad: torch.Tensor) -> None:
        # Runs inside backward (on the autograd device thread for CUDA); returning None leaves
        # the gradient untouched. An error here (a full disk) stops the backward on purpose:
        # a capture that silently lost a gradient would audit as "no gradient".
        self._recorder._write_gradient(self, grad)


@dataclass
class _Pending:
    ref: weakref.ref
    step: int
    micro_batch: int
    watch: GradientWatch | None = None


class Recorder:
    """Writes one rank's records of a training run (see the module docstring for the layout).

    ``rank`` is this process's global rank in ``[0, world_size)``; ``topology`` is the
    ``dp x cp x tp`` split of the world (``"dp=4,cp=2,tp=1"``, ``dp*cp*tp == world_size``),
    kept for the audit, which decides from it which ranks hold replicas. ``every=k`` records
    the steps divisible by ``k``. A directory that already holds this rank's manifest is
    refused unless ``resume=True``, which continues it (same world, topology and ``every``).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        rank: int,
        world_size: int,
        topology: str,
        every: int = 1,
        resume: bool = False,
    ) -> None:
        self.world_size = _integer("world_size", world_size, 1)
        self.rank = _integer("rank", rank, 0)
        if self.rank >= self.world_size:
            raise ValueError(f"rank must be in [0, world_size) = [0, {self.world_size}), got {self.rank}")
        self.topology = _parse_topology(topology, self.world_size)
        self.every = _integer("every", every, 1)
        if not isinstance(directory, (str, os.PathLike)):
            raise ValueError(f"directory must be a path (str or os.PathLike), got {directory!r}")
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise ValueError(f"directory {str(self.directory)!r} exists and is not a directory")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.manifest_path = self.directory / manifest_name(self.rank)

        self._lock = threading.Lock()  # the CUDA backward hook runs on another thread
        self._pending: dict[int, _Pending] = {}
        self._last_skipped = False
        self._records: dict[tuple[int, int], dict[str, Any]] = {}
        if self.manifest_path.exists():
            if not resume:
                raise ValueError(
                    f"directory {str(self.directory)!r} already holds a capture of rank {self.rank} "
                    f"({self.manifest_path.name}); pass resume=True to continue it or choose another directory"
                )
            self._resume()
        self._manifest: dict[str, Any] = {
            "schema": SCHEMA,
            "rank": self.rank,
            "world_size": self.world_size,
            "topology": self.topology,
            "every": self.every,
            "versions": _versions(),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),  # datetime.UTC is 3.11+
        }
        if getattr(self, "_resumed_parameters", None):
            self._manifest["parameter_gradients"] = self._resumed_parameters
        # One compact line per record, serialised once: rewriting the manifest then costs a
        # join and a write, not a json.dumps of every record so far.
        self._lines: dict[tuple[int, int], str] = {key: manifest_line(entry) for key, entry in self._records.items()}
        # Written now, so that a rank that records nothing still shows up in the audit.
        self.write_manifest()

    def _resume(self) -> None:
        manifest = parse_manifest(self.manifest_path)
        for key, expected in (("world_size", self.world_size), ("topology", self.topology), ("every", self.every)):
            if manifest.get(key) != expected:
                raise ValueError(
                    f"resume=True: {self.manifest_path} was written with {key} = {manifest.get(key)!r}, "
                    f"expected {key} = {expected!r} (the arguments of this Recorder)"
                )
        for entry in manifest.get("records", []):
            self._records[(entry["step"], entry["micro_batch"])] = entry
        self._resumed_parameters = dict(manifest.get("parameter_gradients") or {})

    def record(
        self,
        *,
        step: int,
        micro_batch: int,
        logp: torch.Tensor,
        behavior_logp: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        keep: torch.Tensor,
        loss: float | torch.Tensor,
        tau: float,
        metrics: Mapping[str, float | int | torch.Tensor] | None = None,
        selection_logp: torch.Tensor | None = None,
        rollout_logp: torch.Tensor | None = None,
        grad: torch.Tensor | None = None,
    ) -> Path | None:
        """Write one micro-batch of one optimizer step; return its file, or ``None`` when skipped.

        ``mask`` is the loss mask (valid tokens), ``keep`` the tokens the implementation kept
        after M2PO masking, ``loss`` this micro-batch's loss as the framework computed it,
        ``tau`` the budget, ``metrics`` the scalars the framework logs.

        Optional, each of logp's shape: ``selection_logp``, the log-probs the selection was
        computed on when that was another forward than ``logp``'s (a mask prepass before the
        loss passes); ``rollout_logp``, the log-probs the sampler reported when it generated
        the tokens; ``grad``, d loss / d logp of this micro-batch when the caller already has
        it (instead of :meth:`watch_gradient`).

        Under context parallelism each rank records its own shard (the Megatron layout: the
        sequence cut into ``2 * cp`` chunks, CP rank ``i`` holding chunks ``i`` and
        ``2 * cp - 1 - i``, in that order) with ``loss`` its share; under tensor parallelism
        every TP rank records its replica.
        """
        step = _integer("step", step, 0)
        if step % self.every:
            # The whole point of every=k: nothing below runs, no tensor is read or copied.
            self._last_skipped = True
            return None
        micro_batch = _integer("micro_batch", micro_batch, 0)
        if (step, micro_batch) in self._records:
            raise ValueError(
                f"step={step}, micro_batch={micro_batch} is already recorded by rank {self.rank}; expected each (step, micro_batch) once"
            )
        tensors = {"logp": logp, "behavior_logp": behavior_logp, "advantages": advantages, "mask": mask, "keep": keep}
        tensors.update(
            {name: value for name, value in (("selection_logp", selection_logp), ("rollout_logp", rollout_logp)) if value is not None}
        )
        _check_tensors(tensors if grad is None else {**tensors, GRAD: grad})
        if grad is not None and not grad.is_floating_point():
            raise ValueError(f"grad must be a floating-point tensor, got dtype {grad.dtype}")
        scalars = {"loss": _encode(float(_scalar("loss", loss))), "tau": _tau(tau)}
        metric_values = {key: _encode(value) for key, value in _metrics(metrics).items()}

        copies = _cpu_copies(tensors)
        name = record_name(step, micro_batch, self.rank)
        path = self.directory / name
        path.parent.mkdir(exist_ok=True)
        crc = write_tensors(path, copies, self._file_metadata(step, micro_batch))
        entry = {
            "step": step,
            "micro_batch": micro_batch,
            "file": name,
            "crc32": crc,
            "device": str(logp.device),
            "tensors": {key: describe_tensor(value) for key, value in copies.items()},
            **scalars,
            "metrics": metric_values,
            "grad": None,
        }
        if grad is not None:
            entry["grad"] = self._grad_file(step, micro_batch, grad.detach().to("cpu", non_blocking=False).contiguous(), 0)
        with self._lock:
            self._records[(step, micro_batch)] = entry
            self._lines[(step, micro_batch)] = manifest_line(entry)
            self.write_manifest()
        self._last_skipped = False
        self._remember(logp, step, micro_batch)
        return path

    def watch_gradient(self, logp: torch.Tensor) -> GradientWatch | None:
        """Capture d loss / d logp of the record whose ``logp=`` was this tensor object.

        Call it after :meth:`record` and before ``backward``. Returns the hook's
        :class:`GradientWatch`, or ``None`` when the last ``record`` call was a skipped step.
        """
        if self._last_skipped:
            return None
        entry = self._pending.get(id(logp))
        if entry is None or entry.ref() is not logp:
            raise ValueError(
                "watch_gradient(logp): logp must be the tensor object passed as logp= to record() "
                "on a recorded step (call watch_gradient after record, with the same tensor)"
            )
        if entry.watch is not None:
            raise ValueError(
                f"watch_gradient(logp): the gradient of step={entry.step}, micro_batch={entry.micro_batch} "
                f"is already watched; expected one watch per record"
            )
        if not isinstance(logp, torch.Tensor) or not logp.requires_grad:
            raise ValueError(
                f"watch_gradient(logp): logp of step={entry.step}, micro_batch={entry.micro_batch} does not "
                f"require grad; expected the tensor the loss is differentiated through"
            )
        watch = GradientWatch(self, entry.step, entry.micro_batch, handle=None)
        # The hook holds the watch, never logp: no reference cycle keeps the graph alive.
        watch._handle = logp.register_hook(watch._hook)
        entry.watch = watch
        return watch

    def _remember(self, logp: torch.Tensor, step: int, micro_batch: int) -> None:
        key = id(logp)
        pending = self._pending
        previous = pending.get(key)
        if previous is not None and previous.ref() is logp and previous.watch is not None:
            # The same tensor object recorded again (a reused leaf): its gradient now belongs
            # to the new record, so the old record's hook must not add to its file.
            previous.watch.remove()

        def forget(_ref: weakref.ref, key: int = key) -> None:
            # Runs when logp is freed, before its id can be reused by another tensor.
            entry = pending.get(key)
            if entry is not None and entry.ref() is None:
                del pending[key]

        pending[key] = _Pending(weakref.ref(logp, forget), step, micro_batch)

    def _grad_file(self, step: int, micro_batch: int, grad: torch.Tensor, backward_calls: int) -> dict[str, Any]:
        name = record_name(step, micro_batch, self.rank, ".grad")
        crc = write_tensors(self.directory / name, {GRAD: grad}, self._file_metadata(step, micro_batch))
        return {"file": name, "crc32": crc, **describe_tensor(grad), "backward_calls": backward_calls}

    def _write_gradient(self, watch: GradientWatch, grad: torch.Tensor) -> None:
        copy = grad.detach().to("cpu", non_blocking=False).contiguous()
        with self._lock:
            if watch.backward_calls:
                # A second backward through the same logp: sum, as .grad accumulates.
                copy = load(watch.path.read_bytes())[GRAD] + copy
            watch.backward_calls += 1
            entry = self._records[(watch.step, watch.micro_batch)]
            entry["grad"] = self._grad_file(watch.step, watch.micro_batch, copy, watch.backward_calls)
            self._lines[(watch.step, watch.micro_batch)] = manifest_line(entry)
            self.write_manifest()

    def record_parameter_gradients(self, *, step: int, named_parameters: Any) -> dict[str, Any] | None:
        """Note each parameter's gradient norm at this step (call it right before ``optimizer.step()``).

        ``named_parameters``: ``model.named_parameters()`` or a mapping name -> parameter, this
        rank's own (sharded) parameters under FSDP or TP. Only norms are kept (one float per
        parameter), in the manifest: the audit flags a trainable parameter whose gradient is
        all zero on every rank while the loss's gradient is not (a freeze or a detach on the
        wrong tensor), and one with no gradient at all (``None``). Skipped steps return ``None``.
        """
        step = _integer("step", step, 0)
        if step % self.every:
            return None
        items = named_parameters.items() if isinstance(named_parameters, Mapping) else named_parameters
        norms: dict[str, Any] = {}
        try:
            for name, parameter in items:
                if not isinstance(name, str) or not isinstance(parameter, torch.Tensor):
                    raise TypeError
                if not parameter.requires_grad:
                    continue
                grad = parameter.grad
                norms[name] = {"numel": parameter.numel(), "norm": None if grad is None else _encode(float(grad.detach().double().norm()))}
        except (TypeError, ValueError):
            raise ValueError("named_parameters must be model.named_parameters() or a mapping of str to tensors") from None
        with self._lock:
            self._manifest.setdefault("parameter_gradients", {})[str(step)] = norms
            self.write_manifest()
        return norms

    def _file_metadata(self, step: int, micro_batch: int) -> dict[str, str]:
        # Repeated in each file's header so that a file moved or renamed is caught by the reader.
        return {"schema": SCHEMA, "rank": str(self.rank), "step": str(step), "micro_batch": str(micro_batch)}

    def write_manifest(self) -> None:
        """Rewrite this rank's manifest from the records so far (each record already does)."""
        head = json.dumps(self._manifest, indent=1, allow_nan=False)
        records = ",\n  ".join(self._lines.values())
        text = f'{head[:-2]},\n "records": [\n  {records}\n ]\n}}\n' if records else f'{head[:-2]},\n "records": []\n}}\n'

        def write(tmp: Path) -> None:
            tmp.write_text(text, encoding="utf-8")

        _replace_atomically(self.manifest_path, write)
