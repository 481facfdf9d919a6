"""The implementation contract, and calling an implementation under it.

An implementation under test is a callable

    fn(logp, behavior_logp, advantages, mask, *, tau) -> result

on torch tensors of shape [B, T] (``mask`` bool, the others floating; gradient flows
through ``logp`` only). ``result`` is a mapping or an object with ``loss`` (0-d tensor,
differentiable w.r.t. ``logp``) and ``keep`` (bool, shape [B, T]), and optionally any of
the metrics ``m2_before``, ``m2_after``, ``masked_fraction``, ``trust_region_fraction``
and counts ``valid_count``, ``trust_region_count``, ``kept_trust_region_count`` (Python
numbers or 0-d tensors).

:func:`measure` calls an implementation and reduces whatever happens (a result, an
exception, a wrong type, mutated inputs) to data; it never raises because of the
implementation's behaviour.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from m2po_oracle.errors import LoadError
from m2po_oracle.oracle.batch import Batch
from m2po_oracle.oracle.record import COUNT_FIELDS, METRIC_FIELDS, METRIC_SOURCES, M2POResult

Implementation = Callable[..., Any]

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class Finding:
    """Something the implementation did that is not a valid result (``kind`` names it)."""

    kind: str
    message: str


@dataclass(frozen=True)
class Measurement:
    """What one call of an implementation produced.

    ``batch`` holds the values the implementation actually received (inputs rounded to
    ``dtype``, back in float64): the oracle is evaluated on exactly these.
    """

    batch: Batch
    dtype: str
    result: M2POResult | None
    finding: Finding | None = None
    mutated_inputs: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)
    output: tuple[str, ...] = ()  # the first lines the implementation printed during the call (when captured)
    output_lines: int = 0  # how many lines it printed in all


def _check_dtype_name(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def to_tensors(batch: Batch, dtype: str, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The contract's input tensors for ``batch`` (``logp`` requires grad)."""
    torch_dtype = _check_dtype_name(dtype)
    make = lambda a: torch.tensor(a, dtype=torch_dtype, device=device)  # noqa: E731
    return {
        "logp": make(batch.logp).requires_grad_(True),
        "behavior_logp": make(batch.behavior_logp),
        "advantages": make(batch.advantages),
        "mask": torch.tensor(batch.valid, dtype=torch.bool, device=device),
    }


def rounded_batch(batch: Batch, dtype: str) -> Batch:
    """``batch`` as an implementation receiving ``dtype`` tensors sees it, in float64."""
    tensors = to_tensors(batch, dtype)
    back = lambda t: t.detach().double().numpy()  # noqa: E731
    return Batch(back(tensors["logp"]), back(tensors["behavior_logp"]), back(tensors["advantages"]), batch.valid.copy(), batch.tau)


def _field(result: Any, name: str) -> Any:
    if isinstance(result, Mapping):
        return result.get(name)
    return getattr(result, name, None)


def _same(before: torch.Tensor, after: torch.Tensor) -> bool:
    return (
        before.shape == after.shape
        and before.dtype == after.dtype
        and bool(
            torch.equal(before.nan_to_num(0.5, 1.5, -1.5), after.nan_to_num(0.5, 1.5, -1.5)) and torch.equal(before.isnan(), after.isnan())
        )
    )


def _scalar(value: Any, name: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"{name}: expected a number or 0-d tensor, got a tensor of shape {tuple(value.shape)}")
        return float(value.detach().double().cpu().item())
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name}: expected a number or 0-d tensor, got {type(value).__name__}")
    return float(value)


def normalise_result(raw: Any, logp: torch.Tensor, shape: tuple[int, int]) -> tuple[M2POResult, tuple[str, ...]]:
    """Reduce a raw result to an :class:`M2POResult`; raises TypeError/ValueError on misfit."""
    notes: list[str] = []
    loss = _field(raw, "loss")
    keep = _field(raw, "keep")
    if loss is None or keep is None:
        raise TypeError(f"result: expected a mapping or object with 'loss' and 'keep', got {type(raw).__name__} {_preview(raw)}")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(f"loss: expected a 0-d torch.Tensor, got {type(loss).__name__} {_preview(loss)}")
    if not loss.dtype.is_floating_point:
        raise TypeError(f"loss: expected a floating tensor, got dtype {loss.dtype}")
    if isinstance(keep, np.ndarray):
        keep = torch.from_numpy(keep)
    if not isinstance(keep, torch.Tensor):
        raise TypeError(f"keep: expected a bool tensor of shape {shape}, got {type(keep).__name__}")
    if tuple(keep.shape) != shape:
        raise ValueError(f"keep: expected shape {shape}, got {tuple(keep.shape)}")
    if keep.dtype != torch.bool:
        raise TypeError(f"keep: expected dtype torch.bool, got {keep.dtype}")

    if loss.requires_grad:
        (grad,) = torch.autograd.grad(loss.reshape(()), logp, allow_unused=True)
        if grad is None:
            notes.append("loss has a graph that does not reach logp: gradient taken as zero")
            grad = torch.zeros_like(logp)
    else:
        notes.append("loss carries no autograd graph: gradient taken as zero")
        grad = torch.zeros_like(logp)

    extras: dict[str, Any] = {}
    for name in METRIC_FIELDS:
        value = _field(raw, name)
        if value is not None:
            extras[name] = _scalar(value, name)
    for name in COUNT_FIELDS:
        value = _field(raw, name)
        if value is not None:
            number = _scalar(value, name)
            if not number.is_integer():
                raise TypeError(f"{name}: expected an integer count, got {number}")
            extras[name] = int(number)
    sources = _field(raw, METRIC_SOURCES)  # set by an adapter: where it read each metric
    if isinstance(sources, Mapping):
        extras["metric_sources"] = tuple((str(k), str(v)) for k, v in sources.items() if k in extras)
    result = M2POResult(
        loss=float(loss.detach().double().cpu().item()),
        keep=keep.detach().cpu().numpy().copy(),
        grad=grad.detach().double().cpu().numpy(),
        **extras,
    )
    return result, tuple(notes)


