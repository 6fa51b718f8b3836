"""A subreaper between the runner and a launch: every process the launch starts ends with it.

The runner starts each launch command (torchrun, mpiexec, or one rank in a network
namespace) as ``python -m sparsecomm.lab.experiment.launch_supervisor -- ARGV...``. The
supervisor marks itself a child subreaper (``PR_SET_CHILD_SUBREAPER``): a process of the
launch whose parent dies is re-parented to the supervisor instead of init, so every process
the launch ever started stays a descendant of the supervisor, whatever it did to hide (its
own session, a cleared environment, a double fork: the marks of
:mod:`sparsecomm.lab.experiment.process_tree` cannot find those). When the launch command
exits, or the supervisor is told to stop (SIGTERM: the runner kills the run, or the runner
died: the supervisor's death signal), it SIGKILLs every descendant, again until none is
left, reaps them and exits with the launch command's exit code (128 + the signal when it
was stopped or the command was killed).

Its limits: a process started outside this tree (a system service, ``ssh``, a container
runtime asked to start it) is not a descendant; and a supervisor killed with SIGKILL
cannot sweep (the runner stops it with SIGTERM first: :func:`stop`). Elsewhere than
Linux there is no subreaper and no /proc: the supervisor just runs the command.
"""
import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
SWEEP_TIMEOUT_S = 20.0
"""How long a sweep may take before the supervisor gives up (processes in uninterruptible sleep)."""


def command(argv: list[str]) -> list[str]:
    """``argv`` run under a supervisor."""
    return [sys.executable, "-m", "sparsecomm.lab.experiment.launch_supervisor", "--", *argv]


def stop(supervisors: list[subprocess.Popen], timeout: float) -> None:
    """Ask running supervisors to kill their launches (SIGTERM) and wait up to ``timeout``
    seconds for them to have swept and exited (the caller SIGKILLs whatever is left then)."""
    running = [proc for proc in supervisors if proc.poll() is None]
    for proc in running:
        try:
            proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    for proc in running:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


def _prctl(option: int, value: int) -> bool:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def descendants(pid: int) -> list[int]:
    """Pids of every living descendant of ``pid`` (from /proc; empty where there is none)."""
    children: dict[int, list[int]] = {}
    try:
        entries = [entry for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return []
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")".
        fields = stat[stat.rindex(b")") + 2:].split()
        children.setdefault(int(fields[1]), []).append(int(entry))
    found, queue = [], list(children.get(pid, []))
    while queue:
        child = queue.pop()
        found.append(child)
        queue.extend(children.get(child, []))
    return found


def _reap() -> None:
    """Collect every child that has exited (zombies of the launch, re-parented to us)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def sweep(timeout: float = SWEEP_TIMEOUT_S) -> None:
    """SIGKILL every descendant of this process, again until none is left (or ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        _reap()
        left = descendants(os.getpid())
        if not left or time.monotonic() > deadline:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.01)


class _Stop(Exception):
    """SIGTERM while the launch runs."""


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m sparsecomm.lab.experiment.launch_supervisor -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        _prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))  # the runner dies: sweep, then go
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        if os.getppid() != parent:  # the runner died before the death signal was armed
            return 128 + signal.SIGTERM
    waiting = [True]

    def on_signal(signum, frame):
        if waiting[0]:
            raise _Stop(signum)

    signal.signal(signal.SIGTERM, on_signal)
    from sparsecomm.lab.experiment.process_tree import death_signal_preexec

    code = 128 + signal.SIGTERM
    try:
        launch = subprocess.Popen(argv, preexec_fn=death_signal_preexec())
        while True:  # reap every child, ours and re-parented ones, until the launch command exits
            pid, status = os.waitpid(-1, 0)
            if pid == launch.pid:
                code = os.waitstatus_to_exitcode(status)
                code = 128 - code if code < 0 else code
                break
    except _Stop:
        pass
    finally:
        waiting[0] = False
        sweep()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
