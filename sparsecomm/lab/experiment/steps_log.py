"""Rank 0's per-step log, ``steps.jsonl``: written so that a crash leaves whole lines, read
so that a torn last line is dropped, and cut back to a checkpoint's step on resume.

Each row is one ``write(2)`` of a whole line, issued after its step completed (no buffer
holds half a line), so a killed writer leaves whole lines; a short write (a full disk) or
a crash of the machine can leave a torn last line, which readers drop. A resume replaces
the file atomically by the rows up to the checkpoint's step (temporary file, fsync,
rename), after checking that they are complete (:func:`rows_up_to`).
"""
import json
import os
import warnings
from pathlib import Path

from sparsecomm.lab.experiment.files import open_no_follow, write_bytes_atomically
from sparsecomm.lab.results import ResultFileWarning, load_steps
from sparsecomm.lab.results.layout import STEPS_FILE


def read_steps(out_dir: Path) -> list[dict]:
    """The rows of ``steps.jsonl`` (none if it is missing); a torn last line is dropped
    silently (the runner mends it), a malformed line elsewhere raises ResultFileError
    (a ValueError) naming it."""
    if not (Path(out_dir) / STEPS_FILE).exists():
        return []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResultFileWarning)
        return load_steps(out_dir)


def write_steps_atomically(out_dir: Path, rows: list[dict]) -> None:
    """Replace ``steps.jsonl`` with ``rows`` (temporary file, fsync, rename)."""
    write_bytes_atomically(out_dir / STEPS_FILE, "".join(json.dumps(r) + "\n" for r in rows).encode(), sync=True)


class StepLog:
    """Rank 0's ``steps.jsonl``: each row is one ``write(2)`` of the whole line, issued after
    its step completed (no buffer holds half a line), so a killed writer leaves whole lines;
    a short write (a full disk) or a crash of the machine can leave a torn last line, which
    readers drop (:func:`read_steps`)."""

    def __init__(self, out_dir: Path, append: bool):
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if append else os.O_TRUNC)
        self.fd = open_no_follow(out_dir / STEPS_FILE, flags)

    def write(self, row: dict) -> None:
        data = (json.dumps(row) + "\n").encode()
        while data:
            data = data[os.write(self.fd, data):]

    def sync(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def rows_up_to(rows: list[dict], step: int) -> list[dict] | None:
    """The rows of steps ``<= step``, if they are complete (one train row for each of the
    steps 1..step, in order); None when some are missing or repeated."""
    kept = [r for r in rows if isinstance(r.get("step"), int) and r["step"] <= step]
    train_steps = [r["step"] for r in kept if r["kind"] == "train"]
    return kept if train_steps == list(range(1, step + 1)) else None
