"""Temporary directories of a save, named after the process that owns them.

A save writes into ``.tmp-step-<step>-<token>-<pid>-<host>`` and a deletion first renames
its directory to ``.trash-step-...`` (so readers stop seeing it at once, and a crash
mid-delete leaves nothing that looks like a checkpoint). A process killed in between
leaves such a directory behind; the next save or load of the same root removes it when
no live process can still own it: its process is gone (same host, pid not running), or
it is this process's own and the save that made it has ended. Directories of other
hosts, and of a live process (a concurrent job, or a reused pid), are left alone.
"""
import os
import re
import shutil
import socket
import threading
from pathlib import Path

_NAME = re.compile(r"^\.(tmp|trash)-step-(\d{8})-([0-9a-f]{8})-(\d+)-(.+)$")
_ACTIVE: set[str] = set()  # names this process is using now (a save may run in a thread)
_LOCK = threading.Lock()


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def new_name(kind: str, step: int, token: str | None = None) -> str:
    """A fresh directory name owned by this process; in use until :func:`release`."""
    name = f".{kind}-step-{step:08d}-{token or os.urandom(4).hex()}-{os.getpid()}-{_host()}"
    with _LOCK:
        _ACTIVE.add(name)
    return name


def release(name: str) -> None:
    with _LOCK:
        _ACTIVE.discard(name)


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def is_stale(name: str) -> bool:
    match = _NAME.match(name)
    if match is None or match.group(5) != _host():
        return False
    with _LOCK:
        if name in _ACTIVE:
            return False
    pid = int(match.group(4))
    return pid == os.getpid() or not _pid_running(pid)


def remove_stale(root: Path) -> list[str]:
    """Remove leftovers of killed saves and deletions under ``root``; returns their names."""
    root = Path(root)
    removed = []
    if not root.is_dir():
        return removed
    for path in root.iterdir():
        if path.is_dir() and is_stale(path.name):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return removed


def delete_directory(path: Path, step: int) -> None:
    """Rename ``path`` out of sight, then delete it (a crash mid-delete leaves trash, not a step)."""
    name = new_name("trash", step)
    trash = path.parent / name
    try:
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)
    finally:
        release(name)
