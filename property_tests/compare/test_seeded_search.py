"""A run's batches are a function of its strategy and ``--seed``: not of which modules the
process has imported by the time it draws. Hypothesis mixes into its draws literals read from
the source of every local module imported so far; a compare whose report moved when an import
moved to a module's top (the HTML report's, whose curve view holds a 1000.0) drew them."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from hypothesis.internal.conjecture import providers

import m2po_oracle
from m2po_oracle.compare.database import without_source_constants

ROOT = Path(m2po_oracle.__file__).parents[1]

#: Literals a port's module might hold, in the ranges the batches draw from.
PLANTED = textwrap.dedent("""
    SCALES = (-0.75, -2.5, 0.3, 1.7, 4.25, -11.5, 0.0625, 123.456, -9.875, 0.999, 17.0, -0.125)
    SIZES = (2, 3, 5, 7, 11)
""")

#: The stratified start, the free search and a shrink's replay draw through ``seeded_find``;
#: each is drawn before and after a module full of literals is imported.
DRAW = textwrap.dedent("""
    import contextlib, json, random, sys
    from hypothesis.errors import NoSuchExample
    from m2po_oracle import strategies
    from m2po_oracle.compare.database import search_settings, seeded_find
    from m2po_oracle.compare.explore import stratified_start

    def draws():
        start = [b.to_json() for b in stratified_start(None, 0, 35)]
        free = []
        with contextlib.suppress(NoSuchExample):  # every draw recorded, none found
            seeded_find(strategies.batches(), lambda b: free.append(b.to_json()) and False, search_settings(60), random.Random(0))
        return start + free

    before = draws()
    sys.path.insert(0, sys.argv[1])
    import planted_literals  # noqa: F401
    import m2po_oracle.report.html, m2po_oracle.trainer.runner  # noqa: F401, E401
    after = draws()
    print(json.dumps([len(before), sum(a != b for a, b in zip(before, after))]))
""")


def test_the_search_draws_the_same_batches_whatever_was_imported_before(tmp_path):
    (tmp_path / "planted_literals.py").write_text(PLANTED)
    # A fresh process: the pool of literals Hypothesis keeps only grows, in this one as in any.
    done = subprocess.run([sys.executable, "-c", DRAW, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    drawn, moved = json.loads(done.stdout.strip().splitlines()[-1])
    assert drawn > 60
    assert moved == 0, f"{moved} of {drawn} batches changed when modules full of literals were imported before the draws"


def test_outside_the_search_hypothesis_keeps_its_literals():
    # A user's own Hypothesis tests, run beside the pytest plugin, still draw their module's literals.
    pooled = providers._get_local_constants
    with without_source_constants():
        assert len(providers._get_local_constants()) == 0
    assert providers._get_local_constants is pooled
