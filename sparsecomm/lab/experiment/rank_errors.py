"""A failing rank's own error, recorded in the run directory for the runner to report.

A rank that raises writes ``error-rank<r>.json`` (type, message, the last frames of its
traceback, when, which attempt and launch) before it exits, so the run's record names the
rank's exception rather than the launcher's wrapper text (torchrun's ChildFailedError).
"""
import json
import os
import time
import traceback
from pathlib import Path

import torch.distributed as dist

from sparsecomm.dist import discover
from sparsecomm.lab.experiment.files import write_json_atomically
from sparsecomm.lab.experiment.process_tree import LAUNCH_ENV
from sparsecomm.lab.results.layout import RANK_ERROR_GLOB, rank_error_file


def rank_error_path(out_dir: Path, rank: int) -> Path:
    return out_dir / rank_error_file(rank)


def _this_rank() -> int | None:
    if dist.is_initialized():
        return dist.get_rank()
    try:
        return discover().rank
    except ValueError:
        return None


def write_rank_error(out_dir: Path | None, error: BaseException, frames: int = 8, *,
                     message: str | None = None) -> Path | None:
    """``error-rank<r>.json`` in the run directory: this rank's exception (type, message, the
    last frames of its traceback), when it happened, and the launch it belongs to; ``message``
    replaces the exception's own (to say what the code did). Never raises (the original
    error is what matters)."""
    try:
        rank = _this_rank()
        if out_dir is None or rank is None:
            return None
        kind = type(error)
        name = (kind.__qualname__ if kind.__module__ in ("builtins", "__main__")
                else f"{kind.__module__}.{kind.__qualname__}")
        stack = traceback.extract_tb(error.__traceback__)[-frames:]
        path = rank_error_path(out_dir, rank)
        write_json_atomically(path, {
            "rank": rank,
            "type": name,
            "message": (str(error) if message is None else message)[:4000],
            "frames": [f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}" for f in stack],
            "traceback": "".join(traceback.format_exception(error))[-8000:],
            "wall_time": time.time(),
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "launch_id": os.environ.get(LAUNCH_ENV),
            "pid": os.getpid(),
        })
        return path
    except Exception:  # noqa: BLE001 - reporting must not replace the error being reported
        return None


def first_rank_error(out_dir: Path, launch_id: str | None = None) -> dict | None:
    """The first error a rank of this launch recorded (error-rank<r>.json): of its last
    torchrun attempt, the earliest. None when no rank recorded one."""
    errors = []
    for path in out_dir.glob(RANK_ERROR_GLOB):
        try:
            error = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(error, dict) and (launch_id is None or error.get("launch_id") == launch_id):
            errors.append(error)
    if not errors:
        return None
    last = max(e.get("restart", 0) for e in errors)
    return min((e for e in errors if e.get("restart", 0) == last), key=lambda e: e.get("wall_time", float("inf")))
