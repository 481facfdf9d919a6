"""The documentation says what the code does: the reference pages are the generator's output,
and every number the README states about the code is the code's.

The reference pages (docs/reference/) are written by docs/gen_reference.py from the registries
the tool runs on; a page edited by hand or left behind by a code change fails here, named,
with the one command that rewrites it.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
README = ROOT / "README.md"
GENERATOR = ROOT / "docs" / "gen_reference.py"


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("gen_reference", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generated(gen, tmp_path_factory):
    directory = tmp_path_factory.mktemp("reference")
    gen.write(directory)
    return directory


def test_the_reference_pages_are_what_the_code_gives(gen, generated):
    found = gen.stale(generated, gen.REFERENCE)
    assert not found, (
        "stale reference page(s) in docs/reference/: "
        + "; ".join(found)
        + f". Regenerate them with `{gen.REGENERATE}` and commit the result."
    )


def test_a_stale_page_is_named(gen, generated, tmp_path):
    committed = tmp_path / "reference"
    shutil.copytree(generated, committed)
    assert gen.stale(generated, committed) == []
    (committed / "checks.md").write_text((committed / "checks.md").read_text() + "| `selection.typed_by_hand` | | |\n")
    (committed / "cli.md").unlink()
    (committed / "old.md").write_text("# a page the generator no longer writes\n")
    assert gen.stale(generated, committed) == [
        "checks.md (differs from what the code gives)",
        "cli.md (missing)",
        "old.md (not generated: remove it)",
    ]


def test_a_check_added_without_regenerating_makes_its_page_stale(gen, generated, tmp_path, monkeypatch):
    """The planted change the generator exists for: a check registered in the code, the
    committed page not rewritten."""
    from m2po_oracle.judge import checks

    monkeypatch.setitem(checks.CHECKS, "selection.planted", "a check added without regenerating the reference")
    monkeypatch.setitem(checks.ALL_CHECKS, "selection.planted", "a check added without regenerating the reference")
    fresh = tmp_path / "fresh"
    gen.write(fresh)
    assert "selection.planted" in (fresh / "checks.md").read_text()
    stale = gen.stale(fresh, generated)
    assert "checks.md (differs from what the code gives)" in stale, stale  # the adapters page lists the checks too


def test_every_page_the_generator_writes_is_in_the_site_nav(gen):
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [name for name in gen.PAGES if f"reference/{name}" not in nav]
    assert not missing, f"reference pages missing from mkdocs.yml's nav: {missing}"


# --- the numbers the README states ------------------------------------------------------------

#: Number words ("one" is left out: "one adapter" is an article, not a count).
WORDS = {
    w: n
    for n, w in enumerate(["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"])
    if n > 1
}
NUMBER = r"(\d+|" + "|".join(WORDS) + r")"
#: Nouns whose count is a fact about the code: a number in front of one is checked.
COUNTED = r"(controls?|checks?|adapters?|calling conventions?|deviations?|probes?|subcommands?|families|strategies)"
#: Any "<number> [up to three words] <counted noun>" in the README.
ANY_COUNT = re.compile(r"\b" + NUMBER + r"((?:\s+[\w-]+){0,3}?)\s+" + COUNTED + r"\b", re.IGNORECASE)


def _prose(text: str) -> str:
    """The README without its fenced code blocks (commands and their output are not claims)."""
    return re.sub(r"```.*?```", "", text, flags=re.S)


def _claims(gen) -> dict[str, int]:
    """What each counted phrase the README may use is, in the code (lower case, words between
    the number and the noun included)."""
    single, composite = len(gen.load("controls.single")), len(gen.load("controls.composite"))
    adapters = len(gen.load("adapters.all"))
    return {
        "negative controls": single + composite,
        "single-process negative controls": single + composite,
        "single deviations": single,
        "composite controls": composite,
        "composites": composite,
        "adapters": adapters,
        "calling conventions": adapters,
        "distributed controls": len(gen.load("controls.distributed")),
        "trainer controls": len(gen.load("controls.trainer")),
        "trainer-level controls": len(gen.load("controls.trainer")),
        "validation probes": len(gen.load("validation.probes")),
        "invalid-input probes": len(gen.load("validation.probes")),
    }


def readme_counts(text: str) -> list[tuple[str, int]]:
    """Every ``(phrase, number)`` the README's prose states, ``phrase`` in lower case."""
    found = []
    for match in ANY_COUNT.finditer(_prose(text)):
        number = match.group(1).lower()
        phrase = " ".join((match.group(2) + " " + match.group(3)).lower().split())
        found.append((phrase, int(number) if number.isdigit() else WORDS[number]))
    return found


def readme_exit_statuses(text: str) -> dict[int, str]:
    """The README's exit-status table: ``| `N` | meaning |`` rows under a heading naming exit status."""
    section = re.search(r"^#+ [^\n]*exit status[^\n]*$(.*?)(?=^#+ |\Z)", text, re.I | re.M | re.S)
    assert section, "README: no section headed 'exit status'"
    return {int(n): meaning.strip() for n, meaning in re.findall(r"^\|\s*`(\d+)`\s*\|(.*)\|\s*$", section.group(1), re.M)}


def test_every_count_the_readme_states_is_the_codes(gen):
    claims = _claims(gen)
    counts = readme_counts(README.read_text())
    unchecked = sorted({phrase for phrase, _ in counts if phrase not in claims})
    assert not unchecked, (
        f"README states a count this test does not check: {unchecked}; add the phrase to _claims "
        "with what it counts in the code, or drop the number"
    )
    wrong = [f"README says {n} {phrase}, the code has {claims[phrase]}" for phrase, n in counts if claims[phrase] != n]
    assert not wrong, "; ".join(wrong)


def test_the_readme_exit_statuses_are_the_commands(gen):
    stated = readme_exit_statuses(README.read_text())
    returned = {gen.load(k) for k in ("cli.exit_equivalent", "cli.exit_divergent", "cli.exit_unusable", "cli.exit_interrupted")}
    assert set(stated) == returned, f"README's exit statuses {sorted(stated)}, m2po-oracle returns {sorted(returned)}"


def test_the_readme_python_is_the_packages():
    try:
        import tomllib
    except ImportError:  # Python 3.10: the package depends on tomli there
        import tomli as tomllib

    required = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    stated = re.findall(r"Python (>= ?[\d.]+)", _prose(README.read_text()))
    assert stated and all(s.replace(" ", "") == required for s in stated), (
        f"README says Python {stated}, pyproject.toml requires {required}"
    )


def test_a_wrong_or_unchecked_count_is_found(gen):
    claims = _claims(gen)
    right = claims["negative controls"]
    text = f"It ships {right} negative controls and seven trainer-level controls.\n\n```\n99 checks in a code block\n```\nAlso 12 magic checks.\n"
    assert readme_counts(text) == [("negative controls", right), ("trainer-level controls", 7), ("magic checks", 12)]
    assert "magic checks" not in claims
