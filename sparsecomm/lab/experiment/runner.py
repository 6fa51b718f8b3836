"""Run every (arm, seed) of an experiment as its own multi-rank job, skipping finished ones.

Each run is launched with ``torchrun --standalone`` (``python -m torch.distributed.run``)
as ``world_size`` local gloo ranks. With an emulated link (``config.link``, e.g. "1gbit")
the experiment first builds one network namespace per rank (:mod:`sparsecomm.links.netns`),
starts each rank in its own, and tears the network down when the experiment ends, however
it ends. A run that fails (an exception, a collective timeout) is recorded with status
"failed" and the first failing rank's own error: it is counted in every report, never
dropped. Re-running the same experiment skips runs whose ``summary.json`` exists with
status "ok" and the run's config hash.

Killing a run: each launch command runs under a subreaper
(:mod:`sparsecomm.lab.experiment.launch_supervisor`) that kills every process the launch
started when the command ends or the run is killed, whatever session or environment the
process gave itself; every process of a launch is also marked and killed by its mark
(:mod:`sparsecomm.lab.experiment.process_tree`).

Results. A rank writes ``result.json``; the runner promotes it to ``summary.json`` only
when every process of the launch exited with 0 and the result carries this launch's id.
A killed run (interrupted, stalled, failed) is recorded by the runner, atomically, after
its processes are gone, and nothing of that launch can overwrite it afterwards.

Interruptions. SIGINT (Ctrl-C) and SIGTERM during :func:`run_experiment` kill the current
run's processes, record it with status "interrupted" and raise :class:`ExperimentInterrupted`
with a report of what was stopped and what was kept. A run with checkpoints resumes from
its latest one when re-run; its ``steps.jsonl`` is kept up to that step.

Concurrency: a run directory is locked while a process trains it, and an experiment
directory while a process runs it with one config (:mod:`sparsecomm.lab.experiment.run_locks`).

One run is :func:`run_one` (a job of :mod:`sparsecomm.lab.cluster` trains its run through it
too); its processes are :mod:`~sparsecomm.lab.experiment.launch`'s, its records
:mod:`~sparsecomm.lab.experiment.run_records`'.
"""
import json
import os
import platform
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from sparsecomm.lab.experiment import launch_supervisor, run_sources
from sparsecomm.lab.experiment.config import ExperimentConfig
from sparsecomm.lab.experiment.files import (
    open_no_follow,
    private_directory,
    refuse_links_in,
    write_bytes_atomically,
    write_json_atomically,
)
from sparsecomm.lab.experiment.interrupt_signals import Interrupt, InterruptSignals, signal_name
from sparsecomm.lab.experiment.launch import Nodes, find_mpiexec, kill_leftovers, launch_commands, launch_marks
from sparsecomm.lab.experiment.process_tree import KILL_TIMEOUT_S, LAUNCH_ENV, death_signal_preexec, kill_marked
from sparsecomm.lab.experiment.progress import RunProgress
from sparsecomm.lab.experiment.run_locks import RunLock, hold_experiment
from sparsecomm.lab.experiment.run_records import (
    RUN_FILES,
    finished_ok,
    keep_summary_aside,
    prepare_run_directory,
    read_summary,
    record,
    resume_point,
    run_directory,
    set_aside,
    stamp,
)
from sparsecomm.lab.experiment.worker import result_line
from sparsecomm.lab.results.layout import (
    EXPERIMENT_FILE,
    HISTORY_DIR,
    JOBS_DIR,
    LAUNCH_LOG,
    LOCKS_DIR,
    RUN_CONFIG,
    STEPS_FILE,
    SUMMARY_FILE,
)
from sparsecomm.links import parse_link
from sparsecomm.links.netns import EmulatedNetwork, maybe_emulated

__all__ = ["ExperimentInterrupted", "RunState", "check_run_directories", "environment", "interrupt_report",
           "report_lines", "run_experiment", "run_one", "write_snapshot",
           # defined in run_records, launch and results.layout since; still importable from here
           "JOBS_DIR", "RUN_CONFIG", "RUN_FILES", "STEPS_FILE", "find_mpiexec", "finished_ok", "launch_marks",
           "prepare_run_directory", "resume_point", "run_directory"]


class ExperimentInterrupted(Exception):
    """The experiment was stopped (Ctrl-C, SIGTERM) after its processes were killed.

    ``report`` says, in a few lines, what was stopped and what was kept (finished runs,
    checkpoints a re-run resumes from); the command line prints it instead of a traceback.
    """

    def __init__(self, report: str, signal_name: str = "SIGINT"):
        super().__init__(report)
        self.report = report
        self.signal_name = signal_name


