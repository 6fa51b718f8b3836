"""One run's directory and its records: where it is, its summary (read back, and written when
the run ends), what a re-run resumes from, and what it sets aside.

Shared by every way a run trains (:mod:`~sparsecomm.lab.experiment.runner` one by one,
:mod:`sparsecomm.lab.cluster` as jobs, ``sparsecomm run`` under another launcher), so that
each records and skips a run the same way. The names of the files are
:mod:`sparsecomm.lab.results.layout`'s.

A summary is written once the run's processes are gone, atomically: the ranks' result,
promoted, when every process exited with 0 and the result carries this launch's id;
otherwise a "failed" or "interrupted" record with the first failing rank's own error.
"""
import json
import os
from datetime import datetime, timezone
from pathlib import Path

from sparsecomm.checkpoint.manager import MANIFEST, committed_steps, step_directory
from sparsecomm.lab.experiment.config import ExperimentConfig
from sparsecomm.lab.experiment.files import write_bytes_atomically, write_json_atomically
from sparsecomm.lab.experiment.process_tree import KILL_TIMEOUT_S
from sparsecomm.lab.experiment.rank_errors import first_rank_error
from sparsecomm.lab.experiment.steps_log import read_steps, rows_up_to
from sparsecomm.lab.results.layout import (
    CHECKPOINTS_DIR,
    FAULT_FILE,
    LAUNCH_LOG,
    RANK_ERROR_GLOB,
    RESULT_FILE,
    RUNS_DIR,
    STEPS_FILE,
    SUMMARY_FILE,
    run_name,
)

RUN_FILES = (SUMMARY_FILE, STEPS_FILE, CHECKPOINTS_DIR, FAULT_FILE, LAUNCH_LOG)
"""What a run of another configuration leaves that this one must not read: set aside together."""


def run_directory(config: ExperimentConfig, root: Path, arm: str, seed: int) -> Path:
    return root / config.name / RUNS_DIR / run_name(arm, seed, config.run_hash(arm, seed))


def stamp() -> str:
    """Now, in UTC, as the suffix of what is kept aside (sorts by time)."""
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%f")


def read_summary(out_dir: Path) -> dict | None:
    """summary.json as a dict; None when there is none, {"status": "unreadable"} when broken."""
    path = out_dir / SUMMARY_FILE
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {"status": "unreadable"}
    return raw if isinstance(raw, dict) else {"status": "unreadable"}


def finished_ok(out_dir: Path, config_hash: str | None = None) -> bool:
    """Whether the run directory holds a finished, successful run of ``config_hash`` (it is
    then skipped); by default the hash its name ends with (``<arm>-seed<s>-<hash>``)."""
    out_dir = Path(out_dir)
    expected = config_hash if config_hash is not None else out_dir.name.rsplit("-", 1)[-1]
    summary = read_summary(out_dir)
    return summary is not None and summary.get("status") == "ok" and summary.get("config_hash") == expected


def keep_summary_aside(out_dir: Path, prefix: str) -> Path:
    """Rename summary.json to ``<prefix>-<stamp>.json`` (an earlier attempt's record, kept
    beside the new one)."""
    kept = out_dir / f"{prefix}-{stamp()}.json"
    os.replace(out_dir / SUMMARY_FILE, kept)
    return kept


def set_aside(out_dir: Path, reason: str, names) -> Path:
    """Move ``names`` (those that exist) of the run directory into ``<reason>-<stamp>/``."""
    aside = out_dir / f"{reason}-{stamp()}"
    aside.mkdir()
    for name in names:
        if (out_dir / name).exists():
            os.replace(out_dir / name, aside / name)
    return aside


def resume_point(out_dir: Path, config_hash: str) -> tuple[int | None, str | None]:
    """(step, None): a re-run resumes from the checkpoint at ``step`` (the latest committed
    one, of this config, with every step up to it in steps.jsonl); (None, None): nothing
    to resume; (None, problem): checkpoints that cannot be resumed from, and why."""
    root = out_dir / CHECKPOINTS_DIR
    steps = committed_steps(root)
    if not steps:
        return None, None
    latest = steps[-1]
    try:
        saved_for = json.loads((step_directory(root, latest) / MANIFEST).read_text()).get("config_hash")
    except (OSError, ValueError, AttributeError):
        return None, f"its checkpoint at step {latest} has an unreadable manifest"
    if saved_for != config_hash:
        return None, f"its checkpoints belong to another configuration (hash {saved_for}, not {config_hash})"
    try:
        rows = read_steps(out_dir)
    except ValueError as error:
        return None, f"its {STEPS_FILE} is damaged ({error})"
    if rows_up_to(rows, latest) is None:
        return None, f"its {STEPS_FILE} does not hold every step up to its checkpoint at step {latest}"
    return latest, None


