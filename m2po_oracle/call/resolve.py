"""Resolving an implementation's name to the callable it names.

A spec is a built-in name (``core``, ``control:NAME``), a name another installed package
registers in the ``m2po_oracle.implementations`` entry-point group,
``package.module:function`` or ``path/file.py:function``. Whole training steps
(``trainer``, ``trainer:...``) and distributed runs are opened as runners by
:mod:`m2po_oracle.cli.launch`; this module only finds callables.

Every failure is a :class:`LoadError` whose message names the spec and what was expected:
a syntax error reads ``file:line:col: message``, and "closest matches" come only from the
names a module defines itself (not the ones it merely imports).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from m2po_oracle.call import controls
from m2po_oracle.core.loss import m2po_loss
from m2po_oracle.errors import LoadError, closest
from m2po_oracle.judge.contract import Implementation, parse_impl

ENTRY_POINT_GROUP = "m2po_oracle.implementations"
#: Set to 1 to ignore implementations registered by other installed packages.
NO_PLUGINS_ENV = "M2PO_ORACLE_NO_PLUGINS"


def _registered() -> dict[str, Any]:
    """Implementations other packages register in the ``m2po_oracle.implementations`` group."""
    from importlib.metadata import entry_points

    if os.environ.get(NO_PLUGINS_ENV) == "1":
        return {}
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def builtin_implementations() -> dict[str, Implementation]:
    """Implementations shipped with the toolkit: the core and every negative control."""
    found: dict[str, Implementation] = {"core": m2po_loss}
    found.update({f"control:{c.name}": c.fn for c in controls.NEGATIVE_CONTROLS + controls.COMPOSITE_CONTROLS})
    return found


def known_names(also_known: Sequence[str] = ()) -> list[str]:
    """Every name ``--impl`` accepts without a ``module:``: built-ins, ``also_known`` (the
    trainer steps, which the rooms above name) and plugins."""
    return list(builtin_implementations()) + list(also_known) + list(_registered())


def load_implementation(spec: str, *, also_known: Sequence[str] = ()) -> Implementation:
    """The loss-function callable ``spec`` names (:class:`LoadError` otherwise); an unknown
    name is refused with the closest of the known names and ``also_known``."""
    parsed = parse_impl(spec)
    builtins = builtin_implementations()
    if spec in builtins:
        return builtins[spec]
    if parsed.kind == "trainer":
        raise LoadError(f"impl: {spec!r} is a whole training step, not a loss function; open it with m2po_oracle.cli.launch.open_runner")
    registered = _registered()
    if spec in registered:
        try:
            fn = registered[spec].load()
        except Exception as error:
            raise LoadError(
                f"impl: loading the registered implementation {spec!r} ({registered[spec].value}) failed: {_describe(error)}"
            ) from error
        if not callable(fn):
            raise LoadError(f"impl: the registered implementation {spec!r} is a {type(fn).__name__}, not a callable")
        return fn
    if parsed.kind == "name":
        names = known_names(also_known)
        hint = closest(spec, names, otherwise=f"; built-in names: {', '.join(sorted(names))}")
        raise LoadError(f"impl: unknown implementation {spec!r} (expected a built-in name, module:function or file.py:function){hint}")
    return load_attribute(spec)


def load_module(target: str) -> ModuleType:
    """The module ``target`` names: ``package.module`` or ``path/file.py``."""
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise LoadError(f"impl: file {target!r} does not exist")
        # Its folder goes last on sys.path, so that a wrapper imports the port file beside it
        # (as a script would) without hiding an installed package of the same name.
        folder = str(path.resolve().parent)
        if folder not in sys.path:
            sys.path.append(folder)
        module_spec = importlib.util.spec_from_file_location(f"m2po_impl_{path.stem}", path)
        assert module_spec is not None and module_spec.loader is not None  # a .py file: a spec with its source loader
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except BaseException as error:
            if isinstance(error, KeyboardInterrupt):
                raise
            raise LoadError(f"impl: importing {target!r} failed: {_describe(error)}") from error
        return module
    try:
        return importlib.import_module(target)
    except BaseException as error:
        if isinstance(error, KeyboardInterrupt):
            raise
        raise LoadError(f"impl: importing module {target!r} failed: {_describe(error)}") from error


def defined_names(module: ModuleType) -> list[str]:
    """Public names ``module`` defines itself: its functions and classes, not what it imports."""
    names = []
    for name, value in vars(module).items():
        if name.startswith("_"):
            continue
        if getattr(value, "__module__", None) == module.__name__:
            names.append(name)
    return names


def load_attribute(spec: str) -> Any:
    """The callable named by ``package.module:name`` or ``path/file.py:name``."""
    target, _, attribute = spec.rpartition(":")
    module = load_module(target)
    fn = getattr(module, attribute, None)
    if fn is None:
        raise LoadError(f"impl: {target!r} has no attribute {attribute!r}{closest(attribute, defined_names(module))}")
    if not callable(fn):
        raise LoadError(f"impl: {spec!r} is a {type(fn).__name__}, not a callable")
    return fn


def _describe(error: BaseException) -> str:
    """One readable line: ``file:line:col: message`` for a syntax error, else the exception
    type and message with the innermost frame of the user's code."""
    if isinstance(error, SyntaxError):
        where = f"{error.filename}:{error.lineno}:{error.offset}" if error.offset else f"{error.filename}:{error.lineno}"
        return f"{where}: {type(error).__name__}: {error.msg}"
    frames = traceback.extract_tb(error.__traceback__)
    inner = next((f for f in reversed(frames) if "importlib" not in f.filename), None)
    where = f" (at {inner.filename}:{inner.lineno})" if inner is not None else ""
    return f"{type(error).__name__}: {error}{where}"
