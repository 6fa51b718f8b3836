"""Emulated networks in tests: whether this machine can build them, and one test at a time
building them across the suite's pytest-xdist workers.

Tests of emulated links compare the machine's ``sparsecomm-*`` network namespaces before and
after ("nothing left behind"), and a network built by a test in the other worker would show
up in that comparison. Every test that builds a network (tests/test_links.py,
tests/test_runner_lifecycle.py) holds :func:`network_namespaces_lock` while it does."""
import contextlib
import fcntl
import os
import subprocess
import sys
import tempfile

LOCK_PATH = os.path.join(tempfile.gettempdir(), f"sparsecomm-tests-{os.getuid()}-network-namespaces.lock")


@contextlib.contextmanager
def network_namespaces_lock():
    with open(LOCK_PATH, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes
        yield


def emulation_unavailable() -> str | None:
    """Why links cannot be emulated here, or None. The probe namespace is named after this
    process: both workers import the test files, so both probe, at the same time."""
    if sys.platform != "linux":
        return "needs Linux network namespaces"
    from sparsecomm.links import parse_link
    from sparsecomm.links.netns import LinkEmulationError, check_emulation_possible

    probe = f"sparsecomm-probe-{os.getpid()}"
    try:
        check_emulation_possible(parse_link("100mbit"))
        for verb in ("add", "del"):
            subprocess.run(["ip", "netns", verb, probe], check=True, capture_output=True, timeout=30)
    except LinkEmulationError as error:
        return str(error)
    except subprocess.CalledProcessError as error:
        return f"cannot create network namespaces here: {error.stderr.decode().strip()}"
    return None
