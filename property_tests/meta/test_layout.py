"""The package's rooms and floors: read from its own imports, every one (function-level too).

Every room (a sub-package, or a module at the top) stands on a floor, and imports only rooms
on lower floors: an arrow never runs back up. Inside a room, no import circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import m2po_oracle

PACKAGE = Path(m2po_oracle.__file__).parent
#: The rooms, lowest floor first; a room imports only rooms of a lower floor.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("errors", "oracle", "capture"),  # Algorithm 1 and the records (torch-free); the vendorable recorder
    ("core", "strategies", "records"),  # the production loss; batches for property tests; the JSON records declared
    ("judge",),  # judging one example: checks, tolerances, equivalence, contract, probes
    ("adapters", "explain"),  # other signatures; explaining a failure: deviations, variants, diagnosis
    ("call",),  # calling an implementation: runner, resolve, isolation, controls
    ("distributed", "trainer"),  # the other worlds: ranks, whole training steps
    ("compare", "audit"),  # the search for a counterexample; judging a recorded run
    ("report", "bench"),  # rendering the JSON records; benchmarks
    ("cli",),  # the entry points
    ("__main__", "torchrun", "integrations"),  # python -m m2po_oracle; under torchrun; inside TRL and ms-swift
)
FLOOR = {room: level for level, rooms in enumerate(FLOORS) for room in rooms}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its body."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    extensions = {_module_name(p) for p in PACKAGE.rglob("*.c")}  # compiled modules: imported, importing nothing
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and (node.module or node.level):
                # "from m2po_oracle.x import y" may name a module y or a name in x; a relative
                # import ("from .x import y", for files that vendor together) counts as well.
                package = name if path.name == "__init__.py" else name.rpartition(".")[0]
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]) if node.level else ""
                source = ".".join(p for p in (base, node.module) if p)
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules.keys() | extensions else source for a in node.names]
            for target in targets:
                if target in extensions:
                    continue
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
                return [*stack[stack.index(nxt) :], nxt]
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
    graph["m2po_oracle.judge.contract"] = graph["m2po_oracle.judge.contract"] | {"m2po_oracle.judge.battery"}  # battery imports contract
    assert find_cycle(graph) is not None


def test_the_contract_holds_only_the_contract():
    imports = import_graph()["m2po_oracle.judge.contract"]
    assert imports <= {"m2po_oracle.errors", "m2po_oracle.oracle.batch", "m2po_oracle.oracle.record"}, imports


def room(module: str) -> str:
    """A module's room: its sub-package, or the module itself at the top."""
    return module.split(".")[1] if module.count(".") else module


def upward_room_arrows(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports from a room into a room on the same or a higher floor."""
    return sorted(
        (module, target)
        for module, targets in graph.items()
        for target in targets
        if room(module) != room(target) and FLOOR[room(target)] >= FLOOR[room(module)]
    )


def test_every_room_stands_on_a_floor():
    rooms = {room(module) for module in import_graph()} - {"m2po_oracle"}
    assert rooms == set(FLOOR), f"rooms without a floor: {sorted(rooms - set(FLOOR))}; floors without a room: {sorted(set(FLOOR) - rooms)}"


def test_rooms_import_only_from_lower_floors():
    wrong = upward_room_arrows(import_graph())
    assert not wrong, "imports that run back up (or sideways) between rooms: " + ", ".join(f"{a} -> {b}" for a, b in wrong)


def test_the_floor_check_sees_an_arrow_back_up():
    graph = import_graph()
    graph["m2po_oracle.judge.checks"] = graph["m2po_oracle.judge.checks"] | {"m2po_oracle.call.resolve"}
    assert upward_room_arrows(graph) == [("m2po_oracle.judge.checks", "m2po_oracle.call.resolve")]
    sideways = import_graph()
    sideways["m2po_oracle.trainer.checks"] = sideways["m2po_oracle.trainer.checks"] | {"m2po_oracle.distributed.topology"}
    assert upward_room_arrows(sideways) == [("m2po_oracle.trainer.checks", "m2po_oracle.distributed.topology")]


#: Files that still do several jobs each, to be cut up; the list only shrinks (it is empty).
STILL_TOO_LONG: set[str] = set()


def test_the_top_of_the_package_is_a_table_of_contents():
    modules = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(modules) <= 12, modules
    too_long = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if len(p.read_text().splitlines()) > 600}
    assert too_long <= STILL_TOO_LONG, f"files over 600 lines: {sorted(too_long - STILL_TOO_LONG)}"
    assert not STILL_TOO_LONG - too_long, f"no longer over 600 lines, strike from STILL_TOO_LONG: {sorted(STILL_TOO_LONG - too_long)}"


#: The audit package's rooms, lowest first: a room imports only rooms before it.
AUDIT_ROOMS = ("records", "reassembly", "checks", "diagnosis", "counterexample", "run")


def upward_arrows(graph: dict[str, set[str]], package: str, rooms: tuple[str, ...]) -> list[tuple[str, str]]:
    """Imports inside ``package`` that run from a room into the same or a higher one (its
    ``__init__`` sits above every room)."""
    rank = {f"{package}.{room}": index for index, room in enumerate(rooms)} | {package: len(rooms)}
    return [
        (module, target)
        for module, targets in graph.items()
        if module in rank
        for target in targets
        if target.startswith(package) and rank.get(target, -1) >= rank[module]
    ]


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

    root = Path(__file__).parents[2]
    commands = re.findall(r"```bash\n(python3 -m venv .venv && [^\n]+)\n```", (root / "README.md").read_text())
    test_command = next(c for c in commands if "pytest" in c)
    ci_lines = [line for line in (root / ".ci" / "run").read_text().splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    assert ci_lines == [test_command], f".ci/run runs {ci_lines}, the README says {test_command!r}"
