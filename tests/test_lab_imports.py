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
    assert graph["sparsecomm.lab.text"] == set()
    assert "sparsecomm.lab.ledger" not in graph["sparsecomm.lab.plots"]
    assert {"sparsecomm.lab.ledger", "sparsecomm.lab.plots", "sparsecomm.lab.tolerance"} <= graph["sparsecomm.lab.report"]


@pytest.mark.parametrize("first", ["ledger", "tolerance", "plots", "report"])
def test_each_printing_module_imports_first_in_a_fresh_interpreter(first):
    code = f"import sparsecomm.lab.{first}, sparsecomm.lab.report, sparsecomm.lab.costmodel"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
