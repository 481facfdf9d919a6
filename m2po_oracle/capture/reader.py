"""Read a capture written by :mod:`m2po_oracle.capture.recorder`, for the audit.

::

    capture = load_capture("runs/capture")           # CaptureError on the first problem
    for (rank, step, micro_batch), record in capture.records():
        record["logp"], record["keep"], record.get("grad"), record["loss"], record["tau"], record["metrics"]
    problems = check_capture("runs/capture")         # every problem, for a partial audit

Nothing is trusted: every manifest field, file header and CRC-32 is checked, and a damaged
capture is a :class:`CaptureError` naming the file, never a wrong audit.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load

from m2po_oracle.capture.recorder import (
    GRAD,
    MANIFEST_FILE,
    OPTIONAL_TENSOR_NAMES,
    SAFETENSORS_DTYPES,
    SCHEMA,
    TENSOR_NAMES,
    CaptureError,
    decode_number,
    manifest_name,
    parse_manifest,
)

__all__ = ["Capture", "CaptureError", "RecordInfo", "check_capture", "inspect_capture", "load_capture"]


@dataclass(frozen=True)
class RecordInfo:
    """What a manifest says about one record (nothing loaded yet)."""

    rank: int
    step: int
    micro_batch: int
    path: Path
    grad_path: Path | None
    loss: float
    tau: float
    metrics: dict[str, float | int]
    tensors: dict[str, dict[str, Any]]
    device: str | None = None
    crc32: int | None = None
    grad_crc32: int | None = None


@dataclass
class Capture:
    """A checked capture directory: every rank's manifest and its records, loaded on demand."""

    directory: Path
    world_size: int
    topology: str
    every: int
    manifests: dict[int, dict[str, Any]]
    _infos: dict[tuple[int, int, int], RecordInfo] = field(repr=False)

    def keys(self) -> list[tuple[int, int, int]]:
        """Every ``(rank, step, micro_batch)``, ordered by step, then rank, then micro-batch."""
        return sorted(self._infos, key=lambda k: (k[1], k[0], k[2]))

    def steps(self) -> list[int]:
        """The recorded optimizer steps, ascending."""
        return sorted({step for _, step, _ in self._infos})

    def info(self, rank: int, step: int, micro_batch: int) -> RecordInfo:
        """The manifest's entry of one record."""
        try:
            return self._infos[(rank, step, micro_batch)]
        except KeyError:
            raise KeyError(f"no record rank={rank}, step={step}, micro_batch={micro_batch} in {self.directory}") from None

    def load(self, rank: int, step: int, micro_batch: int) -> dict[str, Any]:
        """The record's tensors (``grad`` and the optional tensors when captured) and scalars,
        as one dict; :class:`CaptureError` when a file changed after it was written (CRC-32)."""
        info = self.info(rank, step, micro_batch)
        out: dict[str, Any] = dict(_load_tensors(info.path, _names(info.tensors), info.crc32))
        if info.grad_path is not None:
            out[GRAD] = _load_tensors(info.grad_path, (GRAD,), info.grad_crc32)[GRAD]
        out.update(rank=rank, step=step, micro_batch=micro_batch, loss=info.loss, tau=info.tau, metrics=dict(info.metrics))
        return out

    def records(self, *, step: int | None = None, rank: int | None = None) -> Iterator[tuple[tuple[int, int, int], dict[str, Any]]]:
        """``((rank, step, micro_batch), record)`` in :meth:`keys` order, optionally of one step or rank."""
        for key in self.keys():
            if (step is None or key[1] == step) and (rank is None or key[0] == rank):
                yield key, self.load(*key)

    def parameter_gradients(self, step: int) -> dict[int, dict[str, Any]]:
        """``{rank: {parameter: {"numel", "norm"}}}`` of the ranks that noted this step's
        parameter gradients (:meth:`Recorder.record_parameter_gradients`); ``{}`` when none did."""
        out = {}
        for rank, manifest in self.manifests.items():
            noted = (manifest.get("parameter_gradients") or {}).get(str(step))
            if isinstance(noted, Mapping):
                out[rank] = {
                    name: {"numel": entry.get("numel"), "norm": None if entry.get("norm") is None else float(decode_number(entry["norm"]))}
                    for name, entry in noted.items()
                    if isinstance(entry, Mapping)
                }
        return out

    def __getitem__(self, key: tuple[int, int, int]) -> dict[str, Any]:
        return self.load(*key)

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        """The ``(rank, step, micro_batch)`` keys, in :meth:`keys` order (as a mapping iterates)."""
        return iter(self.keys())

    def __contains__(self, key: object) -> bool:
        return key in self._infos

    def __len__(self) -> int:
        return len(self._infos)


