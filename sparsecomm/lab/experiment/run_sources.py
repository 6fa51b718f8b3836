"""What a run executes of your code, for its run hash: your task's or script's file, the
modules it imports from your own tree, and the files you declare.

A finished run is reused when its hash matches ("finished earlier, skipped"), so the hash
must change when the code the run executes changes. For a user task (``file.py:FACTORY``
or ``MODULE:FACTORY``) or a script, the hash covers the contents of:

- the file itself (a task module's own file, when it is in your tree);
- every module it imports that lives in your tree, found by reading its ``import``
  statements (nothing is run): not the standard library, not an installed package (a
  ``site-packages`` or ``dist-packages`` directory), not sparsecomm itself; and, the same
  way, what those modules import (a package's ``__init__.py`` files included);
- the experiment's ``sources`` (``--sources``): files and directories the reading cannot
  find, such as data files or modules imported by a name computed at run time.

What the reading cannot cover is named in :attr:`Code.not_covered`, which the runner prints
as a warning: an import not found here, and a call that imports or runs code by a name
known only at run time (``importlib.import_module(name)``, ``__import__``, ``runpy``,
``exec``). Installed packages are not covered (the run records torch's version).
"""
import ast
import hashlib
import os
import site
import sys
import sysconfig
from dataclasses import dataclass, field
from importlib.machinery import ModuleSpec, PathFinder
from pathlib import Path

LAB_PACKAGE = "sparsecomm"
"""The lab's own package: its code is not the user's (the run records its git commit)."""
DYNAMIC_IMPORTS = {"import_module": "importlib.import_module", "run_path": "runpy.run_path",
                   "run_module": "runpy.run_module", "spec_from_file_location": "importlib.util.spec_from_file_location"}
"""Functions (called by name or as an attribute) that import or run code by a name the reading
may not know -> how the warning writes them. With a string literal, the module is followed."""
BUILTIN_DYNAMIC = {"__import__": "__import__", "exec": "exec"}
"""The same, for built-ins (called by name only)."""


@dataclass
class Code:
    """The files a run executes of the user's code (label -> sha256 of the contents) and
    what reading the code could not cover."""

    entry: str | None = None
    """The label of the script or task file (None: a task module that is not in the user's tree)."""
    files: dict[str, str] = field(default_factory=dict)
    paths: dict[str, str] = field(default_factory=dict)
    """label -> the file's absolute path (where a rank checks that it did not change)."""
    not_covered: list[str] = field(default_factory=list)

    def add(self, label: str, path) -> None:
        self.files[label] = _sha256(path)
        self.paths[label] = os.path.abspath(path)

    def digest(self, *, without_entry: bool = False) -> str | None:
        """sha256 over (label, contents' sha256) of the covered files; None when there are none."""
        covered = sorted((label, sha) for label, sha in self.files.items() if not (without_entry and label == self.entry))
        return hashlib.sha256(repr(covered).encode()).hexdigest() if covered else None

    def to_record(self) -> dict:
        """What run-config.json keeps of it: a rank checks the files against it (:meth:`changed`)."""
        return {"entry": self.entry, "files": self.files, "paths": self.paths, "not_covered": self.not_covered}

    @classmethod
    def from_record(cls, record: dict) -> "Code":
        return cls(**record)

    def changed(self) -> list[str]:
        """Labels of the covered files whose contents are not what they were when read (or that are gone)."""
        def now(path):
            try:
                return _sha256(path)
            except OSError:
                return None

        return [label for label, sha in self.files.items() if now(self.paths[label]) != sha]


