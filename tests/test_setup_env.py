"""scripts/setup_env.sh installs again only when an input of the install changed.

The decision (scripts/setup_stamp.py) runs against a fake checkout in a temporary folder:
a stamp written for some inputs, then one input changed at a time. The shell script itself
runs on a fake checkout whose .venv/bin/pip only logs its arguments, so no test installs
anything.
"""
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCH = "2.13.0+cpu"
PYTHON = "3.11.7"


def _load_helper():
    spec = importlib.util.spec_from_file_location("setup_stamp", ROOT / "scripts" / "setup_stamp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


setup_stamp = _load_helper()


@pytest.fixture
def tree(tmp_path):
    """A checkout with what the install is made from, and a stamp recording its inputs now."""
    root = tmp_path / "checkout"
    (root / "csrc" / "cpu").mkdir(parents=True)
    (root / "scripts").mkdir()
    (root / "sparsecomm").mkdir()
    (root / "setup.py").write_text("setup()\n")
    (root / "scripts" / "setup_env.sh").write_text("pip install -e .\n")
    (root / "csrc" / "ops.cpp").write_text("int op();\n")
    (root / "csrc" / "cpu" / "kernel.h").write_text("#pragma once\n")
    (root / "sparsecomm" / "hook.py").write_text("x = 1\n")
    stamp = root / ".venv" / "sparsecomm-setup.json"
    stamp.parent.mkdir()
    setup_stamp.write_stamp(stamp, _inputs(root), native=True)
    return root, stamp


def _inputs(root, environ=None, torch_version=TORCH, python_version=PYTHON):
    return setup_stamp.current_inputs(root, environ or {}, torch_version, python_version)


def test_unchanged_inputs_skip_the_install(tree):
    root, stamp = tree
    assert setup_stamp.reason_to_install(stamp, _inputs(root)) is None
    # A Python file of the package is read in place by the editable install: no input.
    (root / "sparsecomm" / "hook.py").write_text("x = 2\n")
    (root / "sparsecomm" / "new_module.py").write_text("y = 1\n")
    assert setup_stamp.reason_to_install(stamp, _inputs(root)) is None


@pytest.mark.parametrize("change,named", [
    (lambda root: (root / "csrc" / "cpu" / "kernel.h").write_text("#pragma once\n// edited\n"), "csrc/cpu/kernel.h"),
    (lambda root: (root / "csrc" / "cpu" / "new_op.cpp").write_text("int new_op();\n"), "csrc/cpu/new_op.cpp"),
    (lambda root: (root / "csrc" / "ops.cpp").unlink(), "csrc/ops.cpp"),
    (lambda root: (root / "setup.py").write_text("setup(name='x')\n"), "setup.py"),
    (lambda root: (root / "pyproject.toml").write_text("[build-system]\n"), "pyproject.toml"),
    (lambda root: (root / "scripts" / "setup_env.sh").write_text("pip install -e '.[test]'\n"), "scripts/setup_env.sh"),
])
def test_a_changed_file_installs_again_and_is_named(tree, change, named):
    root, stamp = tree
    change(root)
    reason = setup_stamp.reason_to_install(stamp, _inputs(root))
    assert reason == f"changed since the last install: {named}"


@pytest.mark.parametrize("inputs_now,named", [
    (dict(torch_version="2.11.0"), "torch"),
    (dict(torch_version=None), "torch"),  # torch uninstalled
    (dict(python_version="3.12.3"), "python"),
    (dict(environ={"USE_CUDA": "1"}), "$USE_CUDA"),
    (dict(environ={"SPARSECOMM_BUILD_EXT": "0"}), "$SPARSECOMM_BUILD_EXT"),
    (dict(environ={"DEBUG": "1"}), "$DEBUG"),
    (dict(environ={"SPARSECOMM_TORCH": "torch==2.12.0"}), "$SPARSECOMM_TORCH"),
])
def test_a_changed_version_or_switch_installs_again(tree, inputs_now, named):
    root, stamp = tree
    assert setup_stamp.reason_to_install(stamp, _inputs(root, **inputs_now)) == f"changed since the last install: {named}"


def test_many_changes_are_named_up_to_a_few_and_counted(tree):
    root, stamp = tree
    for name in ("a", "b", "c", "d", "e"):
        (root / "csrc" / f"{name}.cpp").write_text(name)
    reason = setup_stamp.reason_to_install(stamp, _inputs(root, torch_version="2.12.0"))
    assert reason == "changed since the last install: csrc/a.cpp, csrc/b.cpp, csrc/c.cpp and 3 more"


@pytest.mark.parametrize("content", ["", "{not json", "[]", '{"inputs": {}}', '{"inputs": [], "native": true}',
                                     '{"inputs": {}, "native": "yes"}'])
def test_a_garbled_stamp_installs_again(tree, content):
    root, stamp = tree
    stamp.write_text(content)
    assert setup_stamp.reason_to_install(stamp, _inputs(root)) == f"no install recorded ({stamp} unreadable)"


def test_a_missing_stamp_installs_again(tree):
    root, stamp = tree
    stamp.unlink()
    assert setup_stamp.reason_to_install(stamp, _inputs(root)) == f"no install recorded ({stamp} missing)"


def test_every_variable_setup_py_reads_is_an_input():
    source = (ROOT / "setup.py").read_text()
    read = set(re.findall(r"""os\.(?:environ\.get|getenv)\(\s*["']([A-Z_0-9]+)["']""", source))
    read |= set(re.findall(r"""os\.environ\[\s*["']([A-Z_0-9]+)["']\s*\]""", source))
    assert read >= {"SPARSECOMM_BUILD_EXT", "USE_CUDA", "DEBUG"}, "the scan no longer finds setup.py's switches"
    assert read <= set(setup_stamp.ENV_SWITCHES), f"not in setup_stamp.ENV_SWITCHES: {read - set(setup_stamp.ENV_SWITCHES)}"


def test_an_install_that_no_longer_works_installs_again(monkeypatch):
    monkeypatch.setattr(setup_stamp, "load_native", lambda: (False, "undefined symbol"))
    assert setup_stamp.installed_problem(native_expected=True) == "the native kernels no longer load (undefined symbol)"
    assert setup_stamp.installed_problem(native_expected=False) is None  # the install had none: nothing lost

    def broken():
        raise ImportError("No module named 'sparsecomm'")
    monkeypatch.setattr(setup_stamp, "load_native", broken)
    assert setup_stamp.installed_problem(native_expected=False) == (
        "the installed sparsecomm no longer imports (ImportError: No module named 'sparsecomm')")


# --- the shell script, on a fake checkout whose pip only logs -------------------------------------

@pytest.fixture
def checkout(tmp_path):
    """The real scripts and build inputs; .venv/bin/python runs this interpreter (whose
    environment has sparsecomm installed), .venv/bin/pip appends its arguments to pip.log."""
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    for name in ("setup_env.sh", "setup_stamp.py"):
        shutil.copy(ROOT / "scripts" / name, root / "scripts")
    shutil.copy(ROOT / "setup.py", root)
    shutil.copytree(ROOT / "csrc", root / "csrc")
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name, body in (("python", f'exec {sys.executable} "$@"'), ("pip", f'echo "$@" >> {root / "pip.log"}')):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return root


def _set_up(root: Path) -> tuple[str, list[str]]:
    """Run setup_env.sh; its output and the pip commands it ran."""
    env = {key: value for key, value in os.environ.items() if key not in setup_stamp.ENV_SWITCHES}
    result = subprocess.run(["bash", "scripts/setup_env.sh"], cwd=root, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    log = root / "pip.log"
    commands = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    return result.stdout, commands


def test_setup_env_installs_once_then_skips_until_csrc_changes(checkout):
    stamp = checkout / ".venv" / "sparsecomm-setup.json"
    output, commands = _set_up(checkout)
    assert "no install recorded (.venv/sparsecomm-setup.json missing)" in output
    assert commands[-1] == "install --quiet --no-build-isolation --use-pep517 --editable .[test]"
    recorded = json.loads(stamp.read_text())
    assert recorded["inputs"]["torch"] == setup_stamp._torch_version()
    assert recorded["inputs"]["python"] == platform.python_version()

    output, commands = _set_up(checkout)
    assert "up to date" in output and commands == []

    header = checkout / "csrc" / "cpu" / "magnitude_key.h"
    header.write_text(header.read_text() + "\n")
    output, commands = _set_up(checkout)
    assert "changed since the last install: csrc/cpu/magnitude_key.h" in output
    assert any("--editable" in command for command in commands)
    output, commands = _set_up(checkout)
    assert "up to date" in output and commands == []


def test_no_stamp_when_an_input_changes_during_the_install(checkout):
    """The digest taken before pip ran no longer matches: the build may hold the old source."""
    stamp = checkout / ".venv" / "sparsecomm-setup.json"
    before = subprocess.run([sys.executable, "scripts/setup_stamp.py", "digest"], cwd=checkout,
                            capture_output=True, text=True, check=True).stdout.strip()
    (checkout / "csrc" / "edited_meanwhile.h").write_text("// new\n")
    result = subprocess.run([sys.executable, "scripts/setup_stamp.py", "write", str(stamp), before], cwd=checkout,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "changed while it ran" in result.stdout
    assert not stamp.exists()


def test_the_helper_names_a_missing_argument():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "setup_stamp.py"), "write", "stamp.json"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "write needs the digest that `digest` printed before the install" in result.stderr
