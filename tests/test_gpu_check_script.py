"""scripts/gpu_check.sh, in its dry run (GPU_CHECK_DRY_RUN=1: print the steps, run none), on CPU.

The GPU machine's image may have python3 alone, is offline and has its own torch: the script
must pick the interpreter that imports torch, build against it without pip, and name the
tests it runs. Stand-in interpreters (shell scripts) log every call, so the test also sees
that a dry run starts nothing but the probes.
"""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
BASH = shutil.which("bash")
PROBE_TORCH = "-c import torch"
PROBE_PYTEST = "-c import pytest, pytest_timeout"


def _interpreter(path: Path, log: Path, fails: tuple[str, ...] = ()) -> None:
    """A stand-in interpreter: appends its arguments to ``log``; fails the calls in ``fails``."""
    cases = "".join(f'  "{call}") exit 1 ;;\n' for call in fails)
    path.write_text(f'#!/bin/sh\necho "{path.name} $*" >> {log}\ncase "$*" in\n{cases}esac\nexit 0\n')
    path.chmod(0o755)


@pytest.fixture
def machine(tmp_path):
    """A PATH with the system's commands but no python of its own; stand-ins go into its bin."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for system_dir in ("/usr/local/bin", "/usr/bin", "/bin"):
        for tool in Path(system_dir).iterdir() if Path(system_dir).is_dir() else ():
            if not tool.name.startswith("python") and not (bin_dir / tool.name).exists():
                (bin_dir / tool.name).symlink_to(tool)
    return bin_dir, tmp_path / "calls.log"


def _dry_run(bin_dir: Path, **env) -> subprocess.CompletedProcess:
    environ = {key: value for key, value in os.environ.items() if key not in ("PYTHON", "PYTHONPATH")}
    environ.update(PATH=str(bin_dir), GPU_CHECK_DRY_RUN="1", TMPDIR=str(bin_dir.parent), **env)
    return subprocess.run([BASH, str(SCRIPT)], cwd=bin_dir.parent, env=environ, capture_output=True, text=True,
                          timeout=60)


def _calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_the_script_parses():
    result = subprocess.run([BASH, "-n", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_python3_alone_is_picked_and_the_build_uses_it_without_pip(machine):
    bin_dir, log = machine
    _interpreter(bin_dir / "python3", log)
    result = _dry_run(bin_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "gpu_check: interpreter python3" in result.stdout
    build = [line for line in result.stdout.splitlines() if "setup.py" in line]
    assert build == ["+ env MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 USE_CUDA=1 SPARSECOMM_BUILD_EXT=1 "
                     "python3 setup.py build_ext --inplace"]
    assert "pip" not in result.stdout
    # A dry run starts only the probes: does python3 import torch, can the tests run.
    assert _calls(log) == [f"python3 {PROBE_TORCH}", f"python3 {PROBE_PYTEST}"]


def test_the_steps_name_files_that_exist(machine):
    bin_dir, log = machine
    _interpreter(bin_dir / "python3", log)
    output = _dry_run(bin_dir).stdout
    tests = re.findall(r"tests/\S+\.py", next(line for line in output.splitlines() if "-m pytest" in line))
    assert "tests/test_op_ef_topk_pack.py" in tests and "tests/test_hsdp_cuda.py" in tests
    assert len(set(tests)) == len(tests), f"a test file listed twice: {tests}"
    for path in tests + re.findall(r"experiments/\S+\.py", output):
        assert (ROOT / path).is_file(), f"gpu_check.sh names {path}, which does not exist"
    # The package comes from the checkout in every process the tests start.
    assert f"PYTHONPATH={ROOT}\n" in output


def test_python_is_picked_when_python3_has_no_torch(machine):
    bin_dir, log = machine
    _interpreter(bin_dir / "python3", log, fails=(PROBE_TORCH,))
    _interpreter(bin_dir / "python", log)
    result = _dry_run(bin_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "gpu_check: interpreter python" in result.stdout
    assert "+ env MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 USE_CUDA=1 SPARSECOMM_BUILD_EXT=1 python setup.py" in result.stdout


def test_the_interpreter_can_be_named(machine):
    bin_dir, log = machine
    _interpreter(bin_dir / "python3", log)
    chosen = bin_dir.parent / "env" / "python3.12"
    chosen.parent.mkdir()
    _interpreter(chosen, log)
    result = _dry_run(bin_dir, PYTHON=str(chosen), TORCH_CUDA_ARCH_LIST="8.0;9.0", MAX_JOBS="4")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"+ env MAX_JOBS=4 TORCH_CUDA_ARCH_LIST=8.0\\;9.0 USE_CUDA=1 SPARSECOMM_BUILD_EXT=1 {chosen} setup.py" \
        in result.stdout
    assert not any(call.startswith("python3 ") for call in _calls(log)), "python3 was tried although PYTHON was set"


def test_no_interpreter_with_torch_is_an_error_naming_the_variable(machine):
    bin_dir, log = machine
    _interpreter(bin_dir / "python3", log, fails=(PROBE_TORCH,))
    result = _dry_run(bin_dir)
    assert result.returncode == 1
    assert "neither python3 nor python on PATH imports torch; set PYTHON=" in result.stderr
    assert "==" not in result.stdout, "a step ran without an interpreter"


def test_without_pytest_the_tests_are_skipped_by_name_and_the_exit_status_says_so(machine):
    bin_dir, log = machine
    _interpreter(bin_dir / "python3", log, fails=(PROBE_PYTEST,))
    result = _dry_run(bin_dir)
    assert result.returncode == 1
    assert "tests SKIPPED: python3 cannot import pytest and pytest_timeout" in result.stdout
    assert "-m pytest" not in result.stdout
    assert "experiments/bench_kernels.py" in result.stdout, "the benchmark runs without the tests"