def _git_commit() -> str:
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment() -> dict:
    import torch

    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "system": platform.system(),
        "cpu_count": os.cpu_count(),
        "git_commit": _git_commit(),
        "started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def write_snapshot(config: ExperimentConfig, root: Path) -> Path:
    """Write ``experiment.json``; an earlier snapshot with another config is kept in history/."""
    experiment_dir = private_directory(root / config.name, root)
    path = experiment_dir / EXPERIMENT_FILE
    if path.exists():
        previous = json.loads(path.read_text())
        if previous.get("config") != config.to_dict():
            history = private_directory(experiment_dir / HISTORY_DIR, root)
            write_bytes_atomically(history / f"experiment-{stamp()}.json", path.read_bytes())
    runs = {f"{arm}/{seed}": run_directory(config, root, arm, seed).name for arm in config.arms for seed in config.seeds}
    write_json_atomically(path, {"config": config.to_dict(), "environment": environment(), "runs": runs})
    return experiment_dir


def check_run_directories(config: ExperimentConfig, root: Path) -> None:
    """Before anything runs: each directory of the experiment that exists under ``root`` is a
    plain directory of this user (RunDirectoryError naming what is not;
    :mod:`sparsecomm.lab.experiment.files`), with no link in it but in the experiment directory
    and the jobs'."""
    experiment_dir = Path(root) / config.name
    runs = [run_directory(config, root, arm, seed) for arm in config.arms for seed in config.seeds]
    for directory in (experiment_dir, experiment_dir / JOBS_DIR, experiment_dir / LOCKS_DIR,
                      experiment_dir / HISTORY_DIR, *runs):
        private_directory(directory, root, create=False)
        if directory.is_dir() and directory not in (experiment_dir, experiment_dir / JOBS_DIR):
            refuse_links_in(directory)


def _stalled_for(steps_path: Path, launched: float) -> float:
    """Seconds since the run last wrote a step (or since launch)."""
    last = steps_path.stat().st_mtime if steps_path.exists() else launched
    return time.time() - max(last, launched)


