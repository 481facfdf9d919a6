"""``m2po-oracle``: check an M2PO implementation against Algorithm 1.

Each subcommand is a module of this room (``compare_command`` also runs ``replay``); this one
parses the command line and hands it to the subcommand, imported only then: ``--help``, a
usage error and ``checks`` load neither torch nor NumPy. Exit status: 0 no divergence found;
1 divergence found; 2 the implementation could not be loaded or called at all, or a usage
error; 130 interrupted (``m2po_oracle.errors`` holds them).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator

from rich.console import Console

from m2po_oracle.cli.parser import build_parser
from m2po_oracle.errors import (
    EXIT_DIVERGENT,
    EXIT_EQUIVALENT,
    EXIT_INTERRUPTED,
    EXIT_UNUSABLE,
)

__all__ = ["EXIT_DIVERGENT", "EXIT_EQUIVALENT", "EXIT_INTERRUPTED", "EXIT_UNUSABLE", "build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()  # the reported duration covers start-up (imports, the world) too
    args = build_parser().parse_args(argv)
    args.started = started
    # Off a terminal (CI logs, pipes) rich would wrap at 80 columns: tables and messages keep their lines.
    console = Console(stderr=False, width=None if sys.stdout.isatty() else 200)
    with hypothesis_storage():
        return run_command(args, console)


def run_command(args: argparse.Namespace, console: Console) -> int:
    """The subcommand ``args.command``, its module imported here: most subcommands import
    torch (seconds), which the others, and ``--help``, never wait for."""
    if args.command in ("checks", "adapters"):
        from m2po_oracle.cli import catalogue

        return catalogue.list_checks(console) if args.command == "checks" else catalogue.list_adapters(console)
    if args.command == "selftest":
        from m2po_oracle.cli.selftest_command import selftest

        return selftest(args, console)
    if args.command == "bench":
        from m2po_oracle.cli.bench_command import bench

        return bench(args, console)
    if args.command == "audit":
        from m2po_oracle.cli.audit_command import audit

        return audit(args, console)
    from m2po_oracle.cli.compare_command import run_or_replay

    return run_or_replay(args, console)  # compare and replay


@contextlib.contextmanager
def hypothesis_storage() -> Iterator[None]:
    """Hypothesis keeps a cache (``.hypothesis/``) in the working directory: a command run
    in the user's project would leave it there. The run's cache lives in a scratch folder
    instead, removed at the end; the examples a user keeps go where
    ``--hypothesis-database`` says, and ``HYPOTHESIS_STORAGE_DIRECTORY`` still chooses."""
    if os.environ.get(STORAGE_ENV):
        yield
        return
    from hypothesis import configuration

    # Hypothesis reads the variable once per process: its setter makes a second run (a test
    # that calls main() again) use its own folder, not the first run's removed one.
    home = getattr(configuration, "set_hypothesis_home_dir", lambda directory: None)
    with tempfile.TemporaryDirectory(prefix="m2po-oracle-hypothesis-") as scratch:
        os.environ[STORAGE_ENV] = scratch
        home(scratch)
        try:
            yield
        finally:
            os.environ.pop(STORAGE_ENV, None)
            home(None)


STORAGE_ENV = "HYPOTHESIS_STORAGE_DIRECTORY"
