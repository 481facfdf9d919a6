"""An import of the package inside a function is the exception: each one is on ALLOWED with why.

A module says what it depends on at its top. An import of ``m2po_oracle`` stays inside a
function only where laziness is needed: the oracle stays torch-free; an optional framework
(TRL, ms-swift, transformers, ...) loads only when used; the ``m2po-oracle`` command's
``--help``, ``checks`` and the pytest plugin (loaded by every pytest run) start without torch.
A new one fails here, named, until it moves to the module's top or joins ALLOWED with its
reason; an entry whose import is gone fails too, so that the list only says what is true.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import m2po_oracle

PACKAGE = Path(m2po_oracle.__file__).parent
#: At most this many function-level imports of the package, and of ALLOWED entries.
MOST = 30

_TORCH_FREE_CLI = "the command line's --help and its quick commands load no torch"

#: "file (under m2po_oracle/):function" (a method: Class.method) -> why its imports of the package are lazy.
ALLOWED: dict[str, str] = {
    # Listed as found, not needed: bench/core.py's callers (the bench command) load torch already, so
    # each can move to the top.
    "bench/core.py:bench_across_ranks": "not needed (bench/core.py loads torch and these modules' neighbours at its top)",
    "bench/core.py:run_bench_across": "not needed (the topology and the world are light)",
    "judge/coverage.py:_family": "strategies imports Hypothesis, which the console and the HTML report reading coverage never need",
    "core/fused.py:_load": "the compiled extension is optional (no C compiler at install): its ImportError is reported, not raised",
    "cli/main.py:run_command": f"each subcommand's module is imported when it runs: {_TORCH_FREE_CLI}",
    "cli/catalogue.py:list_adapters": f"the adapters import torch, which `m2po-oracle checks` never needs: {_TORCH_FREE_CLI}",
    "cli/options.py:_topology": f"the topology imports NumPy; options.py is read by the parser at every start: {_TORCH_FREE_CLI}",
    "cli/config.py:exploration_from": "compare imports torch; config.py is read by the pytest plugin at every pytest start-up",
    "cli/pytest_plugin.py:item_outcomes": "the runner and the search import torch; the plugin loads with every pytest run, m2po or not",
    "cli/pytest_plugin.py:_declared_checks": "the runner and the search import torch; the plugin loads with every pytest run, m2po or not",
    "cli/pytest_plugin.py:_write_reports": "the HTML report imports Jinja: only a run asked for --m2po-html needs it",
    "integrations/swift_step.py:_case_trainer_class": "integrations.swift imports ms-swift; swift_step's registry reads without it",
    "integrations/swift_demo.py:swift_arguments": "integrations.swift imports ms-swift; swift_demo's helpers work without it",
    "integrations/swift_demo.py:main": "integrations.swift imports ms-swift; swift_demo's helpers work without it",
    "integrations/verl_step.py:build_worker": "integrations.verl imports verl; verl_step's registry reads without it",
    "integrations/verl_step.py:run_update": "integrations.verl imports verl; verl_step's registry reads without it",
}


def _imports_package(node: ast.Import | ast.ImportFrom) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] == "m2po_oracle"
    return any(alias.name.split(".")[0] == "m2po_oracle" for alias in node.names)


def function_level_imports(source: str, where: str) -> list[tuple[str, int]]:
    """``(where:function, line)`` of every import of the package inside a function body
    (a method as ``Class.method``, a nested function as ``outer.inner``)."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, names: tuple[str, ...], in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                visit(child, (*names, child.name), True)
            elif isinstance(child, ast.ClassDef):
                visit(child, (*names, child.name), in_function)
            else:
                if in_function and isinstance(child, ast.Import | ast.ImportFrom) and _imports_package(child):
                    found.append((f"{where}:{'.'.join(names)}", child.lineno))
                visit(child, names, in_function)

    visit(ast.parse(source), (), False)
    return found


def package_imports() -> list[tuple[str, int]]:
    return [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        for hit in function_level_imports(path.read_text(), path.relative_to(PACKAGE).as_posix())
    ]


def test_every_function_level_import_of_the_package_is_allowed():
    new = [(key, line) for key, line in package_imports() if key not in ALLOWED]
    assert not new, (
        "imports of m2po_oracle inside a function, not on ALLOWED:\n"
        + "\n".join(f"  m2po_oracle/{key.split(':')[0]}:{line} in {key.split(':')[1]}()" for key, line in new)
        + (
            "\nmove each to the top of its module; if it must stay lazy (the torch-free oracle, an optional framework, "
            'the CLI\'s start-up), add "FILE:FUNCTION": "why it is lazy" to ALLOWED in ' + Path(__file__).name
        )
    )


def test_no_allowed_entry_is_stale():
    stale = sorted(set(ALLOWED) - {key for key, _ in package_imports()})
    assert not stale, f"on ALLOWED but no longer importing the package inside the function, strike them: {stale}"


def test_the_allow_list_stays_short_and_says_why():
    assert len(ALLOWED) <= MOST, f"{len(ALLOWED)} entries on ALLOWED; at most {MOST}"
    assert len(package_imports()) <= MOST, f"{len(package_imports())} function-level imports of the package; at most {MOST}"
    assert all(why.strip() for why in ALLOWED.values()), "every entry says why its import is lazy"


def test_the_finder_sees_planted_imports_and_only_those():
    planted = (
        "import m2po_oracle.errors\n"
        "from m2po_oracle.oracle import batch\n"
        "if True:\n"
        "    from m2po_oracle import strategies\n"
        "def f():\n"
        "    import json\n"
        "    from m2po_oracle.judge import checks\n"
        "    def inner():\n"
        "        import m2po_oracle.core\n"
        "class C:\n"
        "    from m2po_oracle import errors\n"
        "    def method(self):\n"
        "        if self:\n"
        "            from .record import Feature\n"
    )
    assert function_level_imports(planted, "x.py") == [("x.py:f", 7), ("x.py:f.inner", 9), ("x.py:C.method", 14)]


def test_what_the_lazy_imports_keep_out_stays_out():
    # The reasons ALLOWED gives for the CLI: its start (--help, checks) and the pytest plugin load no torch.
    code = (
        "import sys, m2po_oracle.cli.pytest_plugin\n"
        "from m2po_oracle.cli.main import main\n"
        "main(['checks'])\n"
        "print(sorted(n for n in ('torch', 'jinja2') if n in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout
