"""Processes of lab commands under test: found by what they mention (command line or
environment), started in sessions of their own, waited for with deadlines, and swept away
whatever happens (the ``sweep`` fixture), so a failing test never leaves one behind."""
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def processes_mentioning(text: str) -> list[tuple[int, str]]:
    """(pid, command line) of every process but this one whose command line or environment
    contains ``text`` (independent of the runner's own bookkeeping)."""
    needle, found = text.encode(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        if needle in cmdline or needle in environ:
            found.append((int(entry), cmdline.replace(b"\0", b" ").decode(errors="replace")[:300]))
    return found


def survivors_after(text: str, grace: float) -> list[tuple[int, str]]:
    """Processes mentioning ``text`` still there after up to ``grace`` seconds."""
    deadline = time.monotonic() + grace
    while True:
        found = processes_mentioning(text)
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


@pytest.fixture
def sweep(tmp_path):
    """At the end (pass or fail), SIGKILL whatever still mentions tmp_path."""
    yield tmp_path
    for _ in range(50):
        found = processes_mentioning(str(tmp_path))
        if not found:
            return
        for pid, _ in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def start_command(argv, *, env=None) -> subprocess.Popen:
    return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float) -> str:
    """Its output once it exits; past the deadline its group is killed and the test fails."""
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"still running after {timeout} s; killed. Output:\n{output[-4000:]}")
    return output


def wait_for(condition, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"exited with {proc.returncode} before {what}:\n{proc.stdout.read()[-4000:]}")
        time.sleep(0.005)
    pytest.fail(f"no {what} within {timeout} s")
