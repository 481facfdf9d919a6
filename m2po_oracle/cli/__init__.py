"""The entry points: the ``m2po-oracle`` command (``main``), its options and configuration,
the dispatcher that opens a runner for ``--impl``, the pytest plugin and the self-test."""

from m2po_oracle.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
