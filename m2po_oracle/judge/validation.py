"""Does an implementation fail closed on invalid input?

Each probe starts from one clean batch and breaks one thing (a NaN on a valid token, a
missing ``behavior_logp``, a float mask, ...). An implementation should raise; one that
returns a result has silently accepted invalid input. These are warnings, reported apart
from equivalence, unless the user asks for strict validation.
"""

from __future__ import annotations

import linecache
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from m2po_oracle.errors import UnreadableReturn
from m2po_oracle.judge.contract import Implementation, captured_output, to_tensors
from m2po_oracle.oracle.batch import Batch

#: The clean batch every probe starts from: two rows, one padded.
CLEAN = Batch(
    logp=np.array([[-0.9, -1.2, -0.4], [-2.0, -0.7, np.nan]]),
    behavior_logp=np.array([[-1.0, -1.0, -0.5], [-1.8, -0.9, np.nan]]),
    advantages=np.array([[1.0, 1.0, 1.0], [-1.0, -1.0, np.nan]]),
    valid=np.array([[True, True, True], [True, True, False]]),
    tau=0.04,
)


@dataclass(frozen=True)
class Probe:
    name: str
    description: str
    corrupt: Callable[[dict[str, Any]], None]  # edits the keyword arguments in place
    argument: str = ""  # the contract argument it makes invalid


def _set(name: str, index: tuple[int, int], value: float) -> Callable[[dict[str, Any]], None]:
    def corrupt(kwargs: dict[str, Any]) -> None:
        tensor = kwargs[name].detach().clone()
        tensor[index] = value
        kwargs[name] = tensor.requires_grad_(name == "logp")

    return corrupt


def _replace(name: str, make: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], None]:
    def corrupt(kwargs: dict[str, Any]) -> None:
        kwargs[name] = make(kwargs)

    return corrupt


PROBES: tuple[Probe, ...] = (
    Probe(
        "behavior_logp_missing",
        "behavior_logp is None (rollout log-probs missing)",
        _replace("behavior_logp", lambda kw: None),
        "behavior_logp",
    ),
    Probe("nan_logp_on_valid_token", "NaN in logp on a valid token", _set("logp", (0, 1), math.nan), "logp"),
    Probe(
        "inf_behavior_logp_on_valid_token",
        "-inf in behavior_logp on a valid token",
        _set("behavior_logp", (1, 0), -math.inf),
        "behavior_logp",
    ),
    Probe("nan_advantage_on_valid_token", "NaN advantage on a valid token", _set("advantages", (0, 2), math.nan), "advantages"),
    Probe("mask_not_boolean", "mask given as float 0/1 instead of bool", _replace("mask", lambda kw: kw["mask"].float()), "mask"),
    Probe(
        "shape_mismatch",
        "advantages with one column more than logp",
        _replace("advantages", lambda kw: torch.zeros(kw["logp"].shape[0], kw["logp"].shape[1] + 1, dtype=kw["logp"].dtype)),
        "advantages",
    ),
    Probe("negative_tau", "tau = -0.1", _replace("tau", lambda kw: -0.1), "tau"),
    Probe("nan_tau", "tau = NaN", _replace("tau", lambda kw: math.nan), "tau"),
)


@dataclass(frozen=True)
class ProbeResult:
    probe: str
    description: str
    status: str  # rejected | warned | accepted | hung | crashed (on invalid input, or the process died) | not run
    message: str
    expected: str = "rejected"  # "warned" for a setting that is allowed, but only with a warning

    @property
    def as_expected(self) -> bool:
        return self.status == self.expected

    @property
    def ran(self) -> bool:
        """False when the invalid input could not reach the port (its adapter hands it none
        of the values carrying that argument): neither a refusal nor an acceptance."""
        return self.status != "not run"


def probe(name: str) -> Probe:
    for p in PROBES:
        if p.name == name:
            return p
    raise ValueError(f"probe: unknown name {name!r}; known: {', '.join(p.name for p in PROBES)}")


#: Exceptions that count as a deliberate refusal of invalid input; any other exception
#: comes from inside the implementation's arithmetic and is "crashed on invalid input".
REJECTING_EXCEPTIONS: tuple[str, ...] = ("ValueError", "TypeError")


def _named(error: BaseException, names: tuple[str, ...]) -> bool:
    """Whether ``error``'s class, or a base class, has one of ``names`` (bare or qualified)."""
    mro = type(error).__mro__
    return bool(({cls.__name__ for cls in mro} | {f"{cls.__module__}.{cls.__qualname__}" for cls in mro}) & set(names))


def is_rejection(error: BaseException, also: tuple[str, ...] = ()) -> bool:
    """Whether ``error`` is a deliberate refusal: an exception of a class named in ``also``
    (--validation-errors), or a ValueError/TypeError that a ``raise`` statement outside
    torch and NumPy raised (:func:`accidental_origin`: one from an operation on the invalid
    value, ``logp - None``, is the implementation meeting it unguarded)."""
    if also and _named(error, also) and not _named(error, REJECTING_EXCEPTIONS):
        return True
    return _named(error, REJECTING_EXCEPTIONS) and accidental_origin(error) is None