def _sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def installed_roots() -> tuple[str, ...]:
    """Directories whose modules are not the user's: the standard library and installed packages."""
    paths = sysconfig.get_paths()
    base = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix})
    roots = {p[key] for p in (paths, base) for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots.update(site.getsitepackages() if hasattr(site, "getsitepackages") else [])
    roots.add(site.getusersitepackages())
    return tuple(sorted(os.path.realpath(root) for root in roots))


def _is_installed(path: str, roots: tuple[str, ...]) -> bool:
    real = os.path.realpath(path)
    parts = Path(real).parts
    return "site-packages" in parts or "dist-packages" in parts or any(
        real == root or real.startswith(root + os.sep) for root in roots)


class _Reader:
    """Follows the imports of the user's files, breadth first, hashing each covered file once."""

    def __init__(self, search_path: list[str], label_base: Path):
        self.search_path = search_path
        self.label_base = label_base
        self.roots = installed_roots()
        self.code = Code()
        self.queue: list[Path] = []
        self.seen: set[str] = set()

    def label(self, path: Path) -> str:
        return os.path.relpath(path, self.label_base)

    def cover(self, path: Path) -> None:
        real = os.path.realpath(path)
        if real in self.seen:
            return
        self.seen.add(real)
        self.code.add(self.label(path), path)
        if path.suffix == ".py":
            self.queue.append(path)

    def run(self) -> Code:
        while self.queue:
            self.read(self.queue.pop(0))
        return self.code

    # -- finding modules without running them --------------------------------------------------

    def find(self, name: str, path: list[str] | None = None) -> list[tuple[ModuleSpec, list[str]]] | None:
        """(spec, the directories of its submodules) of ``name`` and of each package above it
        (``a``, ``a.b``, ``a.b.c``); None if not found."""
        found, locations = [], path if path is not None else self.search_path
        parts = name.split(".")
        for depth, part in enumerate(parts, start=1):
            # By its last part, in its package's directories: the spec's origin is all we need, and a
            # dotted name would make PathFinder look its parent up in sys.modules (never imported here).
            spec = PathFinder.find_spec(part, locations)
            if spec is None:
                return None
            if isinstance(spec.submodule_search_locations, (list, type(None))):
                inside = list(spec.submodule_search_locations or [])
            else:  # a namespace package (no __init__.py): its directories, without importing its parent
                inside = [os.path.join(location, part) for location in locations
                          if os.path.isdir(os.path.join(location, part))]
            found.append((spec, inside))
            locations = inside
            if depth < len(parts) and not locations:
                return None  # not a package: the rest is an attribute, or nothing
        return found

    def is_users(self, name: str, spec: ModuleSpec, inside: list[str]) -> bool:
        """Whether the module found is the user's (a file in a standard library's name, next to
        the script, is: it shadows the library's)."""
        if name.split(".")[0] == LAB_PACKAGE:
            return False
        location = spec.origin if spec.has_location else next(iter(inside), None)
        return location is not None and not _is_installed(location, self.roots)

    def follow(self, name: str, where: str, *, relative_to: Path | None = None, attributes=()) -> None:
        """Cover module ``name`` (and its packages) if it is the user's; ``attributes`` of a
        ``from name import a, b`` are followed when they are submodules."""
        top = name.split(".")[0]
        if relative_to is None and (top in sys.builtin_module_names or top == LAB_PACKAGE):
            return  # built into the interpreter (no file), or the lab
        if relative_to is not None:
            found = self.find(name, [str(relative_to)]) if name else []
        else:
            found = self.find(name)
        if found is None:
            self.code.not_covered.append(f"{name!r} imported at {where} (not found here)")
            return
        package_dirs = [str(relative_to)] if relative_to is not None and not name else None
        for depth, (spec, inside) in enumerate(found, start=1):
            module = ".".join(name.split(".")[:depth])
            if relative_to is None and not self.is_users(module, spec, inside):
                return
            if spec.has_location and spec.origin:
                self.cover(Path(spec.origin))
            package_dirs = inside or None
        for attribute in attributes:
            if package_dirs and attribute != "*":
                found = PathFinder.find_spec(attribute, package_dirs)
                if found is not None and found.has_location and found.origin:
                    self.cover(Path(found.origin))

    # -- reading one file ----------------------------------------------------------------------

    def read(self, path: Path) -> None:
        label = self.label(path)
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError) as error:
            self.code.not_covered.append(f"the imports of {label} (it does not parse: {error})")
            return
        statements = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom, ast.Call))]
        for node in sorted(statements, key=lambda node: (node.lineno, node.col_offset)):  # warnings in reading order
            where = f"{label}:{node.lineno}"
            if isinstance(node, ast.Import):
                for alias in node.names:
                    self.follow(alias.name, where)
            elif isinstance(node, ast.ImportFrom):
                names = [alias.name for alias in node.names]
                if node.level:
                    base = path.parent
                    for _ in range(node.level - 1):
                        base = base.parent
                    self.follow(node.module or "", where, relative_to=base, attributes=names)
                else:
                    self.follow(node.module, where, attributes=names)
            elif isinstance(node, ast.Call):
                self.dynamic(node, where)

    def dynamic(self, call: ast.Call, where: str) -> None:
        function = call.func
        name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", None)
        known = {**DYNAMIC_IMPORTS, **(BUILTIN_DYNAMIC if isinstance(function, ast.Name) else {})}
        if name not in known:
            return
        first = call.args[0] if call.args else None
        literal = isinstance(first, ast.Constant) and isinstance(first.value, str)
        if name in ("import_module", "__import__", "run_module") and literal and not first.value.startswith("."):
            self.follow(first.value, where)
        elif name == "run_path" and literal:
            target = Path(first.value)
            if target.is_file():
                self.cover(target)
            else:
                self.code.not_covered.append(f"{first.value!r} run at {where} (not found here)")
        else:
            self.code.not_covered.append(f"what {known[name]}(...) at {where} loads (known only at run time)")


