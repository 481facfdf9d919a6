"""Declaring the fields of a JSON record, and holding a record to its declaration.

A field is named by its key path: ``verdict``, ``checks[].failure_rate_upper_95`` (``[]``: every
item of a list) or ``diagnosis.shares{}.share`` (``{}``: every value of a *map*, an object whose
keys are data, such as check or deviation names). A :class:`Field` gives a path its JSON type,
its meaning, the condition under which it is written (``when``; empty: wherever its parent is)
and, for a map, what its keys are. Where the record is a dataclass written field for field,
:class:`FromDataclass` reads the paths (and, where it can, their types) from the dataclass and
declares only the meanings.

Types are words: ``string``, ``integer``, ``number``, ``boolean``, ``null``, ``object``, ``any``,
``array of T``, ``map of T``, and alternatives joined by `` or `` (the loosest: ``array of
integer or null`` is a list of integers, or null). A ``number`` may be one of the record's
strings for a non-finite value (:attr:`Schema.non_finite`), never a bare ``NaN``, which is not
standard JSON.

Nothing here imports torch: a :class:`FromDataclass` imports its dataclass's module only when
its fields are asked for (the reference page's generator and the test that holds the
declarations to real runs do that), and a :class:`Schema` reads its id from the module that
writes the record, so neither is typed twice.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

SCALARS = ("string", "integer", "number", "boolean", "null", "object", "any")


def alternatives(type_: str) -> list[str]:
    """``"array of integer or null"`` -> ``["array of integer", "null"]``."""
    return [part.strip() for part in type_.split(" or ")]


def _valid_type(type_: str) -> bool:
    for alternative in alternatives(type_):
        while alternative.startswith(("array of ", "map of ")):
            alternative = alternative.split(" of ", 1)[1]
        if alternative not in SCALARS:
            return False
    return True


def is_map(type_: str) -> bool:
    return any(a.startswith("map of ") for a in alternatives(type_))


@dataclass(frozen=True)
class Field:
    """One key path of a record: its JSON type, its meaning, when it is written (empty:
    wherever its parent is) and, for a map, what its keys are."""

    path: str
    type: str
    meaning: str
    when: str = ""
    keys: str = ""

    def __post_init__(self) -> None:
        if not _valid_type(self.type):
            raise ValueError(f"{self.path}: type {self.type!r} is not made of {', '.join(SCALARS)}, 'array of', 'map of' and 'or'")
        if is_map(self.type) != bool(self.keys):
            raise ValueError(f"{self.path}: a map type needs keys= (what its keys are), and only a map has keys")


#: A dataclass field's annotation -> its JSON type (an annotation not here needs ``types=``).
ANNOTATIONS = {
    "str": "string",
    "int": "integer",
    "float": "number",
    "bool": "boolean",
    "None": "null",
    "Path": "string",
    "object": "any",
    "Any": "any",
}


def json_type(annotation: Any) -> str:
    """The JSON type a field annotated so is written as: ``"tuple[int, ...] | None"`` ->
    ``"array of integer or null"``; a ValueError for one it cannot tell."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    found = []
    for part in (p.strip() for p in _top_level_split(text)):
        sequence = re.fullmatch(r"(?:tuple|list)\[(.+?)(?:, \.\.\.)?\]", part)
        if part in ANNOTATIONS:
            found.append(ANNOTATIONS[part])
        elif sequence:
            found.append("array of " + json_type(sequence.group(1)))
        elif part.startswith(("dict[", "Mapping[")) or part == "dict":
            found.append("object")
        else:
            raise ValueError(f"no JSON type for the annotation {text!r}: declare it in types=")
    return " or ".join(sorted(found, key=lambda t: t == "null"))


def _top_level_split(text: str) -> Iterator[str]:
    depth, start = 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "|" and depth == 0:
            yield text[start:i]
            start = i + 1
    yield text[start:]