def classify(p: Probe | str, error: BaseException | None, also: tuple[str, ...] = ()) -> ProbeResult:
    """The probe's result for ``error`` (None: the call returned a result)."""
    p = probe(p) if isinstance(p, str) else p
    if error is None:
        return ProbeResult(
            p.name, p.description, "accepted", "returned a result instead of raising: the invalid input was silently accepted"
        )
    text = "; ".join([f"{type(error).__name__}: {error}", *getattr(error, "__notes__", ())])
    if isinstance(error, UnreadableReturn):  # raised after the port returned: it did not refuse
        return ProbeResult(
            p.name,
            p.description,
            "accepted",
            f"returned a result instead of raising (one its adapter could not read: {error}): the invalid input was silently accepted",
        )
    if is_rejection(error, also):
        return ProbeResult(p.name, p.description, "rejected", text)
    if _named(error, REJECTING_EXCEPTIONS):
        return ProbeResult(
            p.name,
            p.description,
            "crashed",
            f"crashed on invalid input (a {type(error).__name__} from an operation, "
            f"not a raise statement: {accidental_origin(error)}; not a deliberate refusal): {text}",
        )
    return ProbeResult(p.name, p.description, "crashed", f"crashed on invalid input (not a deliberate ValueError/TypeError): {text}")


#: Libraries whose own argument checks raise TypeError/ValueError: such an exception is the
#: port handing them an invalid value, not the port refusing it.
_LIBRARY_ROOTS = tuple(str(Path(cast(str, module.__file__)).parent) for module in (torch, np))  # packages: __file__ is set


def accidental_origin(error: BaseException) -> str | None:
    """Where a ValueError/TypeError came from when it was no refusal: the innermost frame is
    not a ``raise`` statement (``None - tensor``, ``torch.sub(x, None)`` raise from inside an
    operation) or lies in torch's or NumPy's own code. None: a ``raise`` statement outside
    them, or no source to read (the benefit of the doubt)."""
    tb = error.__traceback__
    if tb is None:
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    filename, line = tb.tb_frame.f_code.co_filename, tb.tb_lineno
    code = linecache.getline(filename, line).strip()
    if not code:
        return None
    where = f"{Path(filename).name}:{line} `{code[:80]}`"
    library = next((Path(root).name for root in _LIBRARY_ROOTS if filename.startswith(root)), None)
    if library is not None:
        return f"inside {library}'s own code at {where}"
    return None if re.search(r"\braise\b", code) else f"at {where}"


#: The adapter roles through which each probed argument reaches a port (ppo_kl and the log
#: ratio are built from logp and behavior_logp, the config carries the budget). The mask is
#: not listed: it shapes everything an adapter hands over (packing, lengths).
_CARRIERS = {
    "logp": ("logp", "ppo_kl", "log_ratio"),
    "behavior_logp": ("behavior_logp", "ppo_kl", "log_ratio"),
    "advantages": ("advantages",),
    "tau": ("budget", "config"),
}


def unreachable(fn: Implementation, p: Probe) -> str | None:
    """Why the probe's invalid input cannot reach an adapted port (None: it can, or ``fn``
    is called directly)."""
    call = getattr(fn, "bound_call", None)
    carriers = _CARRIERS.get(p.argument)
    if call is None or carriers is None or any(call.receiving(role) is not None for role in carriers):
        return None
    passed = carriers[0] if len(carriers) == 1 else f"any of {', '.join(carriers)}"
    return f"the port takes no {p.argument} (its adapter, {call.family}, passes it no {passed}): this invalid input cannot reach it"


def run_probe(
    fn: Implementation, name: str, *, dtype: str = "float64", device: str = "cpu", rejecting: tuple[str, ...] = ()
) -> ProbeResult:
    """Call ``fn`` once with the probe's invalid input; never raises because of ``fn``."""
    p = probe(name)
    why = unreachable(fn, p)
    if why is not None:
        return ProbeResult(p.name, p.description, "not run", why)
    kwargs: dict[str, Any] = dict(to_tensors(CLEAN, dtype, device), tau=CLEAN.tau)
    p.corrupt(kwargs)
    tau = kwargs.pop("tau")
    try:
        with captured_output():
            fn(kwargs["logp"], kwargs["behavior_logp"], kwargs["advantages"], kwargs["mask"], tau=tau)
    except (Exception, SystemExit) as error:
        # A return the adapter could not read is an answer (the port returned): no control needed.
        control = None if isinstance(error, UnreadableReturn) else _fails_on_clean(fn, dtype, device)
        if control is not None:
            who = "the port" if getattr(fn, "bound_call", None) is not None else "the implementation"
            return ProbeResult(
                p.name,
                p.description,
                "not run",
                f"{who} raises on the valid batch this probe starts from too ({control}), so its answer to the invalid "
                "input cannot be told from that failure",
            )
        return classify(p, error, rejecting)
    return classify(p, None)


def _fails_on_clean(fn: Implementation, dtype: str, device: str) -> str | None:
    """What ``fn`` raises on the probes' clean batch (None: it returns). A probe's exception
    means a refusal only where the same call without the invalid input goes through."""
    kwargs = to_tensors(CLEAN, dtype, device)
    try:
        with captured_output():
            fn(kwargs["logp"], kwargs["behavior_logp"], kwargs["advantages"], kwargs["mask"], tau=CLEAN.tau)
    except (Exception, SystemExit) as error:
        return f"{type(error).__name__}: {error}"
    return None
