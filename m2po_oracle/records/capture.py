"""One rank's manifest of a capture (``DIR/manifest.rank-NNN.json``), key by key: the recorder
writes it beside the tensors, the audit reads it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal, get_args

from msgspec import UNSET, UnsetType

from m2po_oracle.records.declare import CaptureNumber, doc

#: The vendorable recorder declares the id too (it imports nothing of the package, and importing
#: it here would load torch with every record); the records' test holds the two equal.
SchemaId = Literal["m2po-oracle/capture/1"]
SCHEMA: SchemaId = get_args(SchemaId)[0]


@dataclass(frozen=True, kw_only=True)
class CaptureManifest:
    """One rank's manifest of a capture: every record it wrote, with a CRC-32 of each file."""

    schema: Annotated[SchemaId, doc("the schema id (each safetensors file's header repeats it, with the rank, step and micro-batch)")]
    rank: Annotated[int, doc("the global rank that wrote this manifest")]
    world_size: Annotated[int, doc("ranks in the run")]
    topology: Annotated[str, doc("`dp=N,cp=N,tp=N`, Megatron order")]
    every: Annotated[int, doc("steps recorded: those divisible by it")]
    versions: Annotated[dict[str, str | str | None], doc("what wrote the capture")]
    created: Annotated[str, doc("when the manifest was created, ISO 8601 in UTC")]
    parameter_gradients: Annotated[
        dict[str, dict[str, ParameterGradient]] | UnsetType,
        doc(
            "each trainable parameter's gradient norm on this rank, per step",
            when="`record_parameter_gradients` called on a recorded step",
            keys="a step number (as a string), then a parameter's name",
        ),
    ] = UNSET
    records: Annotated[tuple[Record, ...], doc("one per recorded micro-batch, in the order recorded")]


@dataclass(frozen=True, kw_only=True)
class Record:
    """`records[]`"""

    step: Annotated[int, doc("the optimizer step")]
    micro_batch: Annotated[int, doc("the micro-batch in it")]
    file: Annotated[str, doc("the tensors' safetensors file, relative to the capture directory")]
    crc32: Annotated[int, doc("the file's CRC-32")]
    device: Annotated[str, doc("where the tensors were")]
    tensors: Annotated[
        dict[str, Tensor],
        doc(
            "the tensors in the file",
            keys="`logp`, `behavior_logp`, `advantages`, `mask`, `keep`, then `selection_logp` and `rollout_logp` where recorded (`TENSOR_NAMES`, `OPTIONAL_TENSOR_NAMES` of the recorder)",
        ),
    ]
    loss: Annotated[CaptureNumber, doc("this micro-batch's loss as the framework computed it")]
    tau: Annotated[CaptureNumber, doc("the budget")]
    metrics: Annotated[dict[str, CaptureNumber], doc("the scalars the framework logs", keys="the framework's own names")]
    grad: Annotated[Grad | None, doc("d loss / d logp of the micro-batch; null: not captured")]


@dataclass(frozen=True, kw_only=True)
class Grad:
    """`records[].grad`"""

    file: Annotated[str, doc("its safetensors file")]
    crc32: Annotated[int, doc("the file's CRC-32")]
    dtype: Annotated[str, doc("its dtype")]
    shape: Annotated[tuple[int, ...], doc("its shape (logp's)")]
    backward_calls: Annotated[int, doc("backward passes summed into it (0: passed to `record`)")]


@dataclass(frozen=True, kw_only=True)
class Tensor:
    """`records[].tensors{}`"""

    dtype: Annotated[str, doc("its dtype")]
    shape: Annotated[tuple[int, ...], doc("its shape")]


@dataclass(frozen=True, kw_only=True)
class ParameterGradient:
    """`parameter_gradients{}{}`"""

    numel: Annotated[int, doc("the parameter's elements on this rank")]
    norm: Annotated[CaptureNumber | None, doc("its gradient's L2 norm; null: no gradient")]