def _names(described: Mapping[str, Any]) -> tuple[str, ...]:
    """The tensors a record file must hold: the required ones and the optional ones its entry lists."""
    return TENSOR_NAMES + tuple(name for name in OPTIONAL_TENSOR_NAMES if name in described)


def _load_tensors(path: Path, names: tuple[str, ...], crc32: int | None = None) -> dict[str, torch.Tensor]:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CaptureError(path, "record file is missing") from None
    except OSError as error:
        raise CaptureError(path, f"record file cannot be read: {error}") from None
    if crc32 is not None and zlib.crc32(data) != crc32:
        raise CaptureError(
            path,
            f"CRC-32 {zlib.crc32(data):#010x} differs from the manifest's {crc32:#010x}: "
            "the file changed after it was written (corrupt or overwritten)",
        )
    try:
        tensors = load(data)
    except Exception as error:
        raise CaptureError(path, f"not a readable safetensors file (truncated or corrupt): {error}") from None
    if set(tensors) != set(names):
        raise CaptureError(path, f"holds tensors {sorted(tensors)}, expected {sorted(names)}")
    return {name: tensors[name] for name in names}


def _parse_manifest(path: Path, problems: list[tuple[str, str]]) -> dict[str, Any] | None:
    try:
        return parse_manifest(path)
    except CaptureError as error:
        problems.append((error.path, error.problem))
        return None


def _check_file(
    path: Path, names: tuple[str, ...], described: Mapping[str, Any], header: dict[str, str], where: str
) -> list[tuple[str, str]]:
    """Problems of one tensor file, from its header alone (safe_open checks that the data covers the file)."""
    if not path.is_file():
        return [(str(path), f"listed in {where} but the file is missing")]
    try:
        with safe_open(str(path), framework="pt") as handle:
            keys = set(handle.keys())
            metadata = handle.metadata() or {}
            found = {name: (handle.get_slice(name).get_dtype(), handle.get_slice(name).get_shape()) for name in keys}
    except Exception as error:
        return [(str(path), f"not a readable safetensors file (truncated or corrupt): {error}")]
    problems = []
    if keys != set(names):
        problems.append((str(path), f"holds tensors {sorted(keys)}, expected {sorted(names)} ({where})"))
    wrong = {key: (metadata.get(key), value) for key, value in header.items() if metadata.get(key) != value}
    if wrong:
        said = ", ".join(f"{key} {got!r} (expected {want!r})" for key, (got, want) in wrong.items())
        problems.append((str(path), f"header metadata does not match {where}: {said}"))
    for name in keys & set(names):
        spec = described.get(name) if isinstance(described, Mapping) else None
        if not isinstance(spec, Mapping):
            problems.append((str(path), f"{where} does not describe tensor {name!r}"))
            continue
        dtype, shape = found[name]
        code = SAFETENSORS_DTYPES.get(str(spec.get("dtype")))
        if list(shape) != spec.get("shape") or (code is not None and code != dtype):
            problems.append((str(path), f"tensor {name!r} is {dtype} {list(shape)}, {where} says {spec.get('dtype')} {spec.get('shape')}"))
    return problems


def _checksum(value: object) -> int | None:
    # Captures written before checksums have none; a present one must be a 32-bit integer.
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**32:
        raise ValueError(f"crc32 must be an integer in [0, 2**32), got {value!r}")
    return value


def _relative(directory: Path, name: object, manifest: Path, problems: list[tuple[str, str]]) -> Path | None:
    # A manifest is data: a file name that leaves the capture directory is refused, not followed.
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
        problems.append((str(manifest), f"record file name {name!r} must be a relative path inside the capture"))
        return None
    return directory / name


