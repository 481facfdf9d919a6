"""Bindings: how an adapter's inputs reach a port's parameters, and its results come back.

A family (:mod:`m2po_oracle.adapters.families`) fixes the shape of a call: the roles it
passes, in the family's order, and where the results are in what the port returns. Ports
of one family still differ in names and order; ``--bind KEY=VALUE`` (repeatable) says how:

* KEY an **input role** of the family (``logp``, ``behavior_logp``, ``advantages``, ``mask``,
  ``budget``, ...): VALUE is where it goes: a parameter name (``budget=M2_budget``), a
  position (``budget=4``, 0-based) or a path into an object argument
  (``budget=config.policy_loss.m2_budget``);
* KEY a **constant** of the family (``loss_agg_mode``, ``miniclip_low``, ...): VALUE is its value;
* KEY an **output** (``loss``, ``keep``, ``per_token_loss``, ``metrics``, or a metric name such
  as ``m2_before``): VALUE is where it is in the return: an index into a returned tuple
  (``loss=0``), a key of a returned mapping, or a path of both (``m2_after=4.M2_after``);
* any other KEY: an extra keyword argument of the port, VALUE its value (``clip_ratio_c=3.0``).

Values are Python literals (``ast.literal_eval``: ``None``, ``0.3``, ``'token-mean'``), else
kept as strings. Without a binding a role goes to the port's parameter of the family's name
if it has one, else (unless the role is optional) to the family's position. A binding the
port's signature cannot take is a :class:`~m2po_oracle.errors.UsageError` naming the
signature (``inspect.signature``).
"""

from __future__ import annotations

import ast
import copy
import inspect
import numbers
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from m2po_oracle.errors import UnreadableReturn, UsageError
from m2po_oracle.oracle.record import COUNT_FIELDS, METRIC_FIELDS, METRIC_SOURCES

#: Our metric and count names: each can be an output bound to a place in the return.
METRIC_NAMES: tuple[str, ...] = METRIC_FIELDS + COUNT_FIELDS
#: Names ports log that mean exactly one of ours, beside our own names. Case matters: the
#: authors' release logs ``M2_after`` as its capped mean, which is not our m2_after (the
#: mean over the kept trust-region tokens), so it is not mapped. Its ``m2po/M2`` (and the
#: verl pull request's ``m2po/m2``) is the candidates' mean M2 before any cap: m2_before.
METRIC_ALIASES: dict[str, str] = {"M2_now": "m2_before", "m2_now": "m2_before", "M2": "m2_before", "m2": "m2_before"}
#: Prefixes ports put before a metric's name ("m2po/masked_fraction", "actor/m2po_m2_before").
METRIC_PREFIXES: tuple[str, ...] = ("m2po_", "m2po.", "m2po-")


class _NoValue:
    def __repr__(self) -> str:
        return "<computed by the adapter>"


#: A parameter whose value the adapter computes from the batch (not a constant).
COMPUTED: Any = _NoValue()


class _PortDefault:
    def __repr__(self) -> str:
        return "<the port's own default>"


#: An optional constant passed only where bound: otherwise the port's own default applies
#: (the release's miniclip floors 0.3 / 0.5 are part of the release as shipped).
PORT_DEFAULT: Any = _PortDefault()


@dataclass(frozen=True)
class Param:
    """One argument a family passes: ``role`` (the binding key) under the family's ``name``.

    ``name`` may be a path (``config.policy_loss.m2_budget``): the value is then set inside
    the object passed as the path's first parameter. A constant has a ``value``; binding its
    role sets another value. An optional parameter reaches only a parameter of its name (or
    where bound): ports that lack it are called without it."""

    role: str
    name: str
    optional: bool = False
    value: Any = COMPUTED

    @property
    def constant(self) -> bool:
        return self.value is not COMPUTED

    @property
    def is_path(self) -> bool:
        return "." in self.name

    def text(self) -> str:
        shown = f"{self.name}={self.value!r}" if self.constant else self.name
        return f"[{shown}]" if self.optional else shown


