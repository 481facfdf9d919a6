"""How one of our names is read from one call of a watched function: an argument by name
(:data:`ALIASES` by default), a path into the return (``'return[1]'``), a callable, or a
number; and the call's unnamed result parsed into keep, loss and metrics.

Like :mod:`.watching`, which reads every call through it, it imports torch and the standard
library only: the two vendor together as one package folder beside ``recorder.py``.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

#: What a wrapped call is read for: the inputs of the M2PO loss and what it produced.
#: ``selection_logp`` (the log-probs a mask prepass selected on) and ``rollout_logp`` (the sampler's,
#: which the behaviour log-probs must equal) are read only when ``inputs=`` names them.
INPUTS: tuple[str, ...] = ("logp", "behavior_logp", "log_ratio", "advantages", "mask", "tau", "selection_logp", "rollout_logp")
OUTPUTS: tuple[str, ...] = ("keep", "loss", "metrics")
#: Argument names read by default, first match (whose value is not None) first.
ALIASES: dict[str, tuple[str, ...]] = {
    "logp": ("logp", "log_probs", "logprobs", "per_token_logps", "per_token_logp", "policy_logp", "current_logp"),
    # The sampler's log-probs before a recomputed "old" policy's: M2PO's behaviour policy is the sampler.
    "behavior_logp": (
        "behavior_logp",
        "behaviour_logp",
        "rollout_logp",
        "rollout_per_token_logps",
        "old_per_token_logps",
        "old_logp",
        "old_log_probs",
    ),
    "log_ratio": ("log_ratio", "log_ratios", "logratio"),
    "advantages": ("advantages", "advantage"),
    "mask": ("mask", "completion_mask", "loss_mask", "response_mask", "valid_mask"),
    # The one table of the budget's names: the adapters' policy-loss config carries it under each.
    "tau": ("tau", "budget", "m2_threshold", "m2po_tau", "m2_budget", "M2_budget", "threshold"),
    "keep": ("keep", "m2po_mask", "keep_mask"),
}
REQUIRED = ("logp", "behavior_logp", "advantages", "mask", "tau", "keep")
_RETURN = re.compile(r"return((?:\[(?:-?[0-9]+|'[^']*'|\"[^\"]*\")\])*)")
_INDEX = re.compile(r"\[(-?[0-9]+|'[^']*'|\"[^\"]*\")\]")
SPEC_FORMS = (
    "an argument name of the function, 'return', 'return[i]' or \"return['key']\", a callable (args, kwargs, result) -> value, or None"
)
MISSING: Any = object()  # a sentinel read in place of any value: Any, so that `is not MISSING` leaves the value's type


# ---------------------------------------------------------------------------------------------
# Readers: how one of our names is read from one call.


@dataclass(frozen=True)
class Reader:
    what: str  # for messages: "argument 'log_ratio'", "return[1]", "callable"
    read: Callable[[inspect.BoundArguments | None, tuple, dict, Any], Any]


def _argument(names: tuple[str, ...]) -> Callable[..., Any]:
    def read(bound, args, kwargs, result):
        for name in names:
            value = bound.arguments.get(name, MISSING) if bound is not None else kwargs.get(name, MISSING)
            if value is MISSING and bound is not None:
                # A name caught by the function's **kwargs.
                for parameter in bound.signature.parameters.values():
                    if parameter.kind is parameter.VAR_KEYWORD:
                        value = bound.arguments.get(parameter.name, {}).get(name, MISSING)
            if value is not MISSING and value is not None:
                return value
        return MISSING

    return read


def _path(path: tuple[int | str, ...], spec: str) -> Callable[..., Any]:
    def read(bound, args, kwargs, result):
        value = result
        for key in path:
            try:
                value = value[key]
            except (LookupError, TypeError):
                raise ValueError(f"{spec}: the call returned {_kind(result)}, which has no [{key!r}]") from None
        return value

    return read


def _kind(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}: ({', '.join(type(v).__name__ for v in value)})"
    return f"a {type(value).__name__}"


def reader_for(function: str, ours: str, spec: object, parameters: Mapping[str, inspect.Parameter] | None) -> Reader | None:
    where = f"watch({function}): {'inputs' if ours in INPUTS else 'outputs'}[{ours!r}]"
    if spec is None:
        return None
    if isinstance(spec, str):
        match = _RETURN.fullmatch(spec)
        if match:
            path = tuple(int(k) if k[0] not in "'\"" else k[1:-1] for k in _INDEX.findall(match.group(1)))
            return Reader(spec, _path(path, f"{where} = {spec!r}"))
        var_keyword = parameters is None or any(p.kind is p.VAR_KEYWORD for p in parameters.values())
        if parameters is not None and spec not in parameters and not var_keyword:
            raise ValueError(
                f"{where} = {spec!r} is not an argument of {function}; expected {SPEC_FORMS} "
                f"(its arguments: {', '.join(parameters) or 'none'})"
            )
        return Reader(f"argument {spec!r}", _argument((spec,)))
    if callable(spec):
        return Reader(f"callable {getattr(spec, '__name__', type(spec).__name__)}", lambda b, a, k, r: spec(a, k, r))
    if ours == "tau" and isinstance(spec, (int, float)) and not isinstance(spec, bool):
        return Reader(f"the number {spec!r}", lambda b, a, k, r: spec)
    raise ValueError(f"{where} must be {SPEC_FORMS}{' or a number' if ours == 'tau' else ''}, got {spec!r}")


def default_readers(function: str, parameters: Mapping[str, inspect.Parameter] | None) -> dict[str, Reader | None]:
    readers: dict[str, Reader | None] = {}
    for ours, names in ALIASES.items():
        found = names if parameters is None else tuple(n for n in names if n in parameters)
        if found:
            readers[ours] = Reader(f"argument {' or '.join(map(repr, found))}", _argument(found))
    return readers


def _parse_result(result: object) -> dict[str, Any]:
    """keep, loss and metrics from an unnamed result: a bool tensor, a tensor, a mapping, alone or in a tuple."""
    parts = result if isinstance(result, (tuple, list)) else (result,)
    out: dict[str, Any] = {}
    for part in parts:
        if isinstance(part, torch.Tensor):
            out.setdefault("keep" if part.dtype == torch.bool else "loss", part)
        elif isinstance(part, Mapping):
            out.setdefault("metrics", part)
    return out


def _numbers(metrics: Mapping[Any, Any]) -> dict[str, Any]:
    # A framework's metrics dict also carries lists, strings or per-token tensors: only scalars are recorded.
    return {
        key: value
        for key, value in metrics.items()
        if isinstance(key, str)
        and (
            (isinstance(value, (int, float)) and not isinstance(value, bool))
            or (isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype != torch.bool)
        )
    }


def read_call(
    function: str, readers: Mapping[str, Reader | None], signature: inspect.Signature | None, args: tuple, kwargs: dict, result: Any
) -> dict[str, Any]:
    bound = None
    if signature is not None:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
    parsed = None
    out: dict[str, Any] = {}
    for ours in (*INPUTS, *OUTPUTS):
        reader = readers.get(ours, MISSING)
        if reader is None:
            continue
        value = MISSING
        if reader is not MISSING:
            try:
                value = reader.read(bound, args, kwargs, result)
            except ValueError:
                raise
            except Exception as error:  # a caller's callable failing is named, not a bare traceback
                raise ValueError(f"watch({function}): reading {ours!r} through {reader.what} failed: {error!r}") from error
        if value is MISSING and ours in OUTPUTS:
            parsed = _parse_result(result) if parsed is None else parsed
            value = parsed.get(ours, MISSING)
            if ours == "metrics" and value is not MISSING:
                value = _numbers(value)
        if value is not MISSING and value is not None:
            out[ours] = value
    return out
