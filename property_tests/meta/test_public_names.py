"""A name another module uses is that module's API: no underscore name crosses a module
boundary, in the package or in its tests (``from m2po_oracle.x import _y``, or ``x._y`` on an
imported package module)."""

from __future__ import annotations

import ast
from pathlib import Path

import m2po_oracle

PACKAGE = Path(m2po_oracle.__file__).parent
TESTS = Path(__file__).parents[1]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_crossings(source: str, where: str) -> list[str]:
    """Every private name ``source`` takes from a package module, as ``where:line module.name``."""
    tree = ast.parse(source)
    modules: dict[str, str] = {}  # local name -> the package module (or name) it stands for
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.split(".")[0] == "m2po_oracle":
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{where}:{node.lineno} {node.module}.{alias.name}")
                modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "m2po_oracle":
                    # "import m2po_oracle.x as y" binds y to m2po_oracle.x; without "as", the name bound is m2po_oracle.
                    modules[alias.asname or "m2po_oracle"] = alias.name if alias.asname else "m2po_oracle"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base, chain = node.value, []
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules:
                found.append(f"{where}:{node.lineno} {'.'.join([modules[base.id], *reversed(chain)])}.{node.attr}")
    return sorted(found, key=lambda hit: int(hit.split(" ")[0].rsplit(":", 1)[1]))


def test_no_private_name_crosses_a_module_boundary():
    found = [
        hit
        for root in (PACKAGE, TESTS)
        for path in sorted(root.rglob("*.py"))
        for hit in private_crossings(path.read_text(), str(path.relative_to(root.parent)))
    ]
    assert not found, "private names used outside their module (make them public or keep them home):\n" + "\n".join(found)


def test_the_crossing_check_sees_a_planted_private_import_and_attribute():
    planted = (
        "from m2po_oracle.report.html import _secret\n"
        "from m2po_oracle.report import html\n"
        "import m2po_oracle.judge.checks as checks\n"
        "html._view({})\nchecks._registry\nhtml.render_html({})\n"
    )
    assert private_crossings(planted, "planted.py") == [
        "planted.py:1 m2po_oracle.report.html._secret",
        "planted.py:4 m2po_oracle.report.html._view",
        "planted.py:5 m2po_oracle.judge.checks._registry",
    ]


def aliases(source: str, where: str) -> list[str]:
    """Module-level second names for a package name (``field_of = result_field``): one thing,
    one name, or a reader cannot tell the two apart."""
    tree = ast.parse(source)
    imported = {
        alias.asname or alias.name
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "m2po_oracle")
        for alias in node.names
    }
    return [
        f"{where}:{node.lineno} {node.targets[0].id} = {node.value.id}"
        for node in tree.body
        if isinstance(node, ast.Assign)
        and len(node.targets) == 1
        and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.Name)
        and node.value.id in imported
    ]


def test_no_package_name_has_a_second_name():
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) for hit in aliases(path.read_text(), str(path.relative_to(PACKAGE.parent)))]
    assert not found, "aliases of package names (use the one name):\n" + "\n".join(found)


def test_the_alias_check_sees_a_planted_alias():
    planted = "from m2po_oracle.judge.checks import result_field\n\nfield_of = result_field\nLIMIT = 3\n"
    assert aliases(planted, "planted.py") == ["planted.py:3 field_of = result_field"]
