"""Progress of one run while it trains, read from the ``steps.jsonl`` its rank 0 writes.

    progress = RunProgress("topk-dgc seed 1", out_dir / "steps.jsonl", total_steps=300)
    while run_is_alive():
        progress.poll()  # cheap: reads only what was appended since the last call
        time.sleep(0.5)
    progress.close()

It shows ``  topk-dgc seed 1: step 120/300 (40%), 14.2 s, train loss 2.31, val loss 2.4, ~21 s
left``: the last train row's step, wall clock since the first data touch and loss, the last
evaluation's loss, and the time left at the pace so far.

Where it goes depends on the stream:

- a terminal: one line, rewritten in place (``\\r``), at most every ``TERMINAL_REFRESH_S``;
- anything else (a log file, a pipe, CI): nothing at all, unless the environment variable
  ``SPARSECOMM_PROGRESS=1`` asks for a plain line every ``every_s`` seconds instead.
  ``SPARSECOMM_PROGRESS=0`` silences the terminal line too.

The file is read incrementally, by whole lines: a torn last line (the writer is mid-write)
waits for its end, a file that does not exist yet shows nothing, and a file cut back or
replaced (a resume rewrites it up to its checkpoint's step) is read again from its start.
A line that is not a JSON object is skipped: the result readers report malformed files,
progress only has to keep going.
"""
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

PROGRESS_ENV = "SPARSECOMM_PROGRESS"
TERMINAL_REFRESH_S = 0.5


@dataclass
class _Latest:
    """What the rows read so far say about the run."""

    step: int | None = None
    elapsed_seconds: float | None = None
    train_loss: float | None = None
    val_loss: float | None = None

    def update(self, row: dict) -> None:
        if row.get("kind") == "train" and isinstance(row.get("step"), int):
            self.step = row["step"]
            self.elapsed_seconds = _number(row.get("elapsed_seconds"))
            self.train_loss = _number(row.get("train_loss"))
        elif row.get("kind") == "eval":
            self.val_loss = _number(row.get("val_loss"))


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


class StepsTail:
    """The complete lines appended to a file since the last :meth:`read`."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._identity: tuple[int, int] | None = None  # (device, inode) of the file read so far
        self._offset = 0  # end of the last complete line read

    def read(self) -> tuple[list[dict], bool]:
        """(the new rows, whether the file started over: cut back or replaced since the last
        read, so the rows are the whole file again). No file yet: no rows."""
        try:
            with open(self.path, "rb") as f:
                restarted = self._started_over(f)
                if restarted:
                    self._offset = 0
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return [], False
        complete = data[: data.rfind(b"\n") + 1]  # a torn last line is read again next time
        self._offset += len(complete)
        return [row for row in map(_parse, complete.splitlines()) if row is not None], restarted

    def _started_over(self, f) -> bool:
        status = os.fstat(f.fileno())
        identity = (status.st_dev, status.st_ino)
        replaced = self._identity is not None and identity != self._identity
        self._identity = identity
        if replaced or status.st_size < self._offset:
            return True
        if not self._offset:
            return False
        # Rewritten in place to at least the same length: the line read last no longer ends here.
        f.seek(self._offset - 1)
        return f.read(1) != b"\n"


def _parse(line: bytes) -> dict | None:
    try:
        row = json.loads(line)
    except ValueError:  # also UnicodeDecodeError
        return None
    return row if isinstance(row, dict) else None


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


def _shows(stream: TextIO, is_terminal: bool | None) -> str:
    """"terminal", "lines" or "quiet": how progress goes to ``stream``."""
    asked = os.environ.get(PROGRESS_ENV)
    if asked == "0":
        return "quiet"
    if is_terminal is None:
        is_terminal = bool(getattr(stream, "isatty", lambda: False)())
    if is_terminal:
        return "terminal"
    return "lines" if asked == "1" else "quiet"


class RunProgress:
    """Progress of one run on ``stream`` (default: sys.stderr), from its ``steps.jsonl``.

    ``is_terminal`` None asks ``stream.isatty()``; ``clock`` (seconds, monotonic) is for tests.
    """

    def __init__(self, label: str, steps_path: Path, total_steps: int, stream: TextIO | None = None,
                 every_s: float = 5.0, is_terminal: bool | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.label = label
        self.total_steps = total_steps
        self._stream = sys.stderr if stream is None else stream
        self._mode = _shows(self._stream, is_terminal)
        self._every_s = min(every_s, TERMINAL_REFRESH_S) if self._mode == "terminal" else every_s
        self._clock = clock
        self._tail = StepsTail(steps_path)
        self._latest = _Latest()
        # A terminal line appears with the first step; a plain line only after every_s, so a
        # short run leaves no trace in a log.
        self._last_shown_at = -math.inf if self._mode == "terminal" else clock()
        self._last_text = ""
        self._closed = False

    @property
    def shown(self) -> bool:
        return bool(self._last_text)

    def poll(self) -> None:
        """Read what the run appended; show it if it is time and something changed."""
        if self._mode == "quiet" or self._closed:
            return
        self._read()
        now = self._clock()
        if self._latest.step is None or now - self._last_shown_at < self._every_s:
            return
        text = self.describe()
        if text != self._last_text:
            self._show(text)
            self._last_shown_at = now

    def close(self) -> None:
        """The final state, only if something was shown; a terminal line is ended. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._mode == "quiet" or not self.shown:
            return
        self._read()
        text = self.describe()
        if self._mode == "terminal":
            self._show(text)
            self._stream.write("\n")
        elif text != self._last_text:
            self._show(text)
        self._stream.flush()

    def __enter__(self) -> "RunProgress":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def describe(self) -> str:
        """``  LABEL: step S/T (P%), ELAPSED, train loss L, val loss V, ~R left`` (what is known)."""
        latest = self._latest
        if latest.step is None:
            return f"  {self.label}: starting"
        parts = [f"step {latest.step}/{self.total_steps} ({latest.step / max(self.total_steps, 1):.0%})"]
        if latest.elapsed_seconds is not None:
            parts.append(_duration(latest.elapsed_seconds))
        if latest.train_loss is not None:
            parts.append(f"train loss {latest.train_loss:.3g}")
        if latest.val_loss is not None:
            parts.append(f"val loss {latest.val_loss:.3g}")
        left = self._seconds_left()
        if left is not None:
            parts.append(f"~{_duration(left)} left")
        return f"  {self.label}: {', '.join(parts)}"

    def _seconds_left(self) -> float | None:
        latest = self._latest
        if not (latest.elapsed_seconds and latest.step) or latest.step >= self.total_steps:
            return None
        return latest.elapsed_seconds / latest.step * (self.total_steps - latest.step)

    def _read(self) -> None:
        rows, restarted = self._tail.read()
        if restarted:
            self._latest = _Latest()
        for row in rows:
            self._latest.update(row)

    def _show(self, text: str) -> None:
        if self._mode == "terminal":
            # Blanks wipe what a longer previous line left on the screen.
            self._stream.write("\r" + text.ljust(len(self._last_text)))
        else:
            self._stream.write(text + "\n")
        self._stream.flush()
        self._last_text = text
