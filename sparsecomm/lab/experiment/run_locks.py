"""Locks that keep two commands from training, or mixing, the same runs.

A run directory is locked (``flock`` on ``run.lock``) while a process trains it; a second
command skips a locked run, trains the others, and then waits for the locked ones. The
kernel drops the lock of a process that dies, SIGKILL included: a lock is never stale. Two
commands with different configs under one experiment directory would overwrite each
other's ``experiment.json`` (the listing every report reads), so a command waits while
another process holds that directory for another config (until that process exits).
"""
import fcntl
import hashlib
import json
import os
from contextlib import contextmanager
from pathlib import Path

from sparsecomm.lab.experiment.config import ExperimentConfig
from sparsecomm.lab.experiment.files import open_no_follow, private_directory
from sparsecomm.lab.results.layout import LOCKS_DIR, RUN_LOCK


class RunLock:
    """An exclusive ``flock`` on the run directory's ``run.lock``, held while a process trains
    the run. The kernel releases it when the holder dies (SIGKILL included): never stale."""

    def __init__(self, out_dir: Path):
        self.path = Path(out_dir) / RUN_LOCK
        self.fd: int | None = None

    def acquire(self, blocking: bool = False) -> bool:
        fd = open_no_follow(self.path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return False
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return True

    def holder(self) -> str:
        """The pid the holder wrote (best effort: "?" when unknown)."""
        try:
            fd = open_no_follow(self.path, os.O_RDONLY)
        except (OSError, ValueError):
            return "?"
        with os.fdopen(fd) as f:
            return f.read().strip() or "?"

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


@contextmanager
def _flocked(path: Path, operation: int):
    fd = open_no_follow(path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, operation)
        yield fd
    finally:
        os.close(fd)


_HELD_EXPERIMENTS: dict[str, tuple[str, int]] = {}  # experiment dir -> (config id, fd with LOCK_SH)


def _config_id(config: ExperimentConfig) -> str:
    return hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def _busy_with_other_config(locks: Path, mine: str) -> Path | None:
    """A config lock of another config that some process holds (stale ones are removed)."""
    for path in sorted(locks.glob("config-*.lock")):
        if path.name == f"config-{mine}.lock":
            continue
        fd = open_no_follow(path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return path
        else:
            path.unlink(missing_ok=True)  # its holder is gone
        finally:
            os.close(fd)
    return None


def hold_experiment(config: ExperimentConfig, root: Path, progress=print, *, wait: bool = True) -> bool:
    """Claim ``root/<name>`` for this config (shared with processes running the same config)
    until this process exits or claims it for another config; while another process holds
    it for another config, wait (or return False with ``wait=False``). Two configs under one
    name would otherwise rewrite each other's experiment.json, which every report reads."""
    experiment_dir = Path(root) / config.name
    locks = private_directory(experiment_dir / LOCKS_DIR, root)
    key, mine = str(experiment_dir.resolve()), _config_id(config)
    held = _HELD_EXPERIMENTS.get(key)
    if held is not None and held[0] == mine:
        return True
    if held is not None:  # this process moves on to another config of the experiment
        os.close(held[1])
        del _HELD_EXPERIMENTS[key]
    announced = False
    while True:
        with _flocked(locks / "gate", fcntl.LOCK_EX):
            other = _busy_with_other_config(locks, mine)
            if other is None:
                fd = open_no_follow(locks / f"config-{mine}.lock", os.O_RDWR | os.O_CREAT)
                fcntl.flock(fd, fcntl.LOCK_SH)
                _HELD_EXPERIMENTS[key] = (mine, fd)
                return True
        if not wait:
            return False
        if not announced:
            progress(f"experiment {config.name}: another process is running it with a different configuration "
                     f"in {experiment_dir} (it would overwrite this one's experiment.json); waiting until it ends")
            announced = True
        try:
            with _flocked(other, fcntl.LOCK_EX):  # granted when that process has exited
                pass
        except FileNotFoundError:
            pass
