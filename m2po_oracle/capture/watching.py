"""Record a framework's own M2PO call(s) in one line, without editing the framework.

This module and :mod:`.watch_reading` (how a name is read from a call) import torch, the
standard library and each other only (not even ``recorder.py``: ``watch`` drives any object
with ``record(...)`` and ``every``, a :class:`m2po_oracle.capture.recorder.Recorder`), so a
framework can vendor the two as one package folder beside ``recorder.py``;
``from m2po_oracle.capture import watch`` reaches it too. ::

    from m2po_oracle import capture
    recorder = capture.Recorder("runs/capture", rank=rank, world_size=world, topology="dp=1,cp=1,tp=1")
    with capture.watch(framework_module, "compute_m2po_token_loss", recorder, optimizer=optimizer,
                       inputs={"logp": lambda args, kwargs, result: state.logp, "behavior_logp": ...}):
        trainer.train()                                  # the framework runs unchanged
    # m2po-oracle audit runs/capture

``watch(target, name, recorder, *, optimizer=None, step=None, inputs=None, outputs=None)``
replaces ``target.name`` (a function of a module, or a method of a class or of one object:
plain, static or class method) by a wrapper and puts the original back on ``close()`` or when
the ``with`` block ends. ``name`` may be a sequence of names (a mask function and a loss
function, with ``inputs`` / ``outputs`` then optionally keyed by function name); two
``watch`` calls on one recorder share its step and micro-batch counters, as one does. What
is read, when a record is written, and what the wrapper leaves untouched: the how-to
"Auditing a training run", section "What watch reads, and when it records".
"""

from __future__ import annotations

import inspect
import threading
import types
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

# Relative, so that the two files vendor together as one package folder under any name.
from .watch_reading import ALIASES, INPUTS, OUTPUTS, REQUIRED, SPEC_FORMS, default_readers, read_call, reader_for

__all__ = ["ALIASES", "INPUTS", "OUTPUTS", "Watcher", "watch"]

# ---------------------------------------------------------------------------------------------
# The step, the micro-batch counter and the open records, shared by every watch of one recorder.


@dataclass
class _Unit:
    """One micro-batch's record while it waits for its backward."""

    step: int
    micro_batch: int
    values: dict[str, Any]
    sources: list[str]  # the functions it was read from, for messages
    handles: list[Any] = field(default_factory=list)
    share: float | None = None  # from the per-token loss's hook
    done: bool = False


class _Session:
    def __init__(self, recorder: Any) -> None:
        self.recorder = recorder
        self.step_source: object = None
        self.optimizer_step = 0
        self.step_hook: Any = None
        self.last_step: int | None = None
        self.next_micro_batch = 0
        self.active: dict[str, Any] | None = None  # readings of the outermost watched call in progress
        self.open: list[_Unit] = []  # mask-only records a loss call may still take
        self.lock = threading.Lock()
        self.watchers = 0
        self.records = 0

    def step(self) -> int:
        if callable(self.step_source):
            value = self.step_source()
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"watch(step=...): the step callable must return an integer >= 0, got {value!r}")
            return value
        return self.optimizer_step

    def micro_batch(self, step: int) -> int:
        if step != self.last_step:
            self.last_step, self.next_micro_batch = step, 0
            self.open = [unit for unit in self.open if unit.step == step]
        self.next_micro_batch += 1
        return self.next_micro_batch - 1

    def advance(self, *_: Any) -> None:
        self.optimizer_step += 1


_SESSIONS: weakref.WeakKeyDictionary[Any, _Session] = weakref.WeakKeyDictionary()
_SESSIONS_LOCK = threading.Lock()


# ---------------------------------------------------------------------------------------------
# The wrapper.


@dataclass
class _Wrapped:
    target: Any
    name: str
    raw: Any  # what target.__dict__ held (None: inherited or instance-bound)
    owned: bool  # name was in target.__dict__ (restore it) or not (delete ours)
    wrapper: Any


