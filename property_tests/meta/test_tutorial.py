"""The tutorial's commands give what its pages say.

Each lesson's ``bash`` blocks run as written, in a scratch copy of the tutorial's files,
with the installed ``m2po-oracle``; the ``text`` block after each is what the page says the
commands print. Every line shown there must appear in the output, in order (``...`` elides,
timings and the absolute path of ``/path/to/`` may differ), and no command may print a
traceback. A newcomer who follows the pages meets what they say.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
TUTORIAL = ROOT / "docs" / "tutorial"
#: The lessons in the order a reader follows them (reading-the-report reads the run of the
#: first), and the worked examples of the diagnosis and equivalence pages, which run the same port.
LESSONS = ("first-check.md", "replaying.md", "../explanation/diagnosis.md", "../explanation/equivalence.md")
FENCE = re.compile(r"^```(\w*)\s*$")


@dataclass(frozen=True)
class Step:
    page: str
    line: int
    commands: str
    shown: tuple[str, ...]  # the text block that follows, if any


def steps(page: Path) -> list[Step]:
    """Each ``bash`` block of ``page`` with the ``text`` block that follows it."""
    blocks: list[tuple[str, int, list[str]]] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    language, start, body = None, 0, []
    for number, line in enumerate(lines, 1):
        fence = FENCE.match(line)
        if fence and language is None:
            language, start, body = fence.group(1), number, []
        elif line.strip() == "```" and language is not None:
            blocks.append((language, start, body))
            language = None
        elif language is not None:
            body.append(line)
    found = []
    for k, (language, start, body) in enumerate(blocks):
        if language != "bash":
            continue
        following = blocks[k + 1] if k + 1 < len(blocks) and blocks[k + 1][0] == "text" else None
        found.append(Step(page.name, start, "\n".join(body), tuple(following[2]) if following else ()))
    return found


def installing(step: Step) -> bool:
    """The install block: the test runs in the environment it already installed."""
    return "pip install" in step.commands


def pattern(shown: str) -> re.Pattern[str]:
    """A shown line as a pattern over one printed line: blanks collapsed, ``...`` any text,
    a timing any timing, ``/path/to/`` any absolute path."""
    text = " ".join(shown.split())
    parts = re.split(r"(\.\.\.|in \d+(?:\.\d+)? s\b|/path/to/)", text)
    wild = {"...": ".*", "/path/to/": r"/\S*/"}
    out = "".join(
        wild[p] if p in wild else r"in \d+(?:\.\d+)? s" if re.fullmatch(r"in \d+(?:\.\d+)? s", p) else re.escape(p) for p in parts
    )
    return re.compile(out)


def missing_lines(shown: tuple[str, ...], printed: str) -> list[str]:
    """The shown lines the output lacks, in order (each found after the previous one)."""
    out = [" ".join(line.split()) for line in printed.splitlines()]
    at, missing = 0, []
    for line in shown:
        if line.strip() in ("", "..."):
            continue
        wanted = pattern(line)
        hit = next((k for k in range(at, len(out)) if wanted.fullmatch(out[k])), None)
        if hit is None:
            missing.append(line)
        else:
            at = hit + 1
    return missing


def test_a_shown_line_that_the_output_lacks_is_named():
    printed = "verdict: divergent in 6.1 s\nreplay: m2po-oracle replay --impl /tmp/x/docs/p.py:f --batch '{\"a\":1}'\n"
    assert (
        missing_lines(("verdict: divergent in 4.2 s", "replay: m2po-oracle replay --impl /path/to/docs/p.py:f --batch '{...}'"), printed)
        == []
    )
    assert missing_lines(("verdict: equivalent in 4.2 s",), printed) == ["verdict: equivalent in 4.2 s"]
    # In order: a line shown after another must be printed after it.
    assert missing_lines(("replay: ...", "verdict: divergent in 1 s"), printed) == ["verdict: divergent in 1 s"]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """A folder a newcomer would run from: the tutorial's port at its documented path."""
    folder = tmp_path_factory.mktemp("newcomer")
    (folder / "docs" / "tutorial").mkdir(parents=True)
    shutil.copy(TUTORIAL / "my_port.py", folder / "docs" / "tutorial" / "my_port.py")
    return folder


def run(step: Step, folder: Path) -> subprocess.CompletedProcess[str]:
    binary = Path(sys.executable).parent
    environment = {**os.environ, "PATH": f"{binary}{os.pathsep}{os.environ.get('PATH', '')}", "COLUMNS": "200"}
    environment.pop("M2PO_ORACLE_TIMEOUT", None)
    return subprocess.run(["bash", "-c", step.commands], cwd=folder, env=environment, capture_output=True, text=True, timeout=600)


@pytest.mark.xdist_group("tutorial")
def test_the_tutorial_runs_as_written(scratch):
    problems = []
    for lesson in LESSONS:
        for step in steps(TUTORIAL / lesson):
            if installing(step):
                continue
            done = run(step, scratch)
            printed = done.stdout + done.stderr
            where = f"{step.page}:{step.line}"
            if "Traceback" in printed:
                problems.append(f"{where}: a traceback:\n{printed[-2000:]}")
            missing = missing_lines(step.shown, printed)
            if missing:
                problems.append(f"{where}: the page shows lines the commands did not print: {missing}\n--- printed:\n{printed[-3000:]}")
    assert not problems, "\n\n".join(problems)
