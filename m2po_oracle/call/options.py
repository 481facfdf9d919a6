"""Every option of a compare run with its default: the one home of an option's default.

Torch-free, so that the command line's help (which states each default from here) starts
fast; ``cli.options`` declares the flags, ``call.runner`` re-exports this record.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from m2po_oracle.errors import UsageError


@dataclass(frozen=True)
class RunOptions:
    """Every option of a compare run (``options.COMPARE_OPTIONS``), with ``given``: the
    names the user set explicitly, which the runner must honour or refuse."""

    examples: int = 500
    seed: int = 0
    dtype: str = "float64"
    compute_dtype: str | None = None
    tau: float | None = None
    device: str = "cpu"
    timeout: float = 60.0
    adapter: str | None = None
    bind: tuple[str, ...] = ()  # the adapter's KEY=VALUE bindings (--bind), in the order given
    topology: Any = None  # a distributed.topology.Topology (dp, cp, tp)
    backend: str = "gloo"
    strict_validation: bool = False
    in_process: bool = False
    show_output: bool = False
    validation_errors: str | None = None  # comma-separated exception names that also count as a deliberate refusal
    capture: str | None = None  # a directory for a capture (m2po_oracle.capture) of every step run (trainer, distributed)
    given: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def from_values(cls, values: dict[str, Any]) -> RunOptions:
        """Options from parsed flags where ``None`` (or ``False`` for a switch) means "not
        given": those take the defaults above and are not in ``given``."""
        names = {f.name for f in fields(cls)} - {"given"}
        unknown = set(values) - names
        if unknown:
            raise UsageError(f"options: unknown option(s) {sorted(unknown)}; known: {sorted(names)}")
        given = {name for name, value in values.items() if value is not None and value is not False}
        return cls(**{name: values[name] for name in given}, given=frozenset(given))

    @property
    def effective_compute_dtype(self) -> str:
        return self.compute_dtype or self.dtype

    @property
    def rejecting(self) -> tuple[str, ...]:
        return tuple(n.strip() for n in (self.validation_errors or "").split(",") if n.strip())

    def but(self, **changes: Any) -> RunOptions:
        return replace(self, **changes)


def run_defaults() -> dict[str, Any]:
    """Each option's default, by name (a flag's help states it)."""
    return {f.name: f.default for f in fields(RunOptions) if f.name != "given"}
