"""The package's rooms and arrows: read from its own imports, every one (function-level too).

No import circle anywhere, and the entry points (the CLI, the pytest plugin, ``open_runner``)
are imported only from above them, so an arrow never runs back up.
"""

from __future__ import annotations

import ast
from pathlib import Path

import m2po_oracle

PACKAGE = Path(m2po_oracle.__file__).parent
#: Modules at the top (options: the flags): what imports them must itself be one of them.
ENTRY_POINTS = {"m2po_oracle.cli", "m2po_oracle.pytest_plugin", "m2po_oracle.selftest", "m2po_oracle.launch", "m2po_oracle.options",
                "m2po_oracle.config"}
ABOVE_ENTRY_POINTS = ENTRY_POINTS | {"m2po_oracle.torchrun"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its body."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # "from m2po_oracle.x import y" may name a module y or a name in x.
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target.startswith("m2po_oracle") and target != name and target != "m2po_oracle":
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_package_has_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_sees_a_planted_circle():
    graph = import_graph()
    graph["m2po_oracle.contract"] = graph["m2po_oracle.contract"] | {"m2po_oracle.battery"}  # battery imports contract
    assert find_cycle(graph) is not None


def test_entry_points_are_imported_only_from_above():
    wrong = [(module, target) for module, targets in import_graph().items() for target in targets
             if target in ENTRY_POINTS and module not in ABOVE_ENTRY_POINTS]
    assert not wrong, f"imports that run back up into an entry point: {wrong}"


def test_the_contract_holds_only_the_contract():
    imports = import_graph()["m2po_oracle.contract"]
    assert imports <= {"m2po_oracle.batch", "m2po_oracle.record"}, imports


def test_sub_packages_exist_where_families_of_files_do():
    for room in ("distributed", "trainer", "report"):
        assert (PACKAGE / room / "__init__.py").is_file()
    assert not list(PACKAGE.glob("*_names.py")), "no module exists only to dodge an import circle"


def room_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The same arrows between rooms: a sub-package is one room, every other module its own."""
    def room(module: str) -> str:
        parts = module.split(".")
        return ".".join(parts[:2]) if len(parts) > 2 else module

    rooms: dict[str, set[str]] = {}
    for module, targets in graph.items():
        rooms.setdefault(room(module), set()).update(room(t) for t in targets if room(t) != room(module))
    return rooms


def test_rooms_import_one_way():
    cycle = find_cycle(room_graph(import_graph()))
    assert cycle is None, "rooms import each other (an arrow runs back up): " + " -> ".join(cycle or [])


def test_the_room_check_sees_an_arrow_back_up():
    graph = import_graph()
    graph["m2po_oracle.trainer.checks"] = graph["m2po_oracle.trainer.checks"] | {"m2po_oracle.resolve"}  # resolve imports trainer.controls
    assert find_cycle(room_graph(graph)) is not None


#: The audit package's rooms, lowest first: a room imports only rooms before it.
AUDIT_ROOMS = ("records", "reassembly", "checks", "diagnosis", "counterexample", "run")


def upward_arrows(graph: dict[str, set[str]], package: str, rooms: tuple[str, ...]) -> list[tuple[str, str]]:
    """Imports inside ``package`` that run from a room into the same or a higher one (its
    ``__init__`` sits above every room)."""
    rank = {f"{package}.{room}": index for index, room in enumerate(rooms)} | {package: len(rooms)}
    return [(module, target) for module, targets in graph.items() if module in rank
            for target in targets if target.startswith(package) and rank.get(target, -1) >= rank[module]]


def test_the_audit_rooms_import_only_downward():
    graph = import_graph()
    assert {m for m in graph if m.startswith("m2po_oracle.audit.")} == {f"m2po_oracle.audit.{room}" for room in AUDIT_ROOMS}
    assert not upward_arrows(graph, "m2po_oracle.audit", AUDIT_ROOMS)


def test_the_audit_room_check_sees_an_arrow_back_up():
    graph = import_graph()
    graph["m2po_oracle.audit.checks"] = graph["m2po_oracle.audit.checks"] | {"m2po_oracle.audit.diagnosis"}
    assert upward_arrows(graph, "m2po_oracle.audit", AUDIT_ROOMS) == [("m2po_oracle.audit.checks", "m2po_oracle.audit.diagnosis")]


def test_ci_runs_exactly_the_readmes_test_command():
    """.ci/run is the README's second command, so a green CI means a user's copy of it passes."""
    import re
    from pathlib import Path

    root = Path(__file__).parents[1]
    commands = re.findall(r"```bash\n(python3 -m venv .venv && [^\n]+)\n```", (root / "README.md").read_text())
    test_command = next(c for c in commands if "pytest" in c)
    ci_lines = [line for line in (root / ".ci" / "run").read_text().splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    assert ci_lines == [test_command], f".ci/run runs {ci_lines}, the README says {test_command!r}"
