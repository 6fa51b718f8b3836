"""The processes of one launch: marked, so that all of them can be found and killed.

torchrun starts its ranks in sessions of their own, so no process group or session covers
a run. Every process of a launch carries ``SPARSECOMM_LAUNCH=<fresh id>`` in its
environment (inherited by everything it starts: torchrun copies its environment into the
ranks, ``ip netns exec`` keeps it), and killing a run means SIGKILL to every process whose
``/proc/<pid>/environ`` holds that id, repeated until none is left: it finds ranks however
they were started and whoever their parent is now (an orphaned rank is re-parented, its
environment stays), and a process started while we kill is found in the next pass. If the
runner itself dies without cleaning up (SIGKILL), a death signal (``PR_SET_PDEATHSIG``)
takes down torchrun (or the ranks it started directly), and each rank arms the same
signal against its own parent.
"""
import ctypes
import functools
import os
import signal
import subprocess
import sys
import time

LAUNCH_ENV = "SPARSECOMM_LAUNCH"
"""Set by the runner on every process of one launch (a fresh id per launch): the processes
it kills, and the id a result or rank error carries (a stale file from another launch is ignored)."""
RUN_DIR_ENV = "SPARSECOMM_RUN_DIR"
"""Set by the runner on every process of a launch: the run directory (its leftovers can be found)."""
KILL_TIMEOUT_S = 30.0
PR_SET_PDEATHSIG = 1


def marked_processes(name: str, value: str) -> list[int]:
    """Pids of the processes (other than this one) whose environment holds ``name=value``.

    Read from ``/proc/<pid>/environ`` (the environment the process was started with);
    processes of other users and processes that exit while we look are skipped. Empty where
    there is no /proc.
    """
    entry = f"{name}={value}".encode()
    me = os.getpid()
    try:
        pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return []
    found = []
    for pid in pids:
        if pid == me:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        if entry in environ.split(b"\0"):
            found.append(pid)
    return found


def kill_marked(name: str, value: str, children: list[subprocess.Popen] = (),
                timeout: float = KILL_TIMEOUT_S) -> list[int]:
    """SIGKILL every process marked ``name=value`` and every one of ``children`` (our own,
    each in its own session: its whole group), again and again until none is left; reaps
    ``children``. Returns the pids still alive after ``timeout`` (normally none)."""
    deadline = time.monotonic() + timeout
    while True:
        marked = marked_processes(name, value)
        for pid in marked:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for proc in children:
            if proc.poll() is None:  # not reaped yet: its pid (and group id) is still its own
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        alive = [proc.pid for proc in children if proc.poll() is None]
        if not marked and not alive:
            return []
        if time.monotonic() > deadline:
            return sorted(set(marked) | set(alive))
        time.sleep(0.02)


def die_with_parent(death_signal: int = signal.SIGKILL) -> None:
    """Linux: this process gets ``death_signal`` (SIGKILL) when the process that started it
    dies (however it dies, SIGKILL included), so a killed runner or torchrun agent never
    leaves ranks training on. Exits at once if the parent is already gone. A no-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(death_signal), 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the death signal was armed
        os._exit(1)


def death_signal_preexec(death_signal: int = signal.SIGKILL):
    """A ``preexec_fn`` for subprocess.Popen: the child gets ``death_signal`` (SIGKILL: dies)
    when this process dies (:func:`die_with_parent`, armed between fork and exec; it survives
    exec). None off Linux."""
    return functools.partial(die_with_parent, death_signal) if sys.platform.startswith("linux") else None