class Watcher:
    """The watch of one or more attributes; :meth:`close` (or leaving ``with``) restores them."""

    def __init__(self, session: _Session, wrapped: list[_Wrapped], owns_step_hook: bool) -> None:
        self._session = session
        self._wrapped = wrapped
        self._owns_step_hook = owns_step_hook
        self.closed = False

    @property
    def records(self) -> int:
        """Records written through this recorder's watches (micro-batches whose backward ran)."""
        return self._session.records

    @property
    def step(self) -> int:
        """The optimizer step the next call would be recorded at."""
        return self._session.step()

    def close(self) -> None:
        """Put the original attributes back; records still waiting for a backward are dropped."""
        if self.closed:
            return
        self.closed = True
        for item in reversed(self._wrapped):
            current = item.target.__dict__.get(item.name) if _has_dict(item.target) else None
            if item.owned:
                setattr(item.target, item.name, item.raw)
            elif current is not None:
                delattr(item.target, item.name)
        session = self._session
        with session.lock:
            session.watchers -= 1
            if self._owns_step_hook and session.step_hook is not None:
                session.step_hook.remove()
                session.step_hook = None
                session.step_source = None
            if session.watchers == 0:
                for unit in session.open:
                    _drop(unit)
                session.open.clear()
                session.step_source = None

    def __enter__(self) -> Watcher:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _has_dict(target: object) -> bool:
    return hasattr(target, "__dict__")


def _drop(unit: _Unit) -> None:
    for handle in unit.handles:
        handle.remove()
    unit.handles.clear()
    unit.done = True


def _per_function(option: object, names: tuple[str, ...], what: str) -> dict[str, Mapping[str, object]]:
    if option is None:
        return {name: {} for name in names}
    if not isinstance(option, Mapping):
        raise ValueError(f"watch({what}=...) must be a mapping of our names to how to read them, got {type(option).__name__}")
    if len(names) > 1 and option and set(option) <= set(names):
        for name, inner in option.items():
            if not isinstance(inner, Mapping):
                raise ValueError(f"watch({what}[{name!r}]) must be a mapping of our names to how to read them, got {type(inner).__name__}")
        return {name: option.get(name, {}) for name in names}
    return {name: option for name in names}


