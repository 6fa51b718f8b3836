"""Counts that say how the package is layered, each from the syntax tree or a profiler.

    python scripts/structure_counts.py               # every count below
    python scripts/structure_counts.py --bucket-path # also the files one default bucket crosses (2 gloo ranks)

* private uses: a name with one leading underscore (not a dunder) that one module of the package
  takes from another (``from m import _x``, ``m._x`` on an imported module, or importing a Python module
  of the package whose file name starts with ``_``);
* folder pairs: two folders of the package whose modules import each other (a parent and its subfolder
  count too);
* library lines: the lines of every ``.py`` file of the package outside ``sparsecomm/lab``;
* bucket path: every package file with a function called inside a steady-state step's hook call or its
  future callbacks (a profiler on every thread), on the default settings at 2 gloo ranks.
"""
import argparse
import ast
import os
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "sparsecomm"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in p.parts}


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _imports(modules):
    """(importer, imported module, names taken) for every import inside the package."""
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("sparsecomm"):
                        yield module, alias.name, ()
                        aliases[alias.asname or alias.name] = alias.name
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(module, is_package, node)
                if not target.startswith("sparsecomm"):
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if sub in modules:  # a submodule, not a name
                        yield module, sub, ()
                        aliases[alias.asname or alias.name] = sub
                    else:
                        yield module, target, (alias.name,)
        for node in ast.walk(tree):  # m._x on an imported module
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                if _is_private(node.attr):
                    yield module, aliases[node.value.id], (node.attr,)


def private_uses(modules) -> list[str]:
    found = []
    for importer, imported, names in _imports(modules):
        if imported == importer:
            continue
        # A private module of the package (a compiled extension such as sparsecomm._C has no
        # Python file and is not counted: its one loader is the module that wraps it).
        private_module = [p for p in imported.split(".") if _is_private(p)] if imported in modules else []
        if private_module and not names:
            found.append(f"{importer} imports module {imported}")
        found += [f"{importer} uses {imported}.{n}" for n in names if _is_private(n)]
    return sorted(set(found))


def _folder(module: str, modules) -> str:
    path = modules.get(module)
    if path is None:  # a name inside a package's __init__
        return module
    return ".".join(path.relative_to(ROOT).parent.parts)


def folder_pairs(modules) -> list[tuple[str, str]]:
    edges = defaultdict(set)
    for importer, imported, _ in _imports(modules):
        while imported not in modules and "." in imported:
            imported = imported.rsplit(".", 1)[0]
        a, b = _folder(importer, modules), _folder(imported, modules)
        if a != b:
            edges[a].add(b)
    return sorted({tuple(sorted((a, b))) for a in edges for b in edges[a] if a in edges.get(b, ())})


def library_lines(modules) -> int:
    return sum(len(p.read_text().splitlines()) for m, p in modules.items() if not m.startswith("sparsecomm.lab"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bucket-path", action="store_true", help="also profile one default bucket (2 gloo ranks)")
    args = parser.parse_args(argv)
    modules = _modules()
    uses = private_uses(modules)
    pairs = folder_pairs(modules)
    print(f"private uses: {len(uses)}")
    for line in uses:
        print(f"  {line}")
    print(f"folder pairs that import each other: {len(pairs)}")
    for a, b in pairs:
        print(f"  {a} <-> {b}")
    print(f"library lines (sparsecomm without sparsecomm/lab): {library_lines(modules)}")
    print(f"files in sparsecomm/hooks (root): {len(list((PACKAGE / 'hooks').glob('*.py')))}")
    if args.bucket_path:
        sys.path.insert(0, str(ROOT / "scripts"))
        from bucket_path import files_one_bucket_crosses
        files = files_one_bucket_crosses()
        print(f"package files one default bucket crosses: {len(files)}")
        for f in files:
            print(f"  {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