@dataclass(frozen=True)
class Output:
    """Where a result is in what the port returns: a path of tuple indices and mapping keys.

    A bare return (not a tuple, list or mapping) is its own element 0; a mapping is read by
    the role's name when the path starts with an index. An optional output that is not
    there is None; a missing required one makes the call a finding naming the binding."""

    role: str
    at: tuple[int | str, ...]
    optional: bool = False

    def text(self) -> str:
        return f"{self.role} at {_path_text(self.at)}" + (" (if returned)" if self.optional else "")


class Config(Mapping):
    """The config object handed to ports that read settings from one: attribute access
    (``config.policy_loss.m2_budget``), ``config.get(name, default)``, ``config[name]`` and
    ``name in config``, as verl's dataclass configs allow."""

    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)

    def __getitem__(self, name: str) -> Any:
        return self.__dict__[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.__dict__)

    def __len__(self) -> int:
        return len(self.__dict__)

    def get(self, name: str, default: Any = None) -> Any:
        return self.__dict__.get(name, default)

    def __repr__(self) -> str:
        return "Config(" + ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items()) + ")"


def parse_value(text: str) -> Any:
    """A binding's value: a Python literal if it is one, else the text itself."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


def parse_bindings(bindings: tuple[str, ...] | list[str]) -> dict[str, str]:
    """``KEY=VALUE`` texts as an ordered dict KEY -> VALUE text (a UsageError naming the bad one)."""
    parsed: dict[str, str] = {}
    for text in bindings:
        key, sep, value = text.partition("=")
        key = key.strip()
        if not sep or not all(part.isidentifier() for part in key.split(".")):
            raise UsageError(
                f"bind: expected KEY=VALUE with KEY an identifier (a role, an output or a parameter of the port) "
                f"or PARAMETER.ATTRIBUTE... (a setting inside an argument), got {text!r}"
            )
        if key in parsed:
            raise UsageError(f"bind: {key} is bound twice ({key}={parsed[key]} and {text}); give each key once")
        parsed[key] = value.strip()
    return parsed


def bound_metric_names(bindings: tuple[str, ...] | list[str]) -> frozenset[str]:
    """The metric names ``bindings`` read back from a place in the return."""
    return frozenset(key for key in parse_bindings(bindings) if key in METRIC_NAMES)


def _path(text: str) -> tuple[int | str, ...]:
    """``"4.M2_after"`` -> ``(4, "M2_after")``: digits are indices, the rest keys."""
    parts = text.split(".")
    if not text or any(not p for p in parts):
        raise ValueError(text)
    return tuple(int(p) if p.lstrip("-").isdigit() else p for p in parts)


def _path_text(path: tuple[int | str, ...]) -> str:
    return "the return" if not path else "".join(f"[{p}]" if isinstance(p, int) else f"[{p!r}]" for p in path)


def map_metric_name(key: Any) -> str | None:
    """Our name for a metric a port logs under ``key`` (None: no clear meaning of ours)."""
    if not isinstance(key, str):
        return None
    base = key.rsplit("/", 1)[-1]
    for prefix in METRIC_PREFIXES:
        if base.startswith(prefix):
            base = base[len(prefix) :]
    base = METRIC_ALIASES.get(base, base)
    return base if base in METRIC_NAMES else None


def logged_metrics(logged: Mapping) -> tuple[dict[str, Any], dict[str, Any]]:
    """Our metrics among what a port logged (a call's return, a training run's log), each
    under our name (:func:`map_metric_name`, the first key that means it), and the key each
    was read from. The one reading of a logged metric: ``compare --adapter`` and the audit
    judge the same keys."""
    found: dict[str, Any] = {}
    keys: dict[str, Any] = {}
    for key, value in logged.items():
        name = map_metric_name(key)
        if name is not None and name not in found and _is_number(value):
            found[name], keys[name] = value, key
    return found, keys


def _is_number(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def describe_signature(fn: Callable[..., Any], signature: inspect.Signature | None = None) -> str:
    """``name(params)`` of ``fn`` (its own signature when none is given)."""
    if signature is None:
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):
            signature = None
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    return f"{name}{signature}" if signature is not None else f"{name}(...) (its signature cannot be inspected)"


@dataclass(frozen=True)
class _Source:
    """What one parameter of the port receives: a role's value, or a constant."""

    role: str | None
    value: Any = None
    constant: str | None = None  # the constant's role, for messages

    def text(self) -> str:
        if self.role is not None:
            return f"<{self.role}>"
        return f"{self.value!r} (the constant {self.constant})" if self.constant else repr(self.value)