def watch(
    target: object,
    name: str | Iterable[str],
    recorder: Any,
    *,
    optimizer: Any = None,
    step: Callable[[], int] | None = None,
    inputs: Mapping[str, object] | None = None,
    outputs: Mapping[str, object] | None = None,
) -> Watcher:
    """Wrap ``target.name`` so that every call of it is recorded into ``recorder`` (the module
    docstring says what is read and when); return the :class:`Watcher` that restores it."""
    names = (name,) if isinstance(name, str) else tuple(name) if isinstance(name, Iterable) else (name,)
    if not names or not all(isinstance(n, str) and n.isidentifier() for n in names):
        raise ValueError(f"name must be an attribute name (a str) or a sequence of them, got {name!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"name lists an attribute twice: {list(names)}")
    if (
        not callable(getattr(recorder, "record", None))
        or isinstance(getattr(recorder, "every", None), bool)
        or not isinstance(getattr(recorder, "every", None), int)
    ):
        raise ValueError(f"recorder must be an m2po_oracle.capture.recorder.Recorder (record() and every), got {type(recorder).__name__}")
    if optimizer is not None and step is not None:
        raise ValueError("pass one of optimizer= and step=, not both: the step must come from one place")
    if optimizer is not None and not callable(getattr(optimizer, "register_step_post_hook", None)):
        raise ValueError(
            f"optimizer must be a torch.optim.Optimizer (its register_step_post_hook advances the step), got {type(optimizer).__name__}"
        )
    if step is not None and not callable(step):
        raise ValueError(f"step must be a callable returning the optimizer step (lambda: trainer.state.global_step), got {step!r}")
    for what, option in (("inputs", inputs), ("outputs", outputs)):
        allowed = INPUTS if what == "inputs" else OUTPUTS
        flat = _per_function(option, names, what)
        for function, mapping in flat.items():
            unknown = [key for key in mapping if key not in allowed]
            if unknown:
                raise ValueError(f"watch({function}): {what} has unknown names {unknown}; expected some of {list(allowed)}")

    targets = []
    for attribute in names:
        try:
            inspect.getattr_static(target, attribute)
        except AttributeError:
            raise ValueError(f"target {_describe(target)} has no attribute {attribute!r} to watch") from None
        current = getattr(target, attribute)
        if not callable(current):
            raise ValueError(f"{_describe(target)}.{attribute} is {type(current).__name__}, expected a function or method")
        if getattr(current, "__m2po_watch__", None) is not None:
            raise ValueError(f"{_describe(target)}.{attribute} is already watched; close that watch first")
        targets.append(attribute)

    with _SESSIONS_LOCK:
        session = _SESSIONS.get(recorder)
        if session is None:
            session = _SESSIONS[recorder] = _Session(recorder)
    owns_step_hook = False
    with session.lock:
        source = optimizer if optimizer is not None else step
        if source is None and session.step_source is None:
            raise ValueError(
                "watch needs the optimizer step, which the audit judges each record by: pass optimizer= "
                "(a torch.optim.Optimizer; its steps are counted) or step= (a callable returning the step)"
            )
        if source is not None and session.step_source is not None and source is not session.step_source:
            raise ValueError("this recorder is already watched with another optimizer= or step=; pass the same one or none")
        if source is not None and session.step_source is None:
            session.step_source = source
            if optimizer is not None:
                session.optimizer_step, session.last_step = 0, None
                session.step_hook = optimizer.register_step_post_hook(session.advance)
                owns_step_hook = True
        session.watchers += 1

    inputs_of, outputs_of = _per_function(inputs, names, "inputs"), _per_function(outputs, names, "outputs")
    wrapped = []
    try:
        for attribute in targets:
            wrapped.append(_wrap(target, attribute, session, {**inputs_of[attribute], **outputs_of[attribute]}))
    except BaseException:
        Watcher(session, wrapped, owns_step_hook).close()
        raise
    watcher = Watcher(session, wrapped, owns_step_hook)
    for item in wrapped:
        item.wrapper.__m2po_watch__ = weakref.ref(watcher)
    return watcher


def _describe(target: object) -> str:
    if isinstance(target, types.ModuleType):
        return f"module {target.__name__}"
    if isinstance(target, type):
        return f"class {target.__qualname__}"
    return f"{type(target).__qualname__} object"


def _wrap(target: object, attribute: str, session: _Session, specs: Mapping[str, object]) -> _Wrapped:
    owned = _has_dict(target) and attribute in vars(target)
    raw = vars(target)[attribute] if owned else None
    kind = "plain"
    if isinstance(target, type) and isinstance(raw, (staticmethod, classmethod)):
        kind = type(raw).__name__
        original = raw.__func__
    elif isinstance(target, type):
        original = getattr(target, attribute) if raw is None else raw
    else:
        original = getattr(target, attribute)  # a module's function, or an object's bound method
    function = f"{getattr(original, '__qualname__', attribute)}"
    try:
        parameters: Mapping[str, inspect.Parameter] | None = inspect.signature(original).parameters
        signature: inspect.Signature | None = inspect.signature(original)
    except (TypeError, ValueError):
        parameters = signature = None  # a builtin without a signature: read keyword arguments only
    readers = default_readers(function, parameters)
    for ours, spec in specs.items():
        reader = reader_for(function, ours, spec, parameters)
        if reader is None:
            readers.pop(ours, None)
            readers[ours] = None
        else:
            readers[ours] = reader
    every = session.recorder.every

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        step = session.step()
        if step % every or not torch.is_grad_enabled():
            return original(*args, **kwargs)
        outer = session.active is None
        if outer:
            session.active = {}
        try:
            result = original(*args, **kwargs)
            readings = read_call(function, readers, signature, args, kwargs, result)
            assert session.active is not None  # set above by the outer call, reset only in its finally
            if outer:
                # The outer call's readings first; a nested mask call's fill what it lacks.
                readings = {**session.active, **readings}
                session.active.setdefault("sources", []).insert(0, function)
                _finish(session, step, readings, session.active["sources"])
            else:
                for key, value in readings.items():
                    session.active.setdefault(key, value)
                session.active.setdefault("sources", []).append(function)
        finally:
            if outer:
                session.active = None
        return result

    wrapper.__name__ = getattr(original, "__name__", attribute)
    wrapper.__qualname__ = getattr(original, "__qualname__", attribute)
    wrapper.__doc__ = getattr(original, "__doc__", None)
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]  # mypy: a function takes no new attributes (inspect.unwrap reads it)
    installed: Any = wrapper
    if kind == "staticmethod":
        installed = staticmethod(wrapper)
    elif kind == "classmethod":
        installed = classmethod(wrapper)
    setattr(target, attribute, installed)
    return _Wrapped(target, attribute, raw, owned, wrapper)


# ---------------------------------------------------------------------------------------------
# From readings to a record.


def _finish(session: _Session, step: int, readings: dict[str, Any], sources: list[str]) -> None:
    readings = {key: value for key, value in readings.items() if key != "sources"}
    if "loss" not in readings:
        unit = _Unit(step, session.micro_batch(step), readings, list(sources))
        _hook(session, unit, readings)
        session.open.append(unit)
        return
    taken = next((u for u in session.open if u.step == step and not u.done), None) if session.last_step == step else None
    if taken is not None:
        session.open.remove(taken)
        for handle in taken.handles:
            handle.remove()
        taken.handles.clear()
        unit = _Unit(step, taken.micro_batch, {**taken.values, **readings}, list(sources) + taken.sources)
    else:
        unit = _Unit(step, session.micro_batch(step), readings, list(sources))
    _check(unit)
    _hook(session, unit, unit.values)


