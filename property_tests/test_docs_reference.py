"""The documentation says what the code does: the reference pages are the generator's output.

The reference pages (docs/reference/) are written by docs/gen_reference.py from the registries
the tool runs on; a page edited by hand or left behind by a code change fails here, named,
with the one command that rewrites it.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
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
    assert not found, ("stale reference page(s) in docs/reference/: " + "; ".join(found)
                       + f". Regenerate them with `{gen.REGENERATE}` and commit the result.")


def test_a_stale_page_is_named(gen, generated, tmp_path):
    committed = tmp_path / "reference"
    shutil.copytree(generated, committed)
    assert gen.stale(generated, committed) == []
    (committed / "checks.md").write_text((committed / "checks.md").read_text() + "| `selection.typed_by_hand` | | |\n")
    (committed / "cli.md").unlink()
    (committed / "old.md").write_text("# a page the generator no longer writes\n")
    assert gen.stale(generated, committed) == ["checks.md (differs from what the code gives)", "cli.md (missing)",
                                               "old.md (not generated: remove it)"]
