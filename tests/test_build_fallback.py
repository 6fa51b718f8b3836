"""setup.py: a failed native build installs the reference path and says why (or fails, if asked).

Runs `setup.py build_ext` on a copy of the sources with a compiler that always fails.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(240)


def _build_with_broken_compiler(tmp_path: Path, mode: str | None) -> subprocess.CompletedProcess:
    source = tmp_path / "src"
    source.mkdir()
    shutil.copy(ROOT / "setup.py", source)
    shutil.copy(ROOT / "README.md", source)
    shutil.copytree(ROOT / "csrc", source / "csrc")
    shutil.copytree(ROOT / "sparsecomm", source / "sparsecomm",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    env = {**os.environ, "CXX": "false", "CC": "false", "USE_CUDA": "0"}
    env.pop("SPARSECOMM_BUILD_EXT", None)
    if mode is not None:
        env["SPARSECOMM_BUILD_EXT"] = mode
    return subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--build-lib", str(tmp_path / "lib"),
         "--build-temp", str(tmp_path / "tmp")],
        cwd=source, env=env, capture_output=True, text=True, timeout=200,
    )


def test_failed_build_warns_and_installs_the_reference_path(tmp_path):
    result = _build_with_broken_compiler(tmp_path, None)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "WARNING: native kernels failed to build" in output
    assert "SPARSECOMM_BUILD_EXT=1 to make this an error" in output
    assert not list((tmp_path / "lib").rglob("_C*.so"))


def test_required_build_fails_loudly(tmp_path):
    result = _build_with_broken_compiler(tmp_path, "1")
    assert result.returncode != 0
    assert "WARNING: native kernels failed to build" not in result.stdout + result.stderr


def test_skipped_build_says_so(tmp_path):
    result = _build_with_broken_compiler(tmp_path, "0")
    assert result.returncode == 0
    assert "SPARSECOMM_BUILD_EXT=0: not building native kernels" in result.stdout + result.stderr
