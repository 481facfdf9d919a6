"""The built site shows what its pages include: every snippet marker in the docs is one the
snippets extension reads, and the tutorial's page carries its port's source.

A marker the code formatter rewrote (``--8 < --"file"`` inside a ``python`` block) is not
an include any more: the page shows a junk line and ``mkdocs build --strict`` still passes.
These tests read the pages' text and the built HTML instead.
"""

from __future__ import annotations

import html
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
DOCS = ROOT / "docs"
#: Anything that looks like a snippet marker, spaced or not.
MARKER_LIKE = re.compile(r"-\s*-\s*8\s*<\s*-\s*-")
#: The one form the pages use: ``--8<-- "path"`` or ``--8<-- "path:section"`` alone on its line.
MARKER = re.compile(r'^--8<-- "([^":]+)(?::[\w-]+)?"$')


def snippet_markers(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line that looks like a snippet marker."""
    return [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if MARKER_LIKE.search(line)]


def malformed_markers(paths: list[Path]) -> list[str]:
    """``page:line: text`` for each marker the snippets extension would not read, or whose file is missing."""
    found = []
    for path in paths:
        for number, line in snippet_markers(path.read_text(encoding="utf-8")):
            where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{number}: {line}"
            match = MARKER.match(line)
            if match is None:
                found.append(f'{where} (not a marker the snippets extension reads: write --8<-- "path")')
            elif not (ROOT / match.group(1)).is_file():
                found.append(f"{where} (no such file: {match.group(1)})")
    return found


def test_every_snippet_marker_is_well_formed():
    found = malformed_markers(sorted(DOCS.rglob("*.md")))
    assert not found, "snippet markers that include nothing:\n" + "\n".join(found)


def test_a_rewritten_marker_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text('```python\n--8 < --"docs/tutorial/my_port.py"\n```\n\n```python\n--8<-- "docs/nowhere.py"\n```\n')
    assert malformed_markers([page]) == [
        'page.md:2: --8 < --"docs/tutorial/my_port.py" (not a marker the snippets extension reads: write --8<-- "path")',
        'page.md:6: --8<-- "docs/nowhere.py" (no such file: docs/nowhere.py)',
    ]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocs", reason="the docs extra is not installed")
    directory = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(directory)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, f"mkdocs build --strict failed:\n{built.stderr[-3000:]}"
    return directory


def page_text(page: Path) -> str:
    """A built page's text, as a reader sees it (tags dropped, entities decoded)."""
    return html.unescape(re.sub(r"<[^>]+>", "", page.read_text(encoding="utf-8")))


def test_the_tutorial_page_shows_its_port(site):
    text = page_text(site / "tutorial" / "first-check" / "index.html")
    source = (DOCS / "tutorial" / "my_port.py").read_text()
    definitions = [line.strip() for line in source.splitlines() if line.startswith("def ")]
    assert definitions, "the tutorial's port defines no function"
    missing = [d for d in definitions if d not in text]
    assert not missing, f"the built tutorial page lacks the port's source: {missing} (is its --8<-- include intact?)"


def test_the_worked_example_reads_as_six_steps(site):
    # A paragraph after a table in a list item needs the item's indentation: with less, the
    # list ends at the table and the last steps read as one run-on paragraph.
    built = (site / "explanation" / "diagnosis" / "index.html").read_text(encoding="utf-8")
    example = built[built.index('id="a-worked-example"') : built.index('id="the-rule-in-one-paragraph"')]
    steps = re.search(r"<ol>(.*?)</ol>", example, re.S)
    assert steps is not None and steps.group(1).count("<li>") == 6, "the worked example's steps are not one list of six"
    assert "5. <strong>" not in example


def test_no_built_page_shows_a_marker(site):
    shown = [f"{p.relative_to(site)}: {line}" for p in sorted(site.rglob("*.html")) for _, line in snippet_markers(page_text(p))]
    assert not shown, "built pages show a snippet marker instead of what it includes:\n" + "\n".join(shown)


#: Where a site page scrolls sideways at its width: the page, or a table behind a scrollbar
#: (the theme wraps each table in a scrolling box; a code block may scroll: it is code).
TABLES_SIDEWAYS = """() => {
  const found = [];
  const root = document.documentElement;
  if (root.scrollWidth > root.clientWidth + 1) found.push(`the page: ${root.scrollWidth} > ${root.clientWidth}`);
  for (const box of document.querySelectorAll('.md-typeset__scrollwrap, .md-typeset__table, table')) {
    if (box.scrollWidth > box.clientWidth + 1) {
      const head = box.querySelector('th') ? box.querySelector('th').innerText : '';
      found.push(`a table (first header ${JSON.stringify(head)}): ${box.scrollWidth} > ${box.clientWidth}`);
    }
  }
  return found;
}"""

#: The pages with the widest tables: the public ports compared, the benchmark, the checks.
WIDE_PAGES = ("explanation/algorithm/index.html", "internals/performance/index.html", "reference/checks/index.html")


def test_site_pages_read_at_1280_px_without_sideways_scroll(site, browser, tmp_path):
    problems = []
    for name in WIDE_PAGES:
        page = browser.new_page(viewport={"width": 1280, "height": 900}, device_scale_factor=1)
        page.set_default_timeout(30_000)
        try:
            page.goto((site / name).as_uri(), wait_until="load")
            problems += [f"{name}: {found}" for found in page.evaluate(TABLES_SIDEWAYS)]
            page.screenshot(path=str(tmp_path / (name.replace("/", "_") + ".png")), full_page=True)
        finally:
            page.close()
    assert not problems, "site pages that scroll sideways at 1280 px:\n" + "\n".join(problems)