def _declared(reader: _Reader, sources, base: Path) -> None:
    for source in sources:
        path = base / source
        if path.is_dir():
            for directory, subdirectories, names in os.walk(path):
                subdirectories.sort()
                for name in sorted(names):
                    inside = os.path.relpath(os.path.join(directory, name), path)
                    reader.code.add(f"declared:{os.path.join(source, inside)}", os.path.join(directory, name))
        else:
            reader.code.add(f"declared:{source}", path)


def _search_path(entry_dir: Path, base: Path) -> list[str]:
    """Where the run's imports are looked up: the entry's directory (a script's sys.path[0]), the
    directory the experiment was started in (a task's), then this interpreter's path (PYTHONPATH,
    the standard library, site-packages) without its own first entry."""
    return [str(entry_dir), str(base), *[p for p in sys.path[1:] if p]]


def script_code(script: str, sources=(), base: Path | None = None) -> Code:
    """What a run of ``script`` executes of the user's code (paths relative to ``base``, default the
    current directory)."""
    base = Path.cwd() if base is None else Path(base)
    path = base / script
    reader = _Reader(_search_path(path.parent, base), path.parent)
    reader.cover(path)
    reader.code.entry = reader.label(path)
    _declared(reader, sources, base)
    return reader.run()


def task_code(task: str, sources=(), base: Path | None = None) -> Code:
    """What a run of the user task ``task`` (``file.py:FACTORY`` or ``MODULE:FACTORY``) executes
    of the user's code."""
    base = Path.cwd() if base is None else Path(base)
    module = task.split(":")[0]
    if module.endswith(".py"):
        path = base / module
        reader = _Reader(_search_path(path.parent, base), path.parent)
        reader.cover(path)
        reader.code.entry = reader.label(path)
    else:
        reader = _Reader([str(base), *[p for p in sys.path[1:] if p]], base)
        found = reader.find(module)
        if found is None or not reader.is_users(module, *found[-1]):
            where = "not found here" if found is None else "an installed package, outside your tree"
            reader.code.not_covered.append(f"task module {module!r} ({where}) and what it imports")
        else:
            reader.follow(module, f"task {task}")
            spec = found[-1][0]
            reader.code.entry = reader.label(Path(spec.origin)) if spec.has_location and spec.origin else None
    _declared(reader, sources, base)
    return reader.run()


def describe(code: Code, most: int = 8) -> list[str]:
    """Lines for the experiment's start: which files of the user's code the run hash covers, and
    a warning naming what it does not."""
    labels = sorted(code.files)
    shown = ", ".join(labels[:most]) + (f" and {len(labels) - most} more" if len(labels) > most else "")
    lines = [f"the run hash covers {len(labels)} file(s) of your code: {shown or 'none'}"]
    if code.not_covered:
        lines.append("warning: the run hash does not cover " + "; ".join(code.not_covered) + ". Editing those does "
                     "not make finished runs run again: list the files with --sources (config: sources)")
    return lines