def _launch(config: ExperimentConfig, arm: str, seed: int, out_dir: Path, network: EmulatedNetwork | None = None,
            signals: InterruptSignals | None = None, nodes: Nodes | None = None) -> dict:
    """Run one arm x seed; returns its summary (a "failed" one on error or stall).

    A run that writes no step for ``stall_timeout_s`` is killed (every process of the
    launch) and recorded as failed: gloo's own timeout does not cover every hang (a Future
    that never completes inside DDP waits forever). When one of several rank processes
    fails, the others are killed at once rather than left to time out. Whatever ends this
    call (SIGINT/SIGTERM included: recorded as "interrupted", then Interrupt is raised)
    kills the run's processes first and records the run.
    """
    signals = signals if signals is not None else InterruptSignals()
    # On several nodes every node's processes carry the run's rendezvous id as theirs.
    launch_id = nodes.run_id if nodes is not None else f"{os.getpid()}-{secrets.token_hex(8)}"
    write_json_atomically(out_dir / RUN_CONFIG, {
        "config": config.to_dict(), "arm": arm, "seed": seed, "config_hash": config.run_hash(arm, seed),
        # What the ranks need to read the config as this command does, whatever their directory,
        # and to check that your code is still what the hash covers.
        "directory": str(Path.cwd()), "code": config.code.to_record() if config.code is not None else None,
        "launch_id": launch_id})  # the other nodes of a run start once they see their launch here
    marks = launch_marks(launch_id, out_dir)
    steps_path = out_dir / STEPS_FILE
    launched = time.time()
    processes: list[subprocess.Popen] = []
    error, exit_code, stop = None, None, None
    log = os.fdopen(open_no_follow(out_dir / LAUNCH_LOG, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w")
    progress = RunProgress(f"{arm} seed {seed}", steps_path, config.steps_of(arm))  # quiet unless a terminal
    try:
        try:
            for argv, env in launch_commands(config, network, arm, seed, out_dir, nodes):
                env = {**(os.environ if env is None else env), **marks}
                processes.append(subprocess.Popen(launch_supervisor.command(argv), env=env, stdout=log,
                                                  stderr=subprocess.STDOUT, start_new_session=True,
                                                  preexec_fn=death_signal_preexec()))
            while True:
                # Done when one rank failed (the others are killed below) or all succeeded.
                codes = [proc.poll() for proc in processes]
                exit_code = next((code for code in codes if code not in (None, 0)), None if None in codes else 0)
                if exit_code is not None:
                    break
                progress.poll()
                if _stalled_for(steps_path, launched) > config.stall_timeout_s:
                    error = f"stalled: no step completed for {config.stall_timeout_s:g} s (hang); killed"
                    break
                time.sleep(0.2)
        except (Interrupt, KeyboardInterrupt) as caught:
            stop = signal_name(caught)
        except Exception as caught:  # noqa: BLE001 - e.g. the launcher cannot be started: recorded
            error = f"launch failed: {type(caught).__name__}: {caught}"
    finally:
        progress.close()
        summary = None
        while summary is None:  # a signal before deferred() took effect: kill and record again
            try:
                with signals.deferred():
                    launch_supervisor.stop(processes, KILL_TIMEOUT_S)  # each kills every process of its launch
                    survivors = kill_marked(LAUNCH_ENV, launch_id, processes)  # and whatever is left, by mark
                    log.close()
                    summary = record(config, arm, seed, out_dir, launch_id, exit_code=exit_code, error=error,
                                     stop=stop, survivors=survivors)
            except Interrupt as caught:
                stop = caught.signal_name
    if stop is not None:
        raise Interrupt(stop)
    signals.check()  # a signal that came while the run was being recorded
    return summary


# ----- the experiment -----------------------------------------------------------------------


@dataclass
class RunState:
    """What an interruption report needs to know: the run being prepared or trained, if any."""

    current: tuple[str, int, Path] | None = None


def run_experiment(config: ExperimentConfig, root: Path, *, progress=print) -> Path:
    """Run what is missing; returns the experiment directory ``root/<name>``.

    SIGINT or SIGTERM: the current run's processes are killed, the run is recorded as
    "interrupted", and :class:`ExperimentInterrupted` is raised with a report.
    """
    jobs = [(arm, seed) for seed in config.seeds for arm in config.arms]
    signals, state = InterruptSignals(), RunState()
    signals.install()
    try:
        check_run_directories(config, root)
        if config.code is not None:  # your code as it is now: every run's hash covers it
            for line in run_sources.describe(config.code):
                progress(line)
        hold_experiment(config, root, progress)
        experiment_dir = write_snapshot(config, root)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        with maybe_emulated(parse_link(config.link), config.world_size) as network:
            signals.install()  # the network put its own SIGTERM handler (SystemExit) in place: ours again
            _run_all(config, root, jobs, network, progress, signals, state)
    except (Interrupt, KeyboardInterrupt) as stop:
        name = signal_name(stop)
        raise ExperimentInterrupted(interrupt_report(config, root, jobs, state, name), name) from None
    finally:
        signals.restore()
    return experiment_dir


def _run_all(config: ExperimentConfig, root: Path, jobs, network, progress, signals: InterruptSignals,
             state: RunState) -> None:
    """Every run once; a run another process is training is skipped, then waited for at the end."""
    busy = []
    for number, (arm, seed) in enumerate(jobs, start=1):
        if not run_one(config, root, number, len(jobs), arm, seed, network=network, progress=progress,
                       signals=signals, state=state, wait=False):
            busy.append((number, arm, seed))
    for number, arm, seed in busy:
        run_one(config, root, number, len(jobs), arm, seed, network=network, progress=progress, signals=signals,
                state=state, wait=True)


def run_one(config: ExperimentConfig, root: Path, number: int, total: int, arm: str, seed: int, *,
            network: EmulatedNetwork | None = None, progress=print, signals: InterruptSignals | None = None,
            state: RunState | None = None, wait: bool, nodes: Nodes | None = None) -> bool:
    """Train one run (``number`` of ``total``, for the progress lines) unless it is finished;
    False when another process holds it and not ``wait`` (with ``wait``, wait for it).

    Under the run directory's lock: leftovers of an earlier launch killed, an earlier
    attempt's record kept aside (another configuration's files set aside), resumption from
    the latest checkpoint, the launch (on an emulated ``network``, or as this node's part of
    a run on several ``nodes``), and the run's summary. Used by the runner and by a job of
    :mod:`sparsecomm.lab.cluster`, so both train a run the same way; ``state`` tells an
    interruption report which run was training. SIGINT/SIGTERM (``signals``): the run is
    killed and recorded "interrupted", then Interrupt is raised."""
    signals = signals if signals is not None else InterruptSignals()
    state = state if state is not None else RunState()
    out_dir = run_directory(config, root, arm, seed)
    expected = config.run_hash(arm, seed)
    label = f"[{number}/{total}] {arm} seed {seed}"
    if not wait and finished_ok(out_dir, expected):
        progress(f"{label}: finished earlier, skipped ({out_dir.name})")
        return True
    state.current = (arm, seed, out_dir)
    private_directory(out_dir, root)
    lock = RunLock(out_dir)
    waited = False
    if not lock.acquire():
        if not wait:
            progress(f"{label}: another process (pid {lock.holder()}) is running it; skipped for now, "
                     "back to it at the end")
            state.current = None
            return False
        progress(f"{label}: waiting for another process (pid {lock.holder()}), which is running it")
        lock.acquire(blocking=True)
        waited = True
    try:
        leftovers = kill_leftovers(out_dir)
        if leftovers:
            progress(f"{label}: killed {leftovers} leftover process(es) of an earlier launch")
        summary = read_summary(out_dir)
        if summary is not None and summary.get("status") == "ok":
            if summary.get("config_hash") == expected:
                progress(f"{label}: finished {'by another process' if waited else 'earlier'}, skipped ({out_dir.name})")
                state.current = None
                return True
            aside = set_aside(out_dir, "foreign", RUN_FILES)
            progress(f"{label}: its {SUMMARY_FILE} records config hash {summary.get('config_hash')}, not this run's "
                     f"{expected} (another configuration): not finished; set aside in {aside.name}/, running it")
        elif summary is not None:
            # A failed or interrupted attempt is retried; its record is kept beside the new one.
            status = str(summary.get("status", "failed"))
            prefix = status if status in ("failed", "interrupted", "unreadable") else "failed"
            keep_summary_aside(out_dir, prefix)
        resume, notes = prepare_run_directory(out_dir, expected)
        for note in notes:
            progress(f"{label}: {note}")
        if resume is not None:
            progress(f"{label}: resuming from its checkpoint at step {resume}")
        started = time.perf_counter()
        summary = _launch(config, arm, seed, out_dir, network, signals, nodes)
        took = time.perf_counter() - started
        if summary["status"] == "ok":
            progress(f"{label}: {result_line(summary)}, {took:.0f} s")
        else:
            progress(f"{label}: FAILED after {took:.0f} s: {summary['error'][:300]}")
        sys.stdout.flush()
        state.current = None
        return True
    finally:
        lock.release()


def interrupt_report(config: ExperimentConfig, root: Path, jobs, state: RunState, signal_name: str) -> str:
    """What an interruption stopped and what it kept, read back from the run directories."""
    lines = [f"stopped by {signal_name}: experiment {config.name} in {Path(root) / config.name}"]
    finished, failed, not_done = [], [], []
    for arm, seed in jobs:
        out_dir = run_directory(config, root, arm, seed)
        label = f"{arm} seed {seed}"
        summary = read_summary(out_dir) or {}
        if state.current is not None and state.current[:2] == (arm, seed) and summary.get("status") == "interrupted":
            lines.append(f"interrupted: {label} after step {summary.get('last_step')}; its processes were killed and "
                         f"it is recorded as interrupted ({out_dir})")
            resume = summary.get("resume_from_step")
            lines.append(f"  it has a verified checkpoint at step {resume}: a re-run resumes it from there"
                         if resume else "  it has no checkpoint to resume from: a re-run starts it over")
        elif finished_ok(out_dir, config.run_hash(arm, seed)):
            finished.append(label)
        elif summary.get("status") not in (None, "ok"):
            failed.append(f"{label} ({summary.get('status')})")
        else:
            not_done.append(label)
    if len(lines) == 1:
        lines.append("no run was training: none was interrupted")
    return report_lines(lines, finished, [("failed earlier", failed), ("not run", not_done)])


def report_lines(lines: list[str], finished: list[str], groups: list[tuple[str, list[str]]]) -> str:
    """An interruption report: ``lines``, the finished runs kept, each non-empty group of
    other runs (heading, labels), and how to continue (shared by the runner and jobs)."""
    lines = [*lines, f"kept: {len(finished)} finished run(s)" + (f": {', '.join(finished)}" if finished else "")]
    lines += [f"{heading}: {', '.join(labels)}" for heading, labels in groups if labels]
    lines.append("re-run the same command to continue (finished runs are skipped)")
    return "\n".join(lines)
