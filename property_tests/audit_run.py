"""Running `m2po-oracle audit` on a capture from a test, and reading its JSON report."""

from __future__ import annotations

import json
from pathlib import Path

from m2po_oracle.cli.main import main


def run_audit(directory: Path, tmp_path: Path) -> tuple[int, dict]:
    """The CLI's exit status and JSON report for the capture in ``directory``."""
    path = tmp_path / "audit.json"
    status = main(["audit", str(directory), "--json", str(path)])
    return status, json.loads(path.read_text())


def check_statuses(step: dict) -> dict[str, str]:
    """One audited step's checks, name -> status."""
    return {c["name"]: c["status"] for c in step["checks"]}
