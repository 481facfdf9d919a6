"""Options shared by the command line and the pytest plugin, defined once."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from m2po_oracle.call.options import run_defaults

DTYPE_CHOICES = ("float64", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Option:
    name: str  # long flag without dashes, e.g. "examples"
    help: str
    type: Any = str
    default: Any = None
    choices: tuple[str, ...] | None = None
    switch: bool = False  # a flag without a value (store_true)
    repeat: bool = False  # may be given several times; the values are kept in order (append)
    metavar: str | None = None  # the value's name in --help (argparse's default: the name upper-cased)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def help_text(self) -> str:
        """The help, with the run's default where it has one (``call.options.RunOptions``)."""
        default = RUN_DEFAULTS.get(self.name)
        if default is None or default is False or default == ():
            return self.help
        return f"{self.help} (default {default:g})" if isinstance(default, float) else f"{self.help} (default {default})"


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}") from None
    if not (0 < value < float("inf")):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def _topology(text: str) -> Any:
    from m2po_oracle.distributed.topology import Topology

    try:
        return Topology.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def nonnegative_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}") from None
    if not (value >= 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


#: Each option's default, from its one home (the help states it).
RUN_DEFAULTS = run_defaults()

# Defaults live in ``call.options.RunOptions``; a flag's default here is None (False for a
# switch) so that a runner can tell a given option, which it must honour or refuse, from
# one left alone.
COMPARE_OPTIONS: tuple[Option, ...] = (
    Option("examples", "number of generated batches (training steps for the trainer) to try", positive_int),
    Option("seed", "seed of the batch generator: same seed, same batches", int),
    Option("dtype", "dtype of the input tensors given to the implementation", str, None, DTYPE_CHOICES),
    Option(
        "compute_dtype",
        "dtype the implementation computes its selection in (sets the rounding band; default: --dtype)",
        str,
        None,
        DTYPE_CHOICES,
    ),
    Option("tau", "use this budget for every batch instead of drawing it", nonnegative_seconds),
    Option("device", "torch device for the input tensors", str),
    Option(
        "timeout",
        "per-call timeout in seconds; the implementation runs in a worker process and a call past it is a finding",
        _positive_seconds,
    ),
    # No argparse choices: the names live in the adapter table (m2po_oracle.adapters), and
    # open_runner refuses an unknown one with the closest matches.
    Option(
        "adapter",
        "the port's signature family when it is not the contract's (m2po-oracle adapters lists them: mask_only, "
        "mask_function, masked_loss, per_token_loss, policy_loss, verl_release, clip_kernel, packed; group with --topology)",
        str,
    ),
    Option(
        "bind",
        "KEY=VALUE for the adapter's call, repeatable: where a role goes (budget=M2_budget, budget=config.policy_loss.m2_budget), "
        "where an output is in the return (loss=0, keep=1, m2_after=4.M2_after), or an extra keyword argument (miniclip_low=None); "
        "values are Python literals, else strings",
        str,
        repeat=True,
    ),
    Option("topology", "run distributed: ranks as dp=N,cp=N,tp=N (Megatron order); the implementation takes parallel=", _topology),
    Option("backend", "collective backend of a distributed run", str, None, ("gloo", "nccl")),
    Option(
        "strict_validation",
        "count silently accepted invalid input (see 'validation' in the report) as a divergence",
        bool,
        False,
        switch=True,
    ),
    Option(
        "validation_errors",
        "comma-separated exception class names that also count as a deliberate refusal of invalid input "
        "(ValueError and TypeError always do)",
        str,
    ),
    Option(
        "in_process",
        "call the implementation in this process (faster; no timeout, a crash or hang takes the tool down)",
        bool,
        False,
        switch=True,
    ),
    Option("show_output", "let the implementation's stdout/stderr through instead of capturing it per call", bool, False, switch=True),
    Option(
        "capture",
        "write what every step fed its loss to DIR as a capture (m2po_oracle.capture) for `m2po-oracle audit DIR`; "
        "trainer and distributed runs only",
        str,
        metavar="DIR",
    ),
)


#: How a compare run explores and judges (``compare.Exploration``), shared by the CLI and the
#: plugin like the options above; none of them changes how the implementation is called.
RUN_SETTINGS: tuple[Option, ...] = (
    Option(
        "accept",
        "a deviation the project accepts (a diagnosis name, e.g. clamped_log_ratio), repeatable: failures it alone explains give "
        "verdict equivalent-with-accepted (exit 0); if it no longer shows, the run fails (exit 1) unless strict = false in pyproject.toml",
        str,
        repeat=True,
    ),
    Option("checks", "run only the checks matching these comma-separated glob patterns, e.g. 'selection.*,loss' (call always runs)", str),
    Option(
        "max_failures",
        "stop exploring after N failing examples (-x: 1); the counterexamples and diagnosis cover what was found",
        positive_int,
    ),
    Option(
        "no_shrink", "report each check's first failing example as generated instead of shrinking it (faster)", bool, False, switch=True
    ),
    Option("skip_validation", "do not run the invalid-input probes (reported as skipped, never as passed)", bool, False, switch=True),
    Option(
        "hypothesis_database",
        "a folder for a Hypothesis example database: this run's failing examples are replayed first on the next run",
        str,
    ),
)


def add_to_pytest(group: Any, options: tuple[Option, ...] = COMPARE_OPTIONS, prefix: str = "m2po") -> None:
    """Register the same options as ``--m2po-NAME`` on a pytest option group."""
    for option in options:
        flag = f"--{prefix}-{option.name.replace('_', '-')}"
        dest = f"{prefix}_{option.name}"
        if option.switch:
            group.addoption(flag, dest=dest, action="store_true", default=False, help=option.help_text)
        elif option.repeat:
            group.addoption(flag, dest=dest, action="append", type=option.type, default=None, help=option.help_text)
        else:
            group.addoption(
                flag,
                dest=dest,
                type=option.type,
                default=option.default,
                choices=option.choices,
                metavar=option.metavar,
                help=option.help_text,
            )


def add_to_argparse(parser: argparse.ArgumentParser, options: tuple[Option, ...] = COMPARE_OPTIONS) -> None:
    for option in options:
        if option.switch:
            parser.add_argument(option.flag, dest=option.name, action="store_true", help=option.help_text)
        elif option.repeat:
            parser.add_argument(
                option.flag,
                dest=option.name,
                action="append",
                type=option.type,
                default=None,
                metavar="NAME" if option.name == "accept" else "KEY=VALUE",
                help=option.help_text,
            )
        else:
            parser.add_argument(
                option.flag,
                dest=option.name,
                type=option.type,
                default=option.default,
                choices=option.choices,
                metavar=option.metavar,
                help=option.help_text,
            )
