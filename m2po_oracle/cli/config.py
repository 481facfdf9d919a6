"""The project's configuration: ``[tool.m2po-oracle]`` in the nearest ``pyproject.toml``.

Read alike by the CLI and the pytest plugin; a flag given on the command line overrides
the file. Keys are the compare options by their flag names (``examples``, ``compute-dtype``
or ``compute_dtype``, ...), plus ``impl`` and:

* ``json``, ``html``: where to write the reports (relative to the pyproject.toml);
* ``bind``: a list of ``"KEY=VALUE"`` texts, or a table ``{KEY = VALUE}``;
* ``accept``: deviations accepted like strict xfails, each ``{deviation = NAME, reason =
  TEXT, link = URL}``: a run whose every failure they explain is
  ``equivalent-with-accepted``; one that no longer shows fails the run unless
  ``strict = false``.

An unknown key, a wrong type or an unknown deviation is a usage error naming the key.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from m2po_oracle.cli.options import COMPARE_OPTIONS, RUN_SETTINGS, Option
from m2po_oracle.errors import UsageError, closest
from m2po_oracle.explain.deviations import VARIANTS, Accepted
from m2po_oracle.explain.step_deviations import STEP_DEVIATIONS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the tested Python is 3.11
    import tomli as tomllib

SECTION = "tool.m2po-oracle"
_OPTIONS: dict[str, Option] = {o.name: o for o in COMPARE_OPTIONS + RUN_SETTINGS if o.name != "accept"}
_OWN_KEYS = ("impl", "accept", "strict", "json", "html")


@dataclass(frozen=True)
class ProjectConfig:
    path: Path | None = None  # the pyproject.toml read (None: none found, or no section)
    impl: str | None = None
    values: dict[str, Any] = field(default_factory=dict)  # compare options by name, converted
    reports: dict[str, Path] = field(default_factory=dict)  # "json" / "html" -> where to write that report, relative to the project
    accept: tuple[Accepted, ...] = ()
    strict: bool = True

    def merged(self, given: dict[str, Any]) -> dict[str, Any]:
        """Option values: those ``given`` on the command line (not None, not False) win."""
        merged = dict(self.values)
        for name, value in given.items():
            if value is not None and value is not False:
                merged[name] = value
            else:
                merged.setdefault(name, value)
        return merged


def find_pyproject(start: Path) -> Path | None:
    for folder in (start, *start.parents):
        candidate = folder / "pyproject.toml"
        if candidate.is_file():
            return candidate
    return None


def load_config(start: Path | None = None) -> ProjectConfig:
    """The configuration of the project ``start`` (default: the working directory) is in."""
    path = find_pyproject((start or Path.cwd()).resolve())
    if path is None:
        return ProjectConfig()
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise UsageError(f"{path}: cannot read it as TOML: {error}") from None
    section = data.get("tool", {}).get("m2po-oracle")
    if section is None:
        return ProjectConfig()
    return parse_section(section, path)


def parse_section(section: Any, path: Path | None = None) -> ProjectConfig:
    where = f"{path}: [{SECTION}]" if path else f"[{SECTION}]"
    if not isinstance(section, dict):
        raise UsageError(f"{where}: expected a table, got {type(section).__name__}")
    values: dict[str, Any] = {}
    accept: tuple[Accepted, ...]
    impl, accept, strict, reports = None, (), True, {}
    known = [*_OPTIONS, *_OWN_KEYS]
    for raw_key, value in section.items():
        key = raw_key.replace("-", "_")
        if key == "impl":
            impl = _text(where, raw_key, value)
        elif key in ("json", "html"):
            reports[key] = (path.parent if path else Path.cwd()) / _text(where, raw_key, value)
        elif key == "strict":
            if not isinstance(value, bool):
                raise UsageError(f"{where}: strict: expected true or false, got {value!r}")
            strict = value
        elif key == "accept":
            accept = _accepted(where, value)
        elif key in _OPTIONS:
            values[key] = _option_value(where, raw_key, _OPTIONS[key], value)
        else:
            hint = closest(key, known, otherwise=f"; known: {', '.join(known)}")
            raise UsageError(f"{where}: unknown key {raw_key!r}{hint}")
    return ProjectConfig(path=path, impl=impl, values=values, reports=reports, accept=accept, strict=strict)


def _text(where: str, key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise UsageError(f"{where}: {key}: expected a non-empty string, got {value!r}")
    return value


def _option_value(where: str, key: str, option: Option, value: Any) -> Any:
    if option.switch:
        if not isinstance(value, bool):
            raise UsageError(f"{where}: {key}: expected true or false, got {value!r}")
        return value
    if option.repeat:  # bind: a list of "KEY=VALUE" or a table
        if isinstance(value, dict):
            return tuple(f"{k}={v if isinstance(v, str) else repr(v)}" for k, v in value.items())
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise UsageError(f'{where}: {key}: expected a list of "KEY=VALUE" strings or a table, got {value!r}')
    if isinstance(value, (bool, list, dict)):
        raise UsageError(f"{where}: {key}: expected {option.help.split(';')[0]!r} as a value, got {value!r}")
    if option.name == "validation_errors" and isinstance(value, list):
        value = ",".join(value)
    try:
        converted = option.type(str(value)) if option.type is not str else str(value)
    except (argparse.ArgumentTypeError, ValueError) as error:
        raise UsageError(f"{where}: {key}: {error}") from None
    if option.choices and converted not in option.choices:
        raise UsageError(f"{where}: {key}: expected one of {', '.join(option.choices)}, got {value!r}")
    return converted


def _accepted(where: str, value: Any) -> tuple[Accepted, ...]:
    if not isinstance(value, list):
        raise UsageError(f"{where}: accept: expected a list of tables {{deviation = NAME, reason = TEXT, link = URL}}, got {value!r}")
    found = []
    for i, entry in enumerate(value):
        if isinstance(entry, str):  # a bare name: accepted without a recorded reason
            entry = {"deviation": entry, "reason": ""}
        if not isinstance(entry, dict) or "deviation" not in entry:
            raise UsageError(f"{where}: accept[{i}]: expected a table with a deviation (and a reason), got {entry!r}")
        extra = set(entry) - {"deviation", "reason", "link"}
        if extra:
            raise UsageError(f"{where}: accept[{i}]: unknown key(s) {sorted(extra)}; known: deviation, reason, link")
        found.append(
            Accepted(
                validate_deviation(f"{where}: accept[{i}]", str(entry["deviation"])),
                str(entry.get("reason", "")),
                str(entry.get("link", "")),
            )
        )
    return tuple(found)


def validate_deviation(where: str, name: str) -> str:
    """``name`` if the diagnosis can name it (a known variant, step variants included)."""
    known = known_deviations()
    if name not in known:
        hint = closest(name, known, otherwise="; see m2po_oracle.explain.deviations.VARIANTS")
        raise UsageError(f"{where}: unknown deviation {name!r}{hint}")
    return name


def known_deviations() -> list[str]:
    """Every name the diagnosis can give: the single-batch deviations, then the step's (distributed, trainer, audit)."""
    names = [v.name for v in VARIANTS if v.name != "algorithm_1"]
    return names + [d.name for d in STEP_DEVIATIONS if d.name not in names]


def accepted_from_cli(names: list[str] | tuple[str, ...] | None) -> tuple[Accepted, ...]:
    return tuple(Accepted(validate_deviation("--accept", n), "accepted on the command line (--accept)") for n in names or ())


def exploration_from(values: dict[str, Any], project: ProjectConfig, available: tuple[str, ...] | list[str]) -> Any:
    """``compare.Exploration`` from the run settings (``options.RUN_SETTINGS``, parsed) over the
    project's configuration."""
    from m2po_oracle.compare.explore import Exploration
    from m2po_oracle.compare.search import select_checks

    accept = tuple(project.accept) + tuple(
        a for a in accepted_from_cli(values.get("accept")) if a.deviation not in {p.deviation for p in project.accept}
    )
    return Exploration(
        shrink=not values.get("no_shrink"),
        max_failures=values.get("max_failures"),
        checks=select_checks(available, values.get("checks")),
        skip_validation=bool(values.get("skip_validation")),
        database=values.get("hypothesis_database"),
        accept=accept,
        strict_accept=project.strict,
    )
