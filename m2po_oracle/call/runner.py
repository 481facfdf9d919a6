"""The runner interface: one way of running an implementation under the battery.

Every way of running (a loss function in this process or in an isolated worker, a
distributed world, ranks under torchrun, a whole training step) is a :class:`Runner`: it
declares the checks it runs, the options it honours and how its counterexamples replay,
and it runs the battery on one example. ``compare``, the CLI, the pytest plugin and
torchrun only talk to this interface; :func:`m2po_oracle.cli.launch.open_runner` builds one.

An option a runner cannot honour is a :class:`UsageError` (exit 2), never dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from m2po_oracle.call.options import RunOptions as RunOptions
from m2po_oracle.errors import UsageError
from m2po_oracle.judge.contract import OUTPUT_LINES_KEPT

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy

    from m2po_oracle.judge.battery import BatteryOutcome
    from m2po_oracle.judge.validation import ProbeResult


#: Options every runner honours: they shape the search, not the call.
SEARCH_OPTIONS = frozenset({"examples", "seed", "tau", "strict_validation"})


def refuse_unhonoured(runner_name: str, honours: frozenset[str], options: RunOptions, why: dict[str, str] | None = None) -> None:
    """A :class:`UsageError` naming every given option that ``honours`` does not contain."""
    ignored = sorted(options.given - honours - SEARCH_OPTIONS)
    if ignored:
        reasons = why or {}
        detail = "; ".join(f"--{name.replace('_', '-')}: {reasons.get(name, 'not supported by this runner')}" for name in ignored)
        raise UsageError(f"{runner_name} cannot honour {', '.join('--' + n.replace('_', '-') for n in ignored)} ({detail})")


#: Why a run that calls a loss function alone refuses ``--capture``.
CAPTURE_NEEDS_A_STEP = (
    "a single-process run has no training step to capture: record your own trainer with "
    "m2po_oracle.capture.Recorder; --capture records --impl trainer and --topology runs"
)


class CaptureFailed(BaseException):
    """Writing the capture failed (a full disk, an unwritable directory): the run stops, since
    a capture that silently lost a step would audit as if the step never ran.

    A BaseException, like compare's own stop signal: neither a runner's ``except Exception``
    (which would count it against the implementation) nor Hypothesis (which would shrink it,
    rerunning steps against a broken capture) may swallow it."""


@dataclass
class CaptureTarget:
    """The directory a trainer or distributed run captures into (``--capture``), and the
    optimizer steps it has numbered: every ``run_battery`` call is the next one."""

    directory: Path
    steps: int = 0

    @classmethod
    def prepare(cls, directory: str) -> CaptureTarget:
        """Create ``directory`` if needed; a :class:`UsageError` if it already holds a capture
        (the recorder never mixes two runs) or cannot be a directory."""
        path = Path(directory)
        if path.exists() and not path.is_dir():
            raise UsageError(f"capture: {directory} exists and is not a directory; expected an empty or new directory")
        if path.is_dir() and any(path.glob("manifest.rank-*.json")):
            raise UsageError(f"capture: {directory} already holds a capture; choose an empty directory")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise UsageError(f"capture: cannot create the directory {directory}: {error}") from None
        return cls(path)

    def next_step(self) -> int:
        """The number of the step about to run (0, 1, 2, ...)."""
        step = self.steps
        self.steps += 1
        return step

    def use(self) -> CaptureUse:
        return CaptureUse(str(self.directory), self.steps)


@dataclass(frozen=True)
class CaptureUse:
    """What a run captured (``--capture``): the directory and the steps written there."""

    directory: str
    steps: int


@dataclass(frozen=True)
class AdapterUse:
    """The adapter a run calls the port through (``--adapter``, ``--bind``), as the report states it."""

    name: str
    signature: str
    checked: tuple[str, ...]
    supplies: tuple[str, ...]  # the result fields the port itself computes
    builds: dict[str, str]  # the fields the adapter builds, and how
    not_run: dict[str, str]  # checks on what the adapter, not the port, decides, and why
    bindings: tuple[str, ...]
    call: str | None  # the call made, as the port sees it


@dataclass(frozen=True)
class TopologyUse:
    """The world a distributed run ran in."""

    dp: int
    cp: int
    tp: int
    backend: str


@dataclass(frozen=True)
class ChosenDtype:
    """A dtype the runner chose itself (a trainer computing in one dtype, run without ``--dtype``), and why."""

    value: str
    why: str


@dataclass(frozen=True)
class RunDescription:
    """What a way of running adds to the report: its adapter, its topology, its capture, the dtype it chose."""

    adapter: AdapterUse | None = None
    topology: TopologyUse | None = None
    capture: CaptureUse | None = None
    dtype: ChosenDtype | None = None


@dataclass
class CallHealth:
    """How the implementation's calls have gone so far: timed-out and dead calls."""

    timeouts: int = 0
    crashes: int = 0


@dataclass
class CapturedOutput:
    """What the implementation printed: the first lines kept, every line counted."""

    KEEP: ClassVar[int] = OUTPUT_LINES_KEPT
    first_lines: list[str] = field(default_factory=list)
    lines: int = 0

    def add(self, first_lines: tuple[str, ...], lines: int) -> None:
        room = self.KEEP - len(self.first_lines)
        if room > 0:
            self.first_lines.extend(first_lines[:room])
        self.lines += lines


@runtime_checkable
class Runner(Protocol):
    """One way of running an implementation under the battery."""

    #: The implementation's name as the user gave it (replay commands use it).
    spec: str
    #: The checks this runner runs, in report order (names from :mod:`m2po_oracle.judge.checks`).
    checks: tuple[str, ...]
    #: What one example is: "batches", or "steps" for a training step.
    example_unit: str
    options: RunOptions

    @property
    def health(self) -> CallHealth: ...  # read only: an attribute or a property

    output: CapturedOutput
    #: Whether one example costs a model or a world (a minimal example then serves every
    #: check it fails instead of a new search per check).
    costly_examples: bool

    #: Step-level deviations the runner's outcomes name (``explained_by``), with descriptions.
    @property
    def variant_descriptions(self) -> dict[str, str]: ...  # read only: a class or an instance attribute

    variant_source: str

    def strategy(self) -> SearchStrategy[Any]:
        """What the run explores (batches, or training-step cases)."""

    def run_battery(self, example: Any) -> BatteryOutcome:
        """Every check on one example; never raises because of the implementation."""

    def validation(self) -> list[ProbeResult]:
        """The invalid-input (fail-closed) probes of this way of running."""

    def replay_command(self, example: Any) -> str:
        """The one command that re-runs ``example`` under the same options."""

    def parse_example(self, data: dict[str, Any]) -> Any:
        """An example back from its JSON (``replay``)."""

    def example_key(self) -> str:
        """The key of a counterexample's input in the JSON report ("batch", "trainer_case")."""

    def describe(self) -> RunDescription:
        """What this way of running adds to the report (adapter, topology, capture, a chosen dtype)."""

    def start(self) -> None: ...

    def close(self) -> None: ...


def check_device(device: str) -> None:
    """A device that cannot run here is a usage error (ValueError naming ``device``), not a
    finding against the implementation."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device: expected a torch device such as 'cpu' or 'cuda', got {device!r} ({error})") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} requested, but CUDA is not available to this torch ({torch.__version__})")
