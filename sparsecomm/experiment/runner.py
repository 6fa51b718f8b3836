"""Run every (arm, seed) of an experiment as its own multi-rank job, skipping finished ones.

Each run is launched with ``torchrun --standalone`` (``python -m torch.distributed.run``)
as ``world_size`` local gloo ranks, in its own process group so a hung run can be killed
whole. With an emulated link (``config.link``, e.g. "1gbit") the experiment first builds
one network namespace per rank (:mod:`sparsecomm.links.netns`), starts each rank in its
own, and tears the network down when the experiment ends, however it ends. A run that fails (an exception, a
collective timeout) is recorded with status "failed" and its error: it is counted in
every report, never dropped. Re-running the same experiment skips runs whose
``summary.json`` exists with status "ok" for the same (arm, seed, config hash).
"""
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from sparsecomm.experiment.config import ExperimentConfig
from sparsecomm.experiment.worker import result_line, write_json_atomically
from sparsecomm.links import parse_link
from sparsecomm.links.netns import INTERFACE, STORE_PORT, EmulatedNetwork, maybe_emulated


class ExperimentInterrupted(Exception):
    """The experiment was stopped (Ctrl-C, SIGTERM) after its processes were killed.

    ``report`` says, in a few lines, what was stopped and what was kept (finished runs,
    checkpoints a re-run resumes from); the command line prints it instead of a traceback.
    """

    def __init__(self, report: str, signal_name: str = "SIGINT"):
        super().__init__(report)
        self.report = report
        self.signal_name = signal_name


def run_directory(config: ExperimentConfig, root: Path, arm: str, seed: int) -> Path:
    return root / config.name / "runs" / f"{arm}-seed{seed}-{config.run_hash(arm, seed)}"


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
    experiment_dir = root / config.name
    experiment_dir.mkdir(parents=True, exist_ok=True)
    path = experiment_dir / "experiment.json"
    if path.exists():
        previous = json.loads(path.read_text())
        if previous.get("config") != config.to_dict():
            history = experiment_dir / "history"
            history.mkdir(exist_ok=True)
            stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%f")
            shutil.copy2(path, history / f"experiment-{stamp}.json")
    runs = {f"{arm}/{seed}": run_directory(config, root, arm, seed).name for arm in config.arms for seed in config.seeds}
    write_json_atomically(path, {"config": config.to_dict(), "environment": environment(), "runs": runs})
    return experiment_dir


def _worker_arguments(experiment_dir: Path, arm: str, seed: int, out_dir: Path) -> list[str]:
    return [
        "-m", "sparsecomm.experiment.worker",
        "--experiment-json", str(experiment_dir / "experiment.json"),
        "--arm", arm, "--seed", str(seed), "--out", str(out_dir),
        "--launch-time", repr(time.time()),
    ]


def _torchrun_command(config: ExperimentConfig, experiment_dir: Path, arm: str, seed: int, out_dir: Path) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", "--nnodes=1", f"--nproc-per-node={config.world_size}", f"--max-restarts={config.max_restarts}",
        *_worker_arguments(experiment_dir, arm, seed, out_dir),
    ]


def _launch_commands(config: ExperimentConfig, network: EmulatedNetwork | None, experiment_dir: Path, arm: str,
                     seed: int, out_dir: Path) -> list[tuple[list[str], dict | None]]:
    """(argv, environment) of the processes that make up one run.

    On loopback: one torchrun, which starts the ranks. On an emulated link: one process
    per rank, each inside its own namespace (torchrun's agent cannot span namespaces);
    rank 0 hosts the rendezvous store at its address, and gloo is told to use the link's
    interface (it would otherwise resolve the host name to an address that does not exist
    inside the namespace).
    """
    if network is None:
        return [(_torchrun_command(config, experiment_dir, arm, seed, out_dir), None)]
    commands = []
    for rank in range(config.world_size):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(config.world_size), "LOCAL_RANK": "0",
               "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": network.address(0), "MASTER_PORT": str(STORE_PORT),
               "GLOO_SOCKET_IFNAME": INTERFACE}
        argv = network.command(rank, [sys.executable, *_worker_arguments(experiment_dir, arm, seed, out_dir)])
        commands.append((argv, env))
    return commands


