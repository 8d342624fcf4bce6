"""The import rules of docs/layout.md, read from the source (no module is imported): revnets'
modules import each other without cycles; the floors run one way, revnets.facts below all,
revnets.graph <- revnets.planning.costs <- revnets.planning.search <- revnets.planning's own
modules; planning and the model zoo never import each other, nor the memory wing either; and no
module imports a revnets module inside a function or under TYPE_CHECKING, nor a private name of
another module."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "revnets"

def _name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in ROOT.rglob("*.py")}


def _imports(name: str) -> list[tuple[ast.stmt, str, list[str], bool]]:
    """Each import of a revnets module in ``name``: the statement, the module, the names taken,
    and whether it runs when the module is imported (not in a function, not TYPE_CHECKING)."""
    tree = ast.parse(MODULES[name].read_text())
    found = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                   ast.Lambda))
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                inner = False
            if isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                if child.module.split(".")[0] == "revnets":
                    found.append((child, child.module, [a.name for a in child.names], inner))
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.split(".")[0] == "revnets":
                        found.append((child, alias.name, [], inner))
            visit(child, inner)

    visit(tree, True)
    return found


def _edges(name: str, eager_only: bool = True) -> set[str]:
    """The revnets modules ``name`` imports (a submodule taken by ``from package import
    module`` counts as that module)."""
    edges = set()
    for _, module, names, eager in _imports(name):
        if eager_only and not eager:
            continue
        targets = [f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES]
        edges.update(targets or [module])
        if len(targets) < len(names):
            edges.add(module)
    return {e for e in edges if e in MODULES and e != name}


def _floor(name: str) -> int | None:
    """graph 0, planning.costs 1, planning.search 2, planning's own modules 3."""
    if name == "revnets.graph" or name.startswith("revnets.graph."):
        return 0
    for floor, package in ((1, "revnets.planning.costs"), (2, "revnets.planning.search")):
        if name == package or name.startswith(package + "."):
            return floor
    if name == "revnets.planning" or name.startswith("revnets.planning."):
        return 3
    return None


def _within(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_revnets_modules_import_each_other_without_cycles():
    graph = {name: _edges(name, eager_only=False) for name in MODULES}
    state: dict[str, int] = {}
    cycles = []

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                walk(nxt, [*path, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name, [name])
    assert not cycles, cycles


@pytest.mark.parametrize("name", sorted(n for n in MODULES if _floor(n) is not None))
def test_floors_run_one_way(name):
    """A floor imports only floors below it and itself; planning and graph never the zoo."""
    floor = _floor(name)
    for target in _edges(name, eager_only=False):
        assert not _within(target, "revnets.models"), (name, target)
        other = _floor(target)
        if other is None:
            continue
        if floor == 3 and other == 3 and target == "revnets.planning":
            pytest.fail(f"{name} imports the planning package's face")
        assert other <= floor, f"{name} (floor {floor}) imports {target} (floor {other})"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if _within(n, "revnets.models")))
def test_the_zoo_imports_no_planning(name):
    assert not any(_within(t, "revnets.planning", "revnets.graph")
                   for t in _edges(name, eager_only=False)), name


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_import_eagerly_and_no_private_names(name):
    for statement, module, names, eager in _imports(name):
        assert eager, f"{name}:{statement.lineno} imports {module} lazily"
        for taken in names:
            assert not taken.startswith("_") or module == name, (
                f"{name}:{statement.lineno} imports {taken} from {module}")


def test_facts_are_the_floor_below_every_wing():
    for name in (n for n in MODULES if _within(n, "revnets.facts")):
        assert all(_within(t, "revnets.facts") for t in _edges(name, eager_only=False)), name


def test_the_memory_wing_imports_neither_planning_nor_graph_nor_the_zoo():
    for name in (n for n in MODULES if _within(n, "revnets.memory")):
        assert not any(_within(t, "revnets.planning", "revnets.graph", "revnets.models")
                       for t in _edges(name, eager_only=False)), name


def test_the_plan_package_imports_neither_planning_nor_the_zoo():
    for name in (n for n in MODULES if _within(n, "revnets.plan")):
        assert not any(_within(t, "revnets.planning", "revnets.models", "revnets.graph")
                       for t in _edges(name, eager_only=False)), name