def _preview(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def measure(
    fn: Implementation, batch: Batch, *, dtype: str = "float64", device: str | torch.device = "cpu", capture: bool = True
) -> Measurement:
    """Call ``fn`` on ``batch`` under the contract and record everything it did.

    With ``capture`` what it prints to ``sys.stdout``/``sys.stderr`` is kept in the
    measurement instead of reaching the terminal."""
    tensors = to_tensors(batch, dtype, device)
    seen = rounded_batch(batch, dtype)
    snapshot = {name: t.detach().clone() for name, t in tensors.items()}
    with captured_output(capture) as printed:
        measurement = _call(fn, tensors, snapshot, seen, batch, dtype)
    return with_output(measurement, printed.getvalue()) if capture else measurement


#: Lines of a call's output a measurement keeps (all of them are counted).
OUTPUT_LINES_KEPT = 20


def with_output(measurement: Measurement, text: str) -> Measurement:
    """``measurement`` carrying ``text`` (what was printed) after what it already holds."""
    lines = text.splitlines()
    return with_printed(measurement, tuple(lines[:OUTPUT_LINES_KEPT]), len(lines))


def with_printed(measurement: Measurement, first_lines: tuple[str, ...], lines: int) -> Measurement:
    """``measurement`` carrying more printed output: its first lines (kept) and a count."""
    if not lines:
        return measurement
    return dataclasses.replace(
        measurement, output=(measurement.output + first_lines)[:OUTPUT_LINES_KEPT], output_lines=measurement.output_lines + lines
    )


def _call(
    fn: Implementation, tensors: dict[str, torch.Tensor], snapshot: dict[str, torch.Tensor], seen: Batch, batch: Batch, dtype: str
) -> Measurement:
    try:
        raw = fn(tensors["logp"], tensors["behavior_logp"], tensors["advantages"], tensors["mask"], tau=batch.tau)
    except (Exception, SystemExit) as error:  # the implementation's failure is a finding, not ours
        return Measurement(seen, dtype, None, Finding("raised", _exception_text(error)))
    mutated = tuple(name for name, before in snapshot.items() if not _same(before, tensors[name].detach()))
    try:
        result, notes = normalise_result(raw, tensors["logp"], batch.shape)
    except (TypeError, ValueError) as error:
        return Measurement(seen, dtype, None, Finding("wrong_result", str(error)), mutated)
    except Exception as error:
        return Measurement(seen, dtype, None, Finding("raised_in_backward", _exception_text(error)), mutated)
    return Measurement(seen, dtype, result, None, mutated, notes)


@contextlib.contextmanager
def captured_output(capture: bool = True) -> Iterator[io.StringIO]:
    """Python-level stdout and stderr of the block, kept in a buffer (when ``capture``)."""
    buffer = io.StringIO()
    if not capture:
        yield buffer
        return
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        yield buffer


#: The toolkit's own folder: its frames in a port's traceback only hide where the port failed.
TOOLKIT = str(Path(__file__).resolve().parents[1])


def _exception_text(error: BaseException) -> str:
    """The port's failure as a traceback of the port's own frames (the last three): the
    toolkit's frame that called it says nothing about the port."""
    trace = traceback.TracebackException.from_exception(error)
    frames = [f for f in trace.stack if not str(Path(f.filename).resolve()).startswith(TOOLKIT + os.sep)]
    trace.stack = traceback.StackSummary.from_list(frames[-3:])
    return "".join(trace.format()).rstrip() if frames else "".join(trace.format_exception_only()).rstrip()


# --- the implementation's name -------------------------------------------------------------

#: Whole training steps are named ``trainer``, ``trainer:...`` (runners, opened by the CLI).
TRAINER_PREFIX = "trainer"


@dataclass(frozen=True)
class ImplSpec:
    """``--impl`` read once: what kind of thing it names, and its parts.

    ``kind``: ``name`` (a built-in, ``control:NAME`` or a registered name), ``trainer`` (a
    whole training step: ``trainer``, ``trainer:NAME[:CONTROL]``, ``trainer:module:Class``;
    ``rest`` is what follows ``trainer:``), or ``attribute`` (``package.module:name`` or
    ``path/file.py:name``: ``target`` and ``attribute``)."""

    text: str
    kind: Literal["name", "trainer", "attribute"]
    target: str = ""
    attribute: str = ""
    rest: str = ""


def parse_impl(spec: str) -> ImplSpec:
    """``spec`` as an :class:`ImplSpec`; a :class:`LoadError` for one that is no string."""
    if not isinstance(spec, str) or not spec:
        raise LoadError(f"impl: expected a non-empty string, got {spec!r}")
    if spec == TRAINER_PREFIX or spec.startswith(TRAINER_PREFIX + ":"):
        return ImplSpec(spec, "trainer", rest=spec.partition(":")[2])
    if ":" not in spec or spec.startswith("control:"):  # "control:" is the built-in namespace
        return ImplSpec(spec, "name")
    target, _, attribute = spec.rpartition(":")
    return ImplSpec(spec, "attribute", target=target, attribute=attribute)
