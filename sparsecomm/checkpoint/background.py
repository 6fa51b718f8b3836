"""Asynchronous saves: copy the state now, write and commit it in a background thread.

Training may change every weight, optimizer moment and residual the moment
:meth:`CheckpointManager.save_async` returns, so the cut is first staged: every tensor is
copied to CPU memory and every container rebuilt (the caller's dicts may change too).
Serialising, writing, fsyncing, reading back and the commit collectives then run in a
thread, on a process group of their own, so they never interleave with the training
loop's collectives on the main group.
"""
import copy
import threading
import time
from pathlib import Path

import torch

from sparsecomm.checkpoint.errors import CheckpointError


def staged_copy(obj):
    """A copy of ``obj`` sharing no tensor and no container with it (tensors end on CPU)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps the type and attributes (a state dict's _metadata)
        for key, value in obj.items():
            out[key] = staged_copy(value)
        return out
    if isinstance(obj, list):
        return [staged_copy(v) for v in obj]
    if isinstance(obj, tuple):
        values = [staged_copy(v) for v in obj]
        return tuple(values) if type(obj) is tuple else type(obj)(*values)  # a named tuple
    return copy.deepcopy(obj)


class PendingSave:
    """A checkpoint being written in the background; returned by ``save_async``.

    ``wait()`` returns the committed directory or raises the save's CheckpointError (the
    same on every rank: the outcome is agreed collectively). ``blocking_seconds`` is how
    long ``save_async`` held the training loop; ``seconds`` the whole save, once done.
    """

    def __init__(self, step: int, write, blocking_started: float):
        self.step = step
        self.blocking_seconds = 0.0
        self.seconds: float | None = None
        self._started = blocking_started
        self._path: Path | None = None
        self._error: BaseException | None = None
        self._raised = False  # the error reached the caller through wait()
        # Not a daemon: an interpreter that exits normally finishes the save first.
        self._thread = threading.Thread(target=self._run, args=(write,), name=f"checkpoint-step-{step}")

    def _start(self) -> None:
        self.blocking_seconds = time.perf_counter() - self._started
        self._thread.start()

    def _run(self, write) -> None:
        try:
            self._path = write()
        except CheckpointError as exc:  # handed to wait(), in the caller's thread
            self._error = exc
        except BaseException as exc:  # not expected; still a CheckpointError for the caller
            self._error = CheckpointError(f"asynchronous save of step {self.step} failed: "
                                          f"{type(exc).__name__}: {exc}")
            self._error.__cause__ = exc
        finally:
            self.seconds = time.perf_counter() - self._started

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> Path:
        self._thread.join()
        if self._error is not None:
            self._raised = True
            raise self._error
        return self._path

    def _settle(self) -> None:
        """Wait; raise the save's error unless :meth:`wait` already raised it to the caller."""
        self._thread.join()
        if self._error is not None and not self._raised:
            self.wait()