def inspect_capture(directory: str | os.PathLike[str]) -> tuple[list[tuple[str, str]], Capture | None]:
    """Every (file, problem) of a capture, and the capture of what is readable (None when
    nothing is): what a partial audit works from."""
    root = Path(directory)
    problems: list[tuple[str, str]] = []
    if not root.is_dir():
        return [(str(root), "capture directory does not exist or is not a directory")], None
    manifests: dict[int, dict[str, Any]] = {}
    paths: dict[int, Path] = {}
    path: Path | None  # each manifest's path here, then each record's file (None: a name refused)
    for path in sorted(root.iterdir()):
        match = MANIFEST_FILE.fullmatch(path.name)
        if match is None:
            continue
        rank = int(match.group(1))
        paths[rank] = path
        manifest = _parse_manifest(path, problems)
        if manifest is None:
            continue
        if manifest["rank"] != rank:
            problems.append((str(path), f"manifest says rank {manifest['rank']}, its file name says rank {rank}"))
            continue
        manifests[rank] = manifest
    if not paths:
        return [(str(root), "no manifest.rank-*.json: not a capture directory (or nothing was recorded)")], None
    if not manifests:
        return problems, None

    first = min(manifests)
    world_size, topology, every = (manifests[first][key] for key in ("world_size", "topology", "every"))
    for rank, manifest in sorted(manifests.items()):
        for key, value in (("world_size", world_size), ("topology", topology), ("every", every)):
            if manifest[key] != value:
                problems.append((str(paths[rank]), f"{key} is {manifest[key]!r}, rank {first}'s manifest says {value!r}"))
        if rank >= world_size:
            problems.append((str(paths[rank]), f"rank {rank} is outside [0, world_size) = [0, {world_size})"))
    for rank in range(world_size):
        if rank not in paths:
            problems.append(
                (
                    str(root / manifest_name(rank)),
                    f"manifest is missing: world_size = {world_size} needs one manifest per rank 0..{world_size - 1}",
                )
            )

    infos: dict[tuple[int, int, int], RecordInfo] = {}
    for rank, manifest in sorted(manifests.items()):
        where_manifest = paths[rank].name
        for index, entry in enumerate(manifest["records"]):
            try:
                step, micro_batch = entry["step"], entry["micro_batch"]
                if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (step, micro_batch)):
                    raise TypeError
            except (TypeError, KeyError):
                problems.append((str(paths[rank]), f"records[{index}] has no integer step and micro_batch >= 0"))
                continue
            where = f"{where_manifest} (step {step}, micro-batch {micro_batch})"
            if (rank, step, micro_batch) in infos:
                problems.append((str(paths[rank]), f"step {step}, micro-batch {micro_batch} is listed twice"))
                continue
            path = _relative(root, entry.get("file"), paths[rank], problems)
            if path is None:
                continue
            header = {"schema": SCHEMA, "rank": str(rank), "step": str(step), "micro_batch": str(micro_batch)}
            described = entry.get("tensors") if isinstance(entry.get("tensors"), Mapping) else {}
            problems += _check_file(path, _names(described), described, header, where)
            grad_path = None
            grad = entry.get("grad")
            if grad is not None:
                grad_path = _relative(root, grad.get("file") if isinstance(grad, Mapping) else None, paths[rank], problems)
                if grad_path is not None:
                    problems += _check_file(grad_path, (GRAD,), {GRAD: grad}, header, f"{where} grad")
            try:
                info = RecordInfo(
                    rank=rank,
                    step=step,
                    micro_batch=micro_batch,
                    path=path,
                    grad_path=grad_path,
                    loss=float(decode_number(entry["loss"])),
                    tau=float(decode_number(entry["tau"])),
                    metrics={key: decode_number(value) for key, value in dict(entry.get("metrics") or {}).items()},
                    tensors=dict(described),
                    device=entry.get("device"),
                    crc32=_checksum(entry.get("crc32")),
                    grad_crc32=_checksum(grad.get("crc32")) if isinstance(grad, Mapping) else None,
                )
            except (KeyError, TypeError, ValueError) as error:
                problems.append((str(paths[rank]), f"{where}: loss, tau or metrics are not numbers ({error!r})"))
                continue
            infos[(rank, step, micro_batch)] = info
    capture = Capture(root, world_size, topology, every, manifests, infos)
    return problems, capture


def check_capture(directory: str | os.PathLike[str]) -> list[str]:
    """Every problem of a capture directory, each ``"FILE: what is wrong"``; ``[]`` when clean.

    Files are checked from their safetensors headers (which safetensors validates against the
    file's size, so a truncated file is caught) without loading tensor data.
    """
    problems, _ = inspect_capture(directory)
    return [f"{path}: {problem}" for path, problem in problems]


def load_capture(directory: str | os.PathLike[str]) -> Capture:
    """Read a capture directory for the audit; :class:`CaptureError` on its first problem."""
    problems, capture = inspect_capture(directory)
    if problems:
        path, problem = problems[0]
        if len(problems) > 1:
            problem += f" (and {len(problems) - 1} more problems: check_capture() lists them all)"
        raise CaptureError(path, problem)
    assert capture is not None
    return capture