def _load(source: str) -> Any:
    module, _, attribute = source.partition(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass(frozen=True)
class FromDataclass:
    """The fields of a dataclass that its record writes under their own names, at ``prefix``
    (``validation.probes[]``): the paths and the annotations' types come from the dataclass
    (``source``, ``module:Class``), ``meanings`` from here, one per field, no more, no fewer;
    ``types`` where the JSON type is not the annotation's, ``when`` and ``keys`` as for :class:`Field`."""

    prefix: str
    source: str
    meanings: Mapping[str, str]
    types: Mapping[str, str] = field(default_factory=dict)
    when: Mapping[str, str] = field(default_factory=dict)
    keys: Mapping[str, str] = field(default_factory=dict)

    def fields(self) -> tuple[Field, ...]:
        cls = _load(self.source)
        names = [f.name for f in dataclasses.fields(cls)]
        unmeant = [n for n in names if n not in self.meanings]
        stray = [n for d in (self.meanings, self.types, self.when, self.keys) for n in d if n not in names]
        if unmeant or stray:
            parts = ([f"fields without a meaning: {unmeant}"] if unmeant else []) + (
                [f"declared, but no field of the dataclass: {sorted(set(stray))}"] if stray else []
            )
            raise ValueError(f"{self.prefix} ({self.source}): " + "; ".join(parts))
        annotations = {f.name: f.type for f in dataclasses.fields(cls)}
        return tuple(
            Field(
                f"{self.prefix}.{name}",
                self.types.get(name) or json_type(annotations[name]),
                self.meanings[name],
                self.when.get(name, ""),
                self.keys.get(name, ""),
            )
            for name in names
        )


Declared = Field | FromDataclass


@dataclass(frozen=True)
class Schema:
    """One JSON record: its id (read from ``source``, the writer's ``module:NAME``), what writes
    it, the strings it writes for non-finite numbers, and its fields."""

    name: str
    source: str
    writer: str
    about: str
    non_finite: tuple[str, ...]
    declared: tuple[Declared, ...]

    @property
    def id(self) -> str:
        return _load(self.source)

    def fields(self) -> tuple[Field, ...]:
        """Every field, dataclasses resolved, in declaration order; a ValueError for a path
        declared twice or one whose parent is not declared as a container of it."""
        out = tuple(f for d in self.declared for f in (d.fields() if isinstance(d, FromDataclass) else (d,)))
        containers = container_types(out)
        seen: set[str] = set()
        for f in out:
            if f.path in seen:
                raise ValueError(f"{self.name}: {f.path} is declared twice")
            seen.add(f.path)
            parent = parent_of(f.path)
            if parent and not any(a == "object" for a in alternatives(containers.get(parent, ""))):
                raise ValueError(f"{self.name}: {f.path}: its parent {parent} is not declared as an object")
        return out

    def paths(self, record: Any) -> dict[str, list[Any]]:
        """Every key path ``record`` has, with the values found there."""
        return key_paths(record, container_types(self.fields()))

    def problems(self, record: Any) -> list[str]:
        """What of ``record`` its declaration does not say: a schema id that is not this one, an
        undeclared key path, a value of another type than declared, and a key declared without
        a condition (``when``) missing from an object that should have it."""
        fields = self.fields()
        declared = {f.path: f for f in fields}
        found = []
        if isinstance(record, Mapping) and record.get("schema") != self.id:
            found.append(f"schema is {record.get('schema')!r}, expected {self.id!r}")
        values = values_at(record, container_types(fields))
        for path, at in values.items():
            if not path or path.endswith(("[]", "{}")):
                continue
            if path not in declared:
                found.append(f"{path}: not declared")
                continue
            wrong = next((v for v in at if not conforms(v, declared[path].type, self.non_finite)), _NOTHING)
            if wrong is not _NOTHING:
                found.append(f"{path}: declared {declared[path].type}, found {_short(wrong)}")
        for f in fields:
            parent = parent_of(f.path)
            key = f.path[len(parent) + 1 :] if parent else f.path
            if not f.when and any(isinstance(v, Mapping) and key not in v for v in values.get(parent, ())):
                found.append(f"{f.path}: missing (declared with no condition, `when`)")
        return found


_NOTHING = object()


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def parent_of(path: str) -> str:
    """``a[].b{}.c`` -> ``a[].b{}``: the container whose key the path's last step is."""
    return path.rsplit(".", 1)[0] if "." in path else ""


def container_types(fields: tuple[Field, ...]) -> dict[str, str]:
    """Every path that holds a value, with its type: the declared paths and, below an array
    or a map, its items (``P[]``) and values (``P{}``), their type read from the parent's."""
    out: dict[str, str] = {}
    for f in fields:
        pending = [(f.path, f.type)]
        while pending:
            path, type_ = pending.pop()
            out[path] = type_
            for alternative in alternatives(type_):
                if alternative.startswith("array of "):
                    pending.append((path + "[]", alternative.removeprefix("array of ")))
                elif alternative.startswith("map of "):
                    pending.append((path + "{}", alternative.removeprefix("map of ")))
    return out


def values_at(record: Any, containers: Mapping[str, str]) -> dict[str, list[Any]]:
    """Every path of ``record`` -> the values at it: the root (``""``), each key path, and the
    items of a list (``P[]``) and values of a map (``P{}``; ``containers`` says which paths are maps)."""
    out: dict[str, list[Any]] = {}

    def visit(value: Any, path: str) -> None:
        out.setdefault(path, []).append(value)
        if isinstance(value, Mapping):
            mapped = is_map(containers.get(path, ""))
            for key, item in value.items():
                visit(item, path + "{}" if mapped else f"{path}.{key}" if path else str(key))
        elif isinstance(value, list):
            for item in value:
                visit(item, path + "[]")

    visit(record, "")
    return out


def key_paths(record: Any, containers: Mapping[str, str]) -> dict[str, list[Any]]:
    """Every key path of ``record`` (a map's values as ``{}``) -> the values at it."""
    return {path: values for path, values in values_at(record, containers).items() if path and not path.endswith(("[]", "{}"))}


def conforms(value: Any, type_: str, non_finite: tuple[str, ...] = ()) -> bool:
    """Whether ``value`` (as ``json.load`` gives it) is of the declared type."""
    for alternative in alternatives(type_):
        if alternative.startswith("array of "):
            inner = alternative.removeprefix("array of ")
            if isinstance(value, list) and all(conforms(v, inner, non_finite) for v in value):
                return True
        elif alternative.startswith("map of "):
            inner = alternative.removeprefix("map of ")
            if isinstance(value, Mapping) and all(conforms(v, inner, non_finite) for v in value.values()):
                return True
        elif _scalar(value, alternative, non_finite):
            return True
    return False


def _scalar(value: Any, type_: str, non_finite: tuple[str, ...]) -> bool:
    if type_ == "number":
        return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)) or (
            isinstance(value, str) and value in non_finite
        )
    if type_ == "any":
        return not isinstance(value, float) or math.isfinite(value)
    if type_ == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    kinds = {"string": str, "boolean": bool, "null": type(None), "object": Mapping}
    return isinstance(value, kinds[type_])
