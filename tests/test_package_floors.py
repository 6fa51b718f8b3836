"""The package's folders are floors that only point down, and no module takes another's private
names (docs/architecture.md; ``scripts/structure_counts.py`` prints the same counts)."""
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "structure_counts.py"


@pytest.fixture(scope="module")
def counts():
    spec = importlib.util.spec_from_file_location("structure_counts", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, module._modules()


def test_no_two_folders_of_the_package_import_each_other(counts):
    module, modules = counts
    assert "sparsecomm.hooks.wires.owner" in modules and "sparsecomm.lab.report" in modules  # the scan sees the tree
    assert module.folder_pairs(modules) == []


def test_no_module_uses_a_private_name_of_another(counts):
    module, modules = counts
    assert module.private_uses(modules) == []


def test_the_counter_sees_what_it_counts(counts, tmp_path):
    """The counts themselves, on a made-up package: a pair of folders and a private name."""
    module, _ = counts
    root = tmp_path / "sparsecomm"
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    for path, text in {"__init__.py": "", "a/__init__.py": "", "b/__init__.py": "",
                       "a/one.py": "from sparsecomm.b.two import _hidden\n",
                       "b/two.py": "from sparsecomm.a import one\n_hidden = 1\n"}.items():
        (root / path).write_text(text)
    modules = {".".join(p.relative_to(tmp_path).with_suffix("").parts).removesuffix(".__init__"): p
               for p in sorted(root.rglob("*.py"))}
    saved = module.ROOT
    module.ROOT = tmp_path
    try:
        assert module.folder_pairs(modules) == [("sparsecomm.a", "sparsecomm.b")]
        assert module.private_uses(modules) == ["sparsecomm.a.one uses sparsecomm.b.two._hidden"]
    finally:
        module.ROOT = saved
