"""The repository is self-contained: what its code, messages and pages cite is in it.

No comment, message or page points at an issue number or at a document outside the
repository; a citation of the definition of "correct" names a section of
docs/explanation/algorithm.md that exists.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
DEFINITION = ROOT / "docs" / "explanation" / "algorithm.md"
#: What a reference to something outside the repository looks like.
OUTSIDE = re.compile(r"\bissue\s*#?\d+|\bspec section\b|\.\./shared\b|\bshared/spec\b", re.IGNORECASE)
CITATION = re.compile(r"algorithm\.md §(\d+)")


def _texts() -> list[Path]:
    found = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "pyproject.toml", ROOT / "tox.ini"]
    for folder, patterns in (
        ("m2po_oracle", ("*.py", "*.j2", "*.c")),
        ("property_tests", ("*.py",)),
        ("fixtures", ("*.py", "*.json", "*.md")),
        ("docs", ("*.md",)),
        (".ci", ("*",)),
    ):
        for pattern in patterns:
            found += [p for p in (ROOT / folder).rglob(pattern) if p.is_file()]
    return sorted(set(p for p in found if p.exists() and p != Path(__file__)))


def outside_references(paths: list[Path]) -> list[str]:
    """``path:line: text`` for every reference to an issue number or an outside document."""
    hits = []
    for path in paths:
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                hits.append(f"{where}:{number}: {line.strip()[:120]}")
    return hits


def test_nothing_points_outside_the_repository():
    hits = outside_references(_texts())
    assert not hits, "references to issues or documents outside the repository:\n" + "\n".join(hits)


def test_every_citation_of_the_definition_names_a_section_it_has():
    sections = {m.group(1) for m in re.finditer(r"^## (\d+)\. ", DEFINITION.read_text(encoding="utf-8"), re.MULTILINE)}
    assert sections, f"{DEFINITION} has no numbered sections"
    cited = {
        (str(p.relative_to(ROOT)), m.group(1)) for p in _texts() for m in CITATION.finditer(p.read_text(encoding="utf-8", errors="replace"))
    }
    missing = sorted(f"{path} cites §{n}" for path, n in cited if n not in sections)
    assert cited and not missing, f"citations of sections {DEFINITION.name} does not have: {missing}"


def test_a_planted_outside_reference_is_found(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("# as issue 15 asks\nx = 1  # see spec section 4\ny = 2  # algorithm.md §3\n")
    assert [h.split(": ", 1)[1] for h in outside_references([planted])] == ["# as issue 15 asks", "x = 1  # see spec section 4"]