def prepare_run_directory(out_dir: Path, config_hash: str) -> tuple[int | None, list[str]]:
    """Before a launch (lock held): remove what a launch leaves for the runner (result,
    rank errors), and decide where the run starts. With a checkpoint to resume from,
    steps.jsonl is kept (the ranks cut it back to the checkpoint's step); otherwise it is
    removed, and checkpoints that cannot be resumed from are set aside (moved, not
    deleted). Returns (the step it resumes from or None, notes for the progress line)."""
    for stale in [out_dir / RESULT_FILE, *out_dir.glob(RANK_ERROR_GLOB)]:
        stale.unlink(missing_ok=True)
    notes = []
    step, problem = resume_point(out_dir, config_hash)
    if step is None and (out_dir / CHECKPOINTS_DIR).exists():
        aside = set_aside(out_dir, "discarded", [CHECKPOINTS_DIR, STEPS_FILE, FAULT_FILE])
        notes.append(f"{problem or 'its checkpoints directory holds no committed checkpoint'}: set aside in "
                     f"{aside.name}/, starting over")
    if step is None:
        (out_dir / STEPS_FILE).unlink(missing_ok=True)
    return step, notes


def mend_steps(out_dir: Path) -> None:
    """After a kill: a torn last line of steps.jsonl is dropped (a whole unterminated one
    gets its newline), so every reader can parse the file."""
    path = out_dir / STEPS_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    if not data or data.endswith(b"\n"):
        return
    cut = data.rfind(b"\n") + 1
    try:
        json.loads(data[cut:])
        mended = data + b"\n"
    except ValueError:
        mended = data[:cut]
    write_bytes_atomically(path, mended)


def _last_step(out_dir: Path) -> int:
    try:
        rows = read_steps(out_dir)
    except ValueError:
        return 0
    return max((r["step"] for r in rows if r.get("kind") == "train" and isinstance(r.get("step"), int)), default=0)


def log_tail(text: str, num_lines: int) -> str:
    """The last lines of a log that explain a failure (error lines first), on one line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return " | ".join((errors or lines)[-num_lines:])[:2000]


def _launch_log_tail(out_dir: Path, num_lines: int = 6) -> str:
    try:
        return log_tail((out_dir / LAUNCH_LOG).read_text(errors="replace"), num_lines)
    except OSError:
        return ""


def record(config: ExperimentConfig, arm: str, seed: int, out_dir: Path, launch_id: str, *, exit_code,
           error: str | None, stop: str | None, survivors: list[int]) -> dict:
    """The run's summary once its processes are gone: the ranks' result, promoted, when every
    process of the launch had exited with 0 by itself (before any kill; a signal that came
    after that does not undo a finished run); otherwise a "failed" or "interrupted" record.
    Written atomically."""
    expected = config.run_hash(arm, seed)
    summary_path, result_path = out_dir / SUMMARY_FILE, out_dir / RESULT_FILE
    if error is None and exit_code == 0 and not survivors:
        try:
            result = json.loads(result_path.read_text())
        except (OSError, ValueError):
            result = None
        if (isinstance(result, dict) and result.get("status") == "ok" and result.get("launch_id") == launch_id
                and result.get("config_hash") == expected):
            os.replace(result_path, summary_path)
            return result
        if stop is None:
            error = f"every process exited with 0, but no result of this launch was written ({RESULT_FILE})"
    result_path.unlink(missing_ok=True)  # a result of a killed launch is never promoted
    mend_steps(out_dir)
    tail = _launch_log_tail(out_dir)
    rank_error = first_rank_error(out_dir, launch_id)
    last_step = _last_step(out_dir)
    if stop is not None:
        error = f"interrupted by {stop} after step {last_step}: its processes were killed"
    elif error is None and rank_error is not None:
        error = f"rank {rank_error.get('rank')}: {rank_error.get('type')}: {rank_error.get('message')}"[:4000]
    elif error is None:
        error = f"exit code {exit_code}: {tail}"
    if survivors:
        error += f" (processes {survivors} were still alive {KILL_TIMEOUT_S:g} s after SIGKILL)"
    summary = {"arm": arm, "seed": seed, "status": "interrupted" if stop is not None else "failed",
               "config_hash": expected, "error": error, "evals": [], "exit_code": exit_code,
               "launch_log_tail": f"exit code {exit_code}: {tail}", "last_step": last_step,
               "resume_from_step": resume_point(out_dir, expected)[0]}
    if stop is not None:
        summary["interrupted"] = stop
    if rank_error is not None:
        summary["rank_error"] = {k: rank_error.get(k) for k in ("rank", "type", "message", "frames", "restart")}
    write_json_atomically(summary_path, summary)
    return summary
