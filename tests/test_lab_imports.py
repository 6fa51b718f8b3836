"""The lab's modules import one another without a circle: no module imports one that imports it
back, at module level or inside a function. Read from the source (AST), so that an import
deferred into a function cannot hide a circle; and each printing module imports on its own."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

LAB = Path(__file__).resolve().parent.parent / "sparsecomm" / "lab"


def _module_name(path: Path) -> str:
    parts = ["sparsecomm", "lab", *path.relative_to(LAB).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _lab_imports(path: Path, modules: set[str]) -> set[str]:
    """The lab modules ``path`` imports, anywhere in it (``from pkg import module`` counts the module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    # The package's own __init__ runs for any of its modules: not an edge of the circle.
    return {name for name in found if name in modules and name not in ("sparsecomm.lab", "sparsecomm.lab.experiment")}


def _import_graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in LAB.rglob("*.py")}
    return {name: _lab_imports(path, set(paths)) - {name} for name, path in paths.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_no_lab_module_imports_one_that_imports_it_back():
    graph = _import_graph()
    assert "sparsecomm.lab.report" in graph and "sparsecomm.lab.costmodel.cli" in graph  # the scan sees the tree
    assert _circles(graph) == []


def test_the_text_helpers_are_a_leaf_and_the_plots_do_not_read_the_ledger():
    graph = _import_graph()
    assert graph["sparsecomm.lab.results.text"] == set()
    assert not any(name.split(".")[:3] == ["sparsecomm", "lab", "ledger"] for name in graph["sparsecomm.lab.plots"])
    assert {"sparsecomm.lab.ledger", "sparsecomm.lab.plots", "sparsecomm.lab.tolerance"} <= graph["sparsecomm.lab.report"]


def _folder(name: str, paths: dict[str, Path]) -> str:
    """The folder a module's file is in, as a dotted name (a package's own __init__: its folder)."""
    return ".".join(["sparsecomm", "lab", *paths[name].parent.relative_to(LAB).parts])


def test_no_two_lab_folders_import_each_other():
    """The folders point down only (docs/architecture.md): of two folders, at most one imports the
    other (a folder and its subfolder count as two)."""
    paths = {_module_name(p): p for p in LAB.rglob("*.py")}
    edges = {(_folder(a, paths), _folder(b, paths)) for a, imported in _import_graph().items() for b in imported}
    assert sorted((a, b) for a, b in edges if a < b and (b, a) in edges) == []


def test_no_lab_module_uses_a_private_name_of_another():
    """What one module offers another is public: no ``from m import _x``, no ``m._x`` on an
    imported lab module, no import of a module whose name starts with one underscore."""
    private = lambda name: name.startswith("_") and not name.startswith("__")  # noqa: E731
    modules = {_module_name(p) for p in LAB.rglob("*.py")}
    found = []
    for path in sorted(LAB.rglob("*.py")):
        aliases = {}
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sparsecomm.lab"):
                for alias in node.names:
                    name = f"{node.module}.{alias.name}"
                    if name in modules:
                        aliases[alias.asname or alias.name] = name
                    if private(alias.name) or any(private(part) for part in node.module.split(".")):
                        found.append(f"{path.relative_to(LAB)}: from {node.module} import {alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules and alias.asname:
                        aliases[alias.asname] = alias.name
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                if private(node.attr):
                    found.append(f"{path.relative_to(LAB)}: {aliases[node.value.id]}.{node.attr}")
    assert found == []


@pytest.mark.parametrize("first", ["ledger", "tolerance", "plots", "report"])
def test_each_printing_module_imports_first_in_a_fresh_interpreter(first):
    code = f"import sparsecomm.lab.{first}, sparsecomm.lab.report, sparsecomm.lab.costmodel"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