def _stalled_for(steps_path: Path, launched: float) -> float:
    """Seconds since the run last wrote a step (or since launch)."""
    last = steps_path.stat().st_mtime if steps_path.exists() else launched
    return time.time() - max(last, launched)


def _kill(processes: list[subprocess.Popen]) -> None:
    for proc in processes:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()


def _launch(config: ExperimentConfig, experiment_dir: Path, arm: str, seed: int, out_dir: Path,
            network: EmulatedNetwork | None = None) -> dict:
    """Run one arm x seed; returns its summary (a "failed" one on error or stall).

    A run that writes no step for ``stall_timeout_s`` is killed (every process group)
    and recorded as failed: gloo's own timeout does not cover every hang (a Future that
    never completes inside DDP waits forever). When one of several rank processes fails,
    the others are killed at once rather than left to time out. Whatever ends this call
    (Ctrl-C included) kills the run's processes first.
    """
    log_path = out_dir / "launch.log"
    steps_path = out_dir / "steps.jsonl"
    steps_path.unlink(missing_ok=True)
    launched = time.time()
    processes: list[subprocess.Popen] = []
    error, exit_code = None, None
    with open(log_path, "w") as log:
        try:
            for argv, env in _launch_commands(config, network, experiment_dir, arm, seed, out_dir):
                processes.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                  start_new_session=True))
            while True:
                # Done when one rank failed (the others are killed below) or all succeeded.
                codes = [proc.poll() for proc in processes]
                exit_code = next((code for code in codes if code not in (None, 0)), None if None in codes else 0)
                if exit_code is not None:
                    break
                if _stalled_for(steps_path, launched) > config.stall_timeout_s:
                    error = f"stalled: no step completed for {config.stall_timeout_s:g} s (hang); killed"
                    break
                time.sleep(0.2)
        finally:
            _kill(processes)
    summary_path = out_dir / "summary.json"
    if error is None and exit_code == 0 and summary_path.exists():
        return json.loads(summary_path.read_text())
    if error is None:
        error = f"exit code {exit_code}: " + _tail(log_path)
    summary = {"arm": arm, "seed": seed, "status": "failed", "config_hash": config.run_hash(arm, seed),
               "error": error, "evals": []}
    write_json_atomically(summary_path, summary)
    return summary


def _tail(path: Path, num_lines: int = 6) -> str:
    """The last lines of a log that explain a failure (error lines first)."""
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return " | ".join((errors or lines)[-num_lines:])[:2000]


def run_experiment(config: ExperimentConfig, root: Path, *, progress=print) -> Path:
    """Run what is missing; returns the experiment directory ``root/<name>``."""
    experiment_dir = write_snapshot(config, root)
    jobs = [(arm, seed) for seed in config.seeds for arm in config.arms]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with maybe_emulated(parse_link(config.link), config.world_size) as network:
        _run_jobs(config, root, experiment_dir, jobs, network, progress)
    return experiment_dir


def finished_ok(out_dir: Path) -> bool:
    """Whether the run directory holds a finished, successful run (it is then skipped)."""
    summary_path = out_dir / "summary.json"
    return summary_path.exists() and json.loads(summary_path.read_text()).get("status") == "ok"


def _run_jobs(config, root, experiment_dir, jobs, network, progress) -> None:
    for number, (arm, seed) in enumerate(jobs, start=1):
        out_dir = run_directory(config, root, arm, seed)
        label = f"[{number}/{len(jobs)}] {arm} seed {seed}"
        summary_path = out_dir / "summary.json"
        if finished_ok(out_dir):
            progress(f"{label}: finished earlier, skipped ({out_dir.name})")
            continue
        if summary_path.exists():
            # A failed attempt is retried; its record is kept beside the new one.
            summary_path.rename(out_dir / f"failed-{datetime.now(timezone.utc):%Y%m%dT%H%M%S%f}.json")
        out_dir.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        summary = _launch(config, experiment_dir, arm, seed, out_dir, network)
        took = time.perf_counter() - started
        if summary["status"] == "ok":
            progress(f"{label}: {result_line(summary)}, {took:.0f} s")
        else:
            progress(f"{label}: FAILED after {took:.0f} s: {summary['error'][:300]}")
        sys.stdout.flush()
