"""The README's CI recipe, run step by step in a scratch project the way the job would."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

README = Path(__file__).parents[2] / "README.md"

PORT = """
from m2po_oracle.core.loss import loss_from_selection, select_tokens


def m2po(logp, behavior_logp, advantages, mask, *, tau):
    selection = select_tokens(logp.detach(), behavior_logp, advantages, mask, tau=tau)
    keep = selection.keep
    denominator = keep.sum() if DENOMINATOR == "kept" else mask.sum()
    return {"loss": loss_from_selection(logp, behavior_logp, advantages, keep, denominator), "keep": keep}
"""


def recipe_steps() -> list[str]:
    text = README.read_text()
    block = re.search(r"<!-- ci-recipe -->\s*```yaml\n(.*?)```\s*<!-- /ci-recipe -->", text, re.S)
    assert block, "README: the CI recipe between <!-- ci-recipe --> markers is missing"
    return [line.split("run:", 1)[1].strip() for line in block.group(1).splitlines() if line.strip().startswith("run:")]


def _scratch(tmp_path: Path, denominator: str) -> Path:
    project = tmp_path / f"port-{denominator}"
    project.mkdir()
    (project / "port.py").write_text(f"DENOMINATOR = {denominator!r}\n" + PORT)
    (project / "test_port_unit.py").write_text("def test_the_port_imports():\n    import port\n")
    (project / "pyproject.toml").write_text(
        textwrap.dedent("""\
        [project]
        name = "port"
        version = "0"

        [tool.m2po-oracle]
        impl = "port.py:m2po"
        examples = 40
        """)
    )
    return project


def _run(step: str, project: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONPATH": str(project)}
    return subprocess.run(shlex.split(step), cwd=project, env=env, capture_output=True, text=True, timeout=300)


def test_the_recipe_installs_at_the_tested_versions():
    install, *_ = recipe_steps()
    assert install.startswith("pip install") and "-c constraints.txt" in install and "download.pytorch.org/whl/cpu" in install
    pins = (Path(__file__).parents[2] / "constraints.txt").read_text()
    assert "torch==2.13.0" in pins, "the recipe relies on constraints.txt pinning the tested torch"


@pytest.mark.parametrize(("denominator", "passes"), [("valid", True), ("kept", False)])
def test_the_recipe_checks_the_port_and_keeps_the_report(tmp_path, denominator, passes):
    """Every step after the install (this checkout is installed already) in a scratch
    project: a correct port passes, a planted bug fails the job, and the HTML report the
    artifact step uploads is written either way."""
    project = _scratch(tmp_path, denominator)
    _, *steps = recipe_steps()
    for step in steps:
        done = _run(step, project)
        assert (done.returncode == 0) == passes, (
            f"{step!r} in the scratch project: rc {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}"
        )
    report = project / "reports" / "m2po.html"
    assert report.is_file(), "the artifact step would upload nothing"
    verdict = "equivalent" if passes else "divergent"
    assert f">{verdict}<" in report.read_text(), f"the report states the verdict {verdict}"
