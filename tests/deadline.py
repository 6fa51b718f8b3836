"""Run a command from a test with a hard deadline: on timeout its whole session is killed
(a launcher and every rank it started), and the test fails with the output so far."""
import os
import signal
import subprocess

import pytest


def run_with_deadline(command: list[str], *, timeout: float, env: dict | None = None,
                      cwd=None) -> subprocess.CompletedProcess:
    """stdout and stderr together in ``.stdout``; the caller checks ``.returncode``."""
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{' '.join(command)} still running after {timeout}s; killed. Output:\n{output[-4000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, output, None)