class BoundCall:
    """One port called the way one family and the user's bindings say.

    ``call(**role_values)`` calls the port; ``read(returned, role)`` and
    ``metrics(returned)`` take the results back. Built by :func:`bind`, which checks every
    binding against the port's signature."""

    def __init__(
        self,
        family: str,
        fn: Callable[..., Any],
        params: tuple[Param, ...],
        outputs: tuple[Output, ...],
        bindings: tuple[str, ...] | list[str] = (),
    ) -> None:
        self.family, self.fn, self.bindings = family, fn, tuple(bindings)
        try:
            self.signature: inspect.Signature | None = inspect.signature(fn)
        except (TypeError, ValueError):
            self.signature = None
        self.signature_text = describe_signature(fn, self.signature)
        self._params = params
        self._bound = parse_bindings(bindings)
        self._resolve(params, outputs, self._bound)

    # --- resolution ---------------------------------------------------------------------

    def _refuse(self, what: str) -> UsageError:
        roles = ", ".join(p.role for p in self._params)
        return UsageError(
            f"{what}; the port's signature is {self.signature_text} (adapter {self.family} passes {roles}; see m2po-oracle adapters)"
        )

    def _resolve(self, params: tuple[Param, ...], outputs: tuple[Output, ...], bound: dict[str, str]) -> None:
        sig = self.signature
        parameters = list(sig.parameters.values()) if sig is not None else []
        kinds = inspect.Parameter
        self._names = [p.name for p in parameters if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)]
        self._positional = [p.name for p in parameters if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
        self._positional_only = {p.name for p in parameters if p.kind == kinds.POSITIONAL_ONLY}
        self._var_keyword = any(p.kind == kinds.VAR_KEYWORD for p in parameters)
        roles = {p.role: p for p in params}
        output_roles = {o.role: o for o in outputs}
        # parameter name (or, uninspectable, "#i" for position i) -> what it receives
        self._targets: dict[str, _Source] = {}
        self._paths: list[tuple[str, str, tuple[str, ...]]] = []  # (role, head parameter, attribute path)
        #: Settings put inside an argument (a port that reads config.miniclip_low): (head, path, value).
        self._settings: list[tuple[str, tuple[str, ...], Any]] = []
        pending: list[tuple[int, Param]] = []
        family_positions = [p for p in params if not p.is_path]

        for param in params:
            text = bound.get(param.role)
            position = family_positions.index(param) if param in family_positions else None
            if param.constant:
                if param.value is PORT_DEFAULT and text is None:
                    continue
                place = self._setting_place(text)
                if place is not None:  # the family's constant, read by the port from inside an argument
                    self._settings.append((place[0], place[1], param.value))
                    continue
                if self._has(param.name):
                    self._claim(param.name, self._source_of(param, bound), param.role)
                elif not param.optional and position is not None:
                    pending.append((position, param))
                elif text is not None and self._var_keyword:
                    self._claim(param.name, self._source_of(param, bound), param.role)
                elif text is not None:
                    raise self._refuse(f"bind {param.role}={text}: the port has no parameter {param.name!r} to take it")
                continue
            if text is not None:
                self._place(param, text)
            elif param.is_path:
                continue  # placed below, once it is known which parameter receives the path's object
            elif self._has(param.name):
                self._claim(param.name, _Source(param.role), param.role)
            elif not param.optional:
                assert position is not None
                pending.append((position, param))
        # Roles without a parameter of their name go to the family's position, after every
        # name has been claimed (so a later role's name is never taken by position).
        for position, param in pending:
            if self.signature is None:
                self._claim(f"#{position}", self._source_of(param, bound), param.role)
                continue
            if position >= len(self._positional):
                raise self._refuse(
                    f"{param.role}: the port has no parameter {param.name!r} and no argument {position} (0-based) to take it; "
                    f"bind it (--bind {param.role}=NAME)"
                    if not param.constant
                    else f"{param.role}: the port has no parameter {param.name!r}; give its value under the port's name (--bind NAME=VALUE)"
                )
            name = self._positional[position]
            if name in self._targets:
                raise self._refuse(
                    f"{param.role}: the port has no parameter {param.name!r}, and its argument {position} ({name!r}) already "
                    f"takes {self._targets[name].text()}; bind it (--bind {param.role}=NAME)"
                )
            self._claim(name, self._source_of(param, bound), param.role)
        # A default path (budget at config.policy_loss.m2_budget) starts at a family
        # parameter: it goes into whatever parameter of the port receives that one's role.
        by_family_name = {p.name: p.role for p in params if not p.is_path}
        for param in params:
            if not param.is_path or param.role in bound:
                continue
            head, *rest = param.name.split(".")
            receiving = [n for n, source in self._targets.items() if source.role is not None and source.role == by_family_name.get(head)]
            if receiving:
                self._paths.append((param.role, receiving[0], tuple(rest)))
            elif self._has(head):
                self._paths.append((param.role, head, tuple(rest)))
            elif not param.optional:
                raise self._refuse(
                    f"{param.role}: the adapter puts it at {param.name}, but the port takes no {head!r}; "
                    f"bind it (--bind {param.role}=NAME, or =PARAMETER.ATTRIBUTE for a place inside an argument)"
                )

        self._outputs: dict[str, Output] = dict(output_roles)
        for key, text in bound.items():
            if key in roles:
                continue
            if key in output_roles or key in METRIC_NAMES:
                try:
                    self._outputs[key] = Output(key, _path(text), optional=False)
                except ValueError:
                    raise self._refuse(
                        f"bind {key}={text}: expected where {key} is in the return: an index (0), a key, or a path such as 4.M2_after"
                    ) from None
                continue
            if "." in key:  # a setting inside an argument: config.miniclip_low=0.3
                head, *rest = key.split(".")
                if not self._has(head) and not (self.signature is None or self._var_keyword):
                    raise self._refuse(f"bind {key}={text}: the port has no parameter {head!r} to hold the setting {'.'.join(rest)}")
                self._settings.append((head, tuple(rest), parse_value(text)))
                continue
            # Anything else is an extra keyword argument of the port.
            if self.signature is not None and not (key in self._names or self._var_keyword):
                raise self._refuse(
                    f"bind {key}={text}: {key!r} is neither a role of adapter {self.family} "
                    f"(inputs: {', '.join(roles)}; outputs: {', '.join(output_roles)} or a metric name) "
                    f"nor a parameter of the port"
                )
            self._claim(key, _Source(None, parse_value(text)), f"{key}={text}")

        if self.signature is not None:
            heads = {head for _, head, _ in self._paths} | {head for head, _, _ in self._settings}
            missing = [
                p.name
                for p in parameters
                if p.default is kinds.empty
                and p.kind not in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD)
                and p.name not in self._targets
                and p.name not in heads
            ]
            if missing:
                raise self._refuse(
                    f"the port's parameter(s) {', '.join(repr(m) for m in missing)} would receive nothing "
                    f"(the call would be {self.describe_call()}); bind a role to each (--bind ROLE=NAME) "
                    f"or give its value (--bind NAME=VALUE)"
                )
            gaps = [
                n
                for i, n in enumerate(self._positional)
                if n in self._positional_only
                and n not in self._targets
                and any(m in self._targets for m in self._positional[i + 1 :] if m in self._positional_only)
            ]
            if gaps:
                raise self._refuse(f"the port's positional-only parameter(s) {', '.join(gaps)} would receive nothing before later ones")

    def _setting_place(self, text: str | None) -> tuple[str, tuple[str, ...]] | None:
        """``config.loss_agg_mode`` as (head, path) when ``text`` names a place inside one of
        the port's parameters (a constant's value moved there), else None (a plain value)."""
        if text is None or "." not in text or not all(part.isidentifier() for part in text.split(".")):
            return None
        head, *rest = text.split(".")
        return (head, tuple(rest)) if self._has(head) else None

    def _source_of(self, param: Param, bound: dict[str, str]) -> _Source:
        if param.constant:
            text = bound.get(param.role)
            return _Source(None, parse_value(text) if text is not None else param.value, param.role)
        return _Source(param.role)

    def _has(self, name: str) -> bool:
        return self.signature is not None and name in self._names

    def _claim(self, name: str, source: _Source, by: str) -> None:
        if name in self._targets:
            raise self._refuse(f"{by}: the port's parameter {name!r} already takes {self._targets[name].text()}")
        self._targets[name] = source

    def _place(self, param: Param, text: str) -> None:
        """An input role bound to a parameter name, a position or a path into an argument."""
        where = parse_value(text)
        if isinstance(where, int) and not isinstance(where, bool):
            if self.signature is None:
                self._claim(f"#{where}", _Source(param.role), f"{param.role}={text}")
                return
            if not 0 <= where < len(self._positional):
                raise self._refuse(
                    f"bind {param.role}={text}: the port has {len(self._positional)} positional parameters (0-based positions "
                    f"0..{len(self._positional) - 1})"
                )
            self._claim(self._positional[where], _Source(param.role), f"{param.role}={text}")
            return
        if not isinstance(where, str) or not all(part.isidentifier() for part in where.split(".")):
            raise self._refuse(f"bind {param.role}={text}: expected a parameter name, a 0-based position or PARAMETER.ATTRIBUTE...")
        head, *rest = where.split(".")
        if not self._has(head):
            raise self._refuse(f"bind {param.role}={text}: the port has no parameter {head!r}")
        if rest:
            self._paths.append((param.role, head, tuple(rest)))
        else:
            self._claim(head, _Source(param.role), f"{param.role}={text}")

    # --- calling ------------------------------------------------------------------------

    def receiving(self, role: str) -> str | None:
        """Where the port takes ``role``: a parameter, or a place inside one (None: nowhere)."""
        named = next((name for name, source in self._targets.items() if source.role == role), None)
        if named is not None:
            return named
        return next((".".join((head, *rest)) for path_role, head, rest in self._paths if path_role == role), None)

    def __call__(self, **values: Any) -> Any:
        """Call the port with the roles' values (a role the port does not take is dropped)."""
        arguments: dict[str, Any] = {}
        for name, source in self._targets.items():
            arguments[name] = values[source.role] if source.role is not None else copy.deepcopy(source.value)
        for role, head, path in self._paths:
            if head not in arguments:  # a parameter only a path reaches: a fresh config object
                arguments[head] = Config()
            _set_path(arguments[head], path, values[role])
        for head, path, value in self._settings:
            if head not in arguments:
                arguments[head] = Config()
            _set_path(arguments[head], path, copy.deepcopy(value))
        if self.signature is None:
            positions = sorted(int(n[1:]) for n in arguments if n.startswith("#"))
            args = [arguments.pop(f"#{i}") for i in positions]
            return self.fn(*args, **arguments)
        args = [arguments.pop(n) for n in self._positional if n in self._positional_only and n in arguments]
        return self.fn(*args, **arguments)

    def read(self, returned: Any, role: str) -> Any:
        """The output ``role`` of ``returned`` (None for an optional one that is not there)."""
        output = self._outputs[role]
        value, problem = _follow(returned, output.at, role)
        if problem is None:
            return value
        if output.optional:
            return None
        how = f"--bind {role}={self._bound[role]}" if role in self._bound else f"adapter {self.family}'s default"
        raise UnreadableReturn(f"{role}: expected at {_path_text(output.at)} of the return ({how}); {problem}")

    def metrics(self, returned: Any) -> dict[str, Any]:
        """Our metrics from ``returned``: the ``metrics`` output's keys mapped to our names
        (:func:`map_metric_name`), then every metric bound to a place of its own."""
        found: dict[str, Any] = {}
        sources: dict[str, str] = {}
        if "metrics" in self._outputs:
            logged, at = self._logged(returned)
            found, keys = logged_metrics(logged)
            sources = {name: _path_text((*at, key)) for name, key in keys.items()}
        for name in METRIC_NAMES:
            if name in self._outputs:
                found[name] = self.read(returned, name)
                sources[name] = _path_text(self._outputs[name].at)
        # Where each metric was read (a key of the port's own naming, e.g. its 'm2' read as
        # m2_before), so that a report says which of the port's values it judged.
        return {**found, METRIC_SOURCES: sources} if found else found

    def _logged(self, returned: Any) -> tuple[Mapping, tuple[int | str, ...]]:
        """What the port logged, and where in its return: the ``metrics`` output; unless
        bound elsewhere, a returned mapping is itself the metrics (beside loss and keep), and
        so is a result object (its attributes of our names)."""
        if "metrics" not in self._bound:
            if isinstance(returned, Mapping):
                return returned, ()
            if not isinstance(returned, (tuple, list, torch.Tensor)):
                return {name: getattr(returned, name) for name in METRIC_NAMES if getattr(returned, name, None) is not None}, ()
        logged = self.read(returned, "metrics")
        return (logged if isinstance(logged, Mapping) else {}), self._outputs["metrics"].at

    def describe_call(self) -> str:
        """The call the port receives, e.g. ``port(old_log_prob=<behavior_logp>, ..., M2_budget=<budget>)``."""
        if self.signature is None:
            ordered = sorted(self._targets.items(), key=lambda item: (not item[0].startswith("#"), item[0]))
        else:
            order = {n: i for i, n in enumerate(self._names)}
            ordered = sorted(self._targets.items(), key=lambda item: order.get(item[0], len(order)))
        shown = lambda source: f"<{source.role}>" if source.role is not None else repr(source.value)  # noqa: E731
        parts = [shown(source) if name.startswith("#") else f"{name}={shown(source)}" for name, source in ordered]
        parts += [f"{head}.{'.'.join(path)}=<{role}>" for role, head, path in self._paths]
        parts += [f"{head}.{'.'.join(path)}={value!r}" for head, path, value in self._settings]
        name = getattr(self.fn, "__name__", "port")
        outputs = "; ".join(o.text() for o in self._outputs.values())
        return f"{name}({', '.join(parts)}) -> {outputs}"