def _gradient_tensor(values: Mapping[str, Any]) -> torch.Tensor | None:
    for name in ("logp", "log_ratio"):
        tensor = values.get(name)
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
            return tensor
    return None


def _hook(session: _Session, unit: _Unit, values: Mapping[str, Any]) -> None:
    tensor = _gradient_tensor(values)
    if tensor is None:
        if "loss" in values:
            raise ValueError(
                f"watch({', '.join(unit.sources)}): neither logp nor log_ratio of this call requires grad, so "
                f"d loss / d logp cannot be captured; read the tensor the loss is differentiated through "
                f"(inputs={{'logp': ...}} or {{'log_ratio': ...}})"
            )
        return  # a mask computed on detached log-probs: the loss call brings the tensor
    loss = values.get("loss")
    if isinstance(loss, torch.Tensor) and loss.numel() > 1 and loss.requires_grad:
        held = loss.detach()

        def share(grad: torch.Tensor) -> None:
            # The framework reduces the per-token loss after the call; a linear reduction's value
            # is sum(dL/dl * l). Tokens without gradient may hold NaN padding: they add nothing.
            zero = torch.zeros((), dtype=torch.float64, device=grad.device)
            weighted = torch.where(grad != 0, grad.double() * held.double(), zero)
            unit.share = float(weighted.sum())

        unit.handles.append(loss.register_hook(share))
    frozen = {key: value.detach() if isinstance(value, torch.Tensor) else value for key, value in values.items()}

    def complete(grad: torch.Tensor) -> None:
        if unit.done:
            return
        unit.done = True
        _record(session, unit, frozen, grad)

    unit.values = frozen
    unit.handles.append(tensor.register_hook(complete))


def _check(unit: _Unit) -> None:
    values = unit.values
    have = set(values)
    if "log_ratio" in have and len({"logp", "behavior_logp"} & have) == 1:
        have |= {"logp", "behavior_logp"}
    missing = [name for name in REQUIRED if name not in have]
    if not missing:
        return
    hints = []
    if "log_ratio" in values and {"logp", "behavior_logp"} & set(missing):
        hints.append(
            "the call passes a log-ratio, not the two log-probs: give inputs={'behavior_logp': ...} "
            "(or 'logp', or both) as an argument name or a callable (args, kwargs, result) -> tensor"
        )
    if "keep" in missing:
        hints.append(
            "keep is the bool mask of the tokens the M2PO selection kept: outputs={'keep': 'return[i]'} "
            "or an argument name, or watch the mask function too"
        )
    raise ValueError(
        f"watch({', '.join(unit.sources)}): cannot read {missing} at step {unit.step}, micro-batch {unit.micro_batch}; "
        f"expected each as {SPEC_FORMS}{' (tau: or a number)' if 'tau' in missing else ''} in inputs=/outputs="
        + (" (" + "; ".join(hints) + ")" if hints else "")
    )


def _record(session: _Session, unit: _Unit, values: dict[str, Any], grad: torch.Tensor) -> None:
    if "loss" not in values:
        _check(unit)
    logp, behavior, ratio = values.get("logp"), values.get("behavior_logp"), values.get("log_ratio")
    if logp is None:
        assert behavior is not None and ratio is not None  # _check: log_ratio and one log-prob stand for both
        logp = behavior + ratio.to(behavior.dtype)
    elif behavior is None:
        assert ratio is not None  # _check: as above
        behavior = logp - ratio.to(logp.dtype)
    loss = values.get("loss")
    if loss is None:
        share = float(grad.double().sum())  # the M2PO objective's value: see the module docstring
    elif loss.numel() == 1:
        share = float(loss.double())
    elif unit.share is not None:
        share = unit.share
    else:
        raise RuntimeError(
            f"watch({', '.join(unit.sources)}): the per-token loss of step {unit.step}, micro-batch {unit.micro_batch} "
            f"received no gradient while its log-probs did, so its share of the loss is unknown; "
            f"read a one-element loss instead (outputs={{'loss': ...}})"
        )
    advantages = values["advantages"]
    if advantages.shape != logp.shape:
        advantages = advantages.expand_as(logp)  # per sequence [B, 1] -> per token, as the loss broadcasts it
    session.recorder.record(
        step=unit.step,
        micro_batch=unit.micro_batch,
        logp=logp,
        behavior_logp=behavior,
        advantages=advantages,
        mask=values["mask"].bool(),
        keep=values["keep"].bool(),
        loss=share,
        tau=values["tau"],
        metrics=values.get("metrics"),
        selection_logp=values.get("selection_logp"),
        rollout_logp=values.get("rollout_logp"),
        grad=grad,
    )
    session.records += 1
