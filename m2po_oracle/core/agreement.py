"""The collective fail-closed agreement: every rank of the group refuses the step, with
the same error, when any rank's input is invalid or the ranks' tau differ."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from m2po_oracle.core.inputs import MISSING_BEHAVIOR_LOGP, check_group, validate_inputs

#: The arguments a rank's local checks name, in the order of the agreement record's code
#: (0 = this rank's input is valid).
_ARGUMENTS = ("logp", "behavior_logp", "advantages", "mask", "tau", "micro_batches")
#: UTF-8 bytes of a failing rank's own message carried in its record (longer ones are cut),
#: so that the record is one fixed-size tensor: [code, tau, message words] = 256 bytes.
_MESSAGE_BYTES = 240
_RECORD_WORDS = 2 + _MESSAGE_BYTES // 8
#: Ranks named at most in one message (a 1024-rank group must not make a 1024-entry error).
_NAMED_RANKS = 8


@dataclass(frozen=True)
class _RankRecord:
    code: int
    tau: float
    message: str


def validate_across(check: Any, tau: Any, logp: Any, group: Any) -> None:
    """Run this rank's local ``check``, then agree with every rank of ``group``: if any rank
    failed, or the ranks' tau differ, every rank raises the same ValueError.

    A rank that raised on its own would leave the others waiting in the selection's first
    collective (a hang, or gloo's "Connection closed by peer"); ranks with different tau
    would silently compute different cuts. Costs one all-gather of 256 bytes per rank.
    """
    try:
        check()
        failure = None
    except ValueError as error:
        failure = error
    records = _exchange(_record(failure, tau), _agreement_device(logp, group), group)
    failed = [i for i, record in enumerate(records) if record.code]
    if failed:
        raise ValueError(_failure_message(records, failed, group))
    if any(record.tau != records[0].tau for record in records):
        raise ValueError(_disagreement_message(records, group))


def validate_across_ranks(logp: Any, behavior_logp: Any, advantages: Any, mask: Any, *, tau: Any, group: Any) -> None:
    """The core's input checks, agreed over ``group``: one rank's invalid input (or a tau
    that differs between ranks) makes every rank raise the same ValueError. For ports that
    select with their own code but must fail closed as the core does."""
    check_group(group)  # local: a broken group cannot carry an agreement
    validate_across(lambda: validate_inputs(logp, behavior_logp, advantages, mask, tau), tau, logp, group)


def _record(failure: ValueError | None, tau: Any) -> torch.Tensor:
    """This rank's float64 record: [code, tau, its own message as UTF-8 bytes]."""
    record = torch.zeros(_RECORD_WORDS, dtype=torch.float64)
    record[1] = _tau_value(tau)
    if failure is None:
        return record
    message = str(failure)
    argument = message.split(":", 1)[0].split("[", 1)[0]
    record[0] = 1 + (_ARGUMENTS.index(argument) if argument in _ARGUMENTS else len(_ARGUMENTS))
    encoded = _cut(message.encode("utf-8"))
    record[2:] = torch.frombuffer(bytearray(encoded.ljust(_MESSAGE_BYTES, b"\0")), dtype=torch.float64)
    return record


def _tau_value(tau: Any) -> float:
    # An invalid tau fails the rank's own check; its value only has to survive float64.
    if isinstance(tau, bool) or not isinstance(tau, (int, float)):
        return math.nan
    try:
        return float(tau)
    except OverflowError:
        return math.nan


def _cut(encoded: bytes) -> bytes:
    if len(encoded) <= _MESSAGE_BYTES:
        return encoded
    # Cut on a character boundary, so the message still decodes on every rank.
    return encoded[: _MESSAGE_BYTES - 3].decode("utf-8", "ignore").encode("utf-8") + b"..."


def _agreement_device(logp: Any, group: Any) -> torch.device:
    """Where the record lives: gloo needs CPU, NCCL CUDA; other backends get logp's device."""
    import torch.distributed as dist

    backend = str(dist.get_backend(group))
    on = logp.device if isinstance(logp, torch.Tensor) else None
    if backend == "gloo":
        return torch.device("cpu")
    if backend == "nccl":
        return on if on is not None and on.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    return on if on is not None else torch.device("cpu")


def _exchange(record: torch.Tensor, device: torch.device, group: Any) -> list[_RankRecord]:
    """Every rank's record, in group-rank order: one all-gather and one host copy."""
    import torch.distributed as dist

    mine = record.to(device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    # One host read of the table (a copy from an accelerator; none under gloo), decoded in NumPy.
    table = torch.stack(gathered).cpu().numpy()
    return [_RankRecord(int(row[0]), float(row[1]), _decode(row[2:])) for row in table]


def _decode(words: Any) -> str:
    return words.tobytes().rstrip(b"\0").decode("utf-8", "replace")


def _rank_name(group: Any, index: int) -> str:
    import torch.distributed as dist

    size = dist.get_world_size(group)
    global_rank = dist.get_global_rank(group, index)
    if global_rank == index:
        return f"rank {global_rank} of the group's {size}"
    return f"global rank {global_rank} (rank {index} of the group's {size})"


def _global_ranks(group: Any, indices: Sequence[int]) -> str:
    import torch.distributed as dist

    named = ", ".join(str(dist.get_global_rank(group, i)) for i in indices[:_NAMED_RANKS])
    return named + (f" and {len(indices) - _NAMED_RANKS} more" if len(indices) > _NAMED_RANKS else "")


def _failure_message(records: list[_RankRecord], failed: list[int], group: Any) -> str:
    """Names the lowest failing rank, its argument and its own message (the same on every rank)."""
    first = records[failed[0]]
    argument = _ARGUMENTS[first.code - 1] if first.code <= len(_ARGUMENTS) else "input"
    how = "missing" if first.message == MISSING_BEHAVIOR_LOGP else "invalid"
    detail = first.message[len(argument) + 2 :] if first.message.startswith(f"{argument}: ") else first.message
    size = len(records)
    which = f"; ranks {_global_ranks(group, failed)}" if len(failed) > 1 else ""
    return (
        f"{argument}: {how} on {_rank_name(group, failed[0])} ({len(failed)} of {size} ranks failed validation{which}; "
        f"every rank refuses the step): {detail}"
    )


def _disagreement_message(records: list[_RankRecord], group: Any) -> str:
    """Rank 0's tau and every rank that differs from it (at most a few named)."""
    import torch.distributed as dist

    named = [0] + [i for i, record in enumerate(records) if record.tau != records[0].tau]
    listed = ", ".join(f"rank {dist.get_global_rank(group, i)}: {records[i].tau!r}" for i in named[:_NAMED_RANKS])
    more = f", and {len(named) - _NAMED_RANKS} more differing ranks" if len(named) > _NAMED_RANKS else ""
    return f"tau: the ranks disagree ({listed}{more}); every rank must pass the same budget"