def _set_path(target: Any, path: tuple[str, ...], value: Any) -> None:
    for i, part in enumerate(path):
        last = i == len(path) - 1
        if isinstance(target, dict):
            if last:
                target[part] = value
            else:
                target = target.setdefault(part, Config())
            continue
        if last:
            setattr(target, part, value)
        else:
            child = getattr(target, part, None)
            if child is None:
                child = Config()
                setattr(target, part, child)
            target = child


def _follow(value: Any, path: tuple[int | str, ...], role: str) -> tuple[Any, str | None]:
    """The element of ``value`` at ``path`` and None, or None and what was there instead."""
    for step in path:
        if isinstance(value, (tuple, list)):
            if not isinstance(step, int):
                return None, f"got a {type(value).__name__} of {len(value)} elements where a key {step!r} was expected"
            if not -len(value) <= step < len(value):
                return None, f"got a {type(value).__name__} of {len(value)} elements"
            value = value[step]
        elif isinstance(value, Mapping):
            key = role if isinstance(step, int) else step  # a mapping holds an output under its role's name
            if key not in value:
                return None, f"got a mapping with keys {sorted(map(str, value))}"
            value = value[key]
        elif isinstance(step, int):
            if hasattr(value, role) and not isinstance(value, torch.Tensor):  # a result object: the output by its name
                value = getattr(value, role)
            elif step != 0:  # a bare return is its own element 0
                return None, f"got a single {type(value).__name__}, not a tuple"
        else:
            if not hasattr(value, step):
                return None, f"got a {type(value).__name__} without {step!r}"
            value = getattr(value, step)
    return value, None
