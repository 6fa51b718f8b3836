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
"""
import json
import os
import platform
import secrets
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from sparsecomm.checkpoint.manager import MANIFEST, committed_steps, step_directory
from sparsecomm.lab.cluster.node_group import NodeGroup
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
from sparsecomm.lab.experiment.progress import RunProgress
from sparsecomm.lab.experiment.process_tree import (
    KILL_TIMEOUT_S,
    LAUNCH_ENV,
    RUN_DIR_ENV,
    death_signal_preexec,
    kill_marked,
    marked_processes,
)
from sparsecomm.lab.experiment.rank_errors import first_rank_error
from sparsecomm.lab.experiment.run_locks import RunLock, hold_experiment  # noqa: F401  (run_command uses runner.*)
from sparsecomm.lab.experiment.steps_log import STEPS_FILE, read_steps, rows_up_to
from sparsecomm.lab.experiment.worker import RESULT_FILE, result_line
from sparsecomm.lab.script_run import LAUNCH_TIME_ENV, RUN_CONFIG_ENV
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
    experiment_dir = private_directory(root / config.name, root)
    path = experiment_dir / "experiment.json"
    if path.exists():
        previous = json.loads(path.read_text())
        if previous.get("config") != config.to_dict():
            history = private_directory(experiment_dir / "history", root)
            stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%f")
            write_bytes_atomically(history / f"experiment-{stamp}.json", path.read_bytes())
    runs = {f"{arm}/{seed}": run_directory(config, root, arm, seed).name for arm in config.arms for seed in config.seeds}
    write_json_atomically(path, {"config": config.to_dict(), "environment": environment(), "runs": runs})
    return experiment_dir


JOBS_DIR = "jobs"
"""In the experiment directory: the files of its runs' jobs (:mod:`sparsecomm.lab.cluster`),
among them the pickles each job unpickles. Checked as the run directories are, but links in
it are not refused: submitit may leave links to its own files there."""


def check_run_directories(config: ExperimentConfig, root: Path) -> None:
    """Before anything runs: each directory of the experiment that exists under ``root`` is a
    plain directory of this user (RunDirectoryError naming what is not;
    :mod:`sparsecomm.lab.experiment.files`), with no link in it but in the experiment directory
    and the jobs'."""
    experiment_dir = Path(root) / config.name
    runs = [run_directory(config, root, arm, seed) for arm in config.arms for seed in config.seeds]
    for directory in (experiment_dir, experiment_dir / JOBS_DIR, experiment_dir / ".locks",
                      experiment_dir / "history", *runs):
        private_directory(directory, root, create=False)
        if directory.is_dir() and directory not in (experiment_dir, experiment_dir / JOBS_DIR):
            refuse_links_in(directory)


RUN_CONFIG = "run-config.json"
"""In the run directory: the config the run's ranks read (never the shared experiment.json,
which another command may rewrite while this one trains)."""


def _worker_arguments(config: ExperimentConfig, arm: str, seed: int, out_dir: Path) -> list[str]:
    """What each rank runs: the user's script, through script_rank (which records how it ended;
    the script finds RUN_CONFIG through ``sparsecomm.lab.init()``), or the built-in worker,
    which reads RUN_CONFIG itself."""
    if config.script is not None:
        return ["-m", "sparsecomm.lab.experiment.script_rank", str(Path(config.script).resolve()), *config.script_args]
    return [
        "-m", "sparsecomm.lab.experiment.worker",
        "--experiment-json", str(out_dir / RUN_CONFIG),
        "--arm", arm, "--seed", str(seed), "--out", str(out_dir),
        "--launch-time", repr(time.time()),
    ]


def _torchrun_command(config: ExperimentConfig, experiment_dir: Path, arm: str, seed: int, out_dir: Path,
                      nodes: NodeGroup | None = None) -> list[str]:
    """torchrun on this machine alone, or this node's torchrun of a run on several nodes."""
    where = (["--standalone", "--nnodes=1", f"--nproc-per-node={config.world_size}"] if nodes is None
             else nodes.torchrun_arguments())
    return [
        sys.executable, "-m", "torch.distributed.run",
        *where, f"--max-restarts={config.max_restarts}",
        *_worker_arguments(config, arm, seed, out_dir),
    ]


def find_mpiexec() -> str | None:
    """The mpiexec beside the running Python (the ``mpich`` wheel puts it in the virtual
    environment, matching mpi4py), else the one on PATH."""
    beside_python = Path(sys.executable).with_name("mpiexec")
    return str(beside_python) if os.access(beside_python, os.X_OK) else shutil.which("mpiexec")


def _mpiexec_command(config: ExperimentConfig, arm: str, seed: int, out_dir: Path) -> list[str]:
    mpiexec = find_mpiexec()
    if mpiexec is None:
        raise RuntimeError("launcher mpiexec: no mpiexec beside the Python interpreter or on PATH "
                           "(pip install 'sparsecomm[mpi]')")
    return [mpiexec, "-n", str(config.world_size), sys.executable, *_worker_arguments(config, arm, seed, out_dir)]


def _mpiexec_environment() -> dict:
    """This environment without another launcher's variables (the ranks would believe them);
    Open MPI is told that root and more ranks than cores are fine (MPICH ignores these)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                            "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1")
    return env


def _launch_commands(config: ExperimentConfig, network: EmulatedNetwork | None, experiment_dir: Path, arm: str,
                     seed: int, out_dir: Path, nodes: NodeGroup | None = None) -> list[tuple[list[str], dict | None]]:
    """(argv, environment) of the processes that make up one run (on this node).

    On loopback: one torchrun (or mpiexec), which starts the ranks; on several nodes, the first
    node's torchrun (the others start theirs, :mod:`sparsecomm.lab.cluster.run_job`). On an emulated link: one process
    per rank, each inside its own namespace (torchrun's agent cannot span namespaces);
    rank 0 hosts the rendezvous store at its address, and gloo is told to use the link's
    interface (it would otherwise resolve the host name to an address that does not exist
    inside the namespace).
    """
    if network is None and config.launcher == "mpiexec":
        return [(_mpiexec_command(config, arm, seed, out_dir), _mpiexec_environment())]
    if network is None:
        return [(_torchrun_command(config, experiment_dir, arm, seed, out_dir, nodes), None)]
    commands = []
    for rank in range(config.world_size):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(config.world_size), "LOCAL_RANK": "0",
               "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": network.address(0), "MASTER_PORT": str(STORE_PORT),
               "GLOO_SOCKET_IFNAME": INTERFACE}
        argv = network.command(rank, [sys.executable, *_worker_arguments(config, arm, seed, out_dir)])
        commands.append((argv, env))
    return commands


def launch_marks(launch_id: str, out_dir: Path) -> dict:
    """The environment every process of a launch carries: its marks (for killing it whatever
    it became) and, for a script's ``sparsecomm.lab.init()``, which run it is and when setup began."""
    return {LAUNCH_ENV: launch_id, RUN_DIR_ENV: str(out_dir.resolve()),
            RUN_CONFIG_ENV: str((out_dir / RUN_CONFIG).resolve()), LAUNCH_TIME_ENV: repr(time.time())}


def _stalled_for(steps_path: Path, launched: float) -> float:
    """Seconds since the run last wrote a step (or since launch)."""
    last = steps_path.stat().st_mtime if steps_path.exists() else launched
    return time.time() - max(last, launched)


# ----- the run directory --------------------------------------------------------------------


def _stamp() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%f")


def _read_summary(out_dir: Path) -> dict | None:
    """summary.json as a dict; None when there is none, {"status": "unreadable"} when broken."""
    path = out_dir / "summary.json"
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
    summary = _read_summary(out_dir)
    return summary is not None and summary.get("status") == "ok" and summary.get("config_hash") == expected


def _set_aside(out_dir: Path, reason: str, names) -> Path:
    """Move ``names`` (those that exist) of the run directory into ``<reason>-<stamp>/``."""
    aside = out_dir / f"{reason}-{_stamp()}"
    aside.mkdir()
    for name in names:
        if (out_dir / name).exists():
            os.replace(out_dir / name, aside / name)
    return aside


RUN_FILES = ("summary.json", STEPS_FILE, "checkpoints", "fault.json", "launch.log")


def resume_point(out_dir: Path, config_hash: str) -> tuple[int | None, str | None]:
    """(step, None): a re-run resumes from the checkpoint at ``step`` (the latest committed
    one, of this config, with every step up to it in steps.jsonl); (None, None): nothing
    to resume; (None, problem): checkpoints that cannot be resumed from, and why."""
    root = out_dir / "checkpoints"
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
    for stale in [out_dir / RESULT_FILE, *out_dir.glob("error-rank*.json")]:
        stale.unlink(missing_ok=True)
    notes = []
    step, problem = resume_point(out_dir, config_hash)
    if step is None and (out_dir / "checkpoints").exists():
        aside = _set_aside(out_dir, "discarded", ["checkpoints", STEPS_FILE, "fault.json"])
        notes.append(f"{problem or 'its checkpoints directory holds no committed checkpoint'}: set aside in "
                     f"{aside.name}/, starting over")
    if step is None:
        (out_dir / STEPS_FILE).unlink(missing_ok=True)
    return step, notes


def _mend_steps(out_dir: Path) -> None:
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


def _tail(path: Path, num_lines: int = 6) -> str:
    """The last lines of a log that explain a failure (error lines first)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return " | ".join((errors or lines)[-num_lines:])[:2000]


def _record(config: ExperimentConfig, arm: str, seed: int, out_dir: Path, launch_id: str, *, exit_code,
            error: str | None, stop: str | None, survivors: list[int]) -> dict:
    """The run's summary once its processes are gone: the ranks' result, promoted, when every
    process of the launch had exited with 0 by itself (before any kill; a signal that came
    after that does not undo a finished run); otherwise a "failed" or "interrupted" record.
    Written atomically."""
    expected = config.run_hash(arm, seed)
    summary_path, result_path = out_dir / "summary.json", out_dir / RESULT_FILE
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
    _mend_steps(out_dir)
    tail = _tail(out_dir / "launch.log")
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


def _launch(config: ExperimentConfig, experiment_dir: Path, arm: str, seed: int, out_dir: Path,
            network: EmulatedNetwork | None = None, signals: InterruptSignals | None = None,
            nodes: NodeGroup | None = None) -> dict:
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
    log = os.fdopen(open_no_follow(out_dir / "launch.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w")
    progress = RunProgress(f"{arm} seed {seed}", steps_path, config.steps)  # quiet unless a terminal
    try:
        try:
            for argv, env in _launch_commands(config, network, experiment_dir, arm, seed, out_dir, nodes):
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
                    summary = _record(config, arm, seed, out_dir, launch_id, exit_code=exit_code, error=error,
                                      stop=stop, survivors=survivors)
            except Interrupt as caught:
                stop = caught.signal_name
    if stop is not None:
        raise Interrupt(stop)
    signals.check()  # a signal that came while the run was being recorded
    return summary


def _kill_leftovers(out_dir: Path) -> int:
    """Processes of an earlier launch of this run directory still alive (their runner was
    SIGKILLed and the death signal missed them): killed. We hold the run's lock, so no
    live runner owns them. Returns how many there were."""
    marked = marked_processes(RUN_DIR_ENV, str(out_dir.resolve()))
    if marked:
        kill_marked(RUN_DIR_ENV, str(out_dir.resolve()))
    return len(marked)


# ----- the experiment -----------------------------------------------------------------------


class _State:
    current: tuple[str, int, Path] | None = None  # the run being prepared or trained


def run_experiment(config: ExperimentConfig, root: Path, *, progress=print) -> Path:
    """Run what is missing; returns the experiment directory ``root/<name>``.

    SIGINT or SIGTERM: the current run's processes are killed, the run is recorded as
    "interrupted", and :class:`ExperimentInterrupted` is raised with a report.
    """
    jobs = [(arm, seed) for seed in config.seeds for arm in config.arms]
    signals, state = InterruptSignals(), _State()
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
            _run_jobs(config, root, experiment_dir, jobs, network, progress, signals, state)
    except (Interrupt, KeyboardInterrupt) as stop:
        name = signal_name(stop)
        raise ExperimentInterrupted(interrupt_report(config, root, jobs, state, name), name) from None
    finally:
        signals.restore()
    return experiment_dir


def _run_jobs(config, root, experiment_dir, jobs, network, progress, signals=None, state=None) -> None:
    """Every job once; a job another process is running is skipped, then waited for at the end."""
    signals = signals if signals is not None else InterruptSignals()
    state = state if state is not None else _State()
    busy = []
    for number, (arm, seed) in enumerate(jobs, start=1):
        if not _run_job(config, root, experiment_dir, number, len(jobs), arm, seed, network, progress, signals,
                        state, wait=False):
            busy.append((number, arm, seed))
    for number, arm, seed in busy:
        _run_job(config, root, experiment_dir, number, len(jobs), arm, seed, network, progress, signals, state,
                 wait=True)


def _run_job(config, root, experiment_dir, number, total, arm, seed, network, progress, signals, state, *,
             wait: bool, nodes: NodeGroup | None = None) -> bool:
    """Run one job unless it is finished; False when another process holds it (and not ``wait``)."""
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
        leftovers = _kill_leftovers(out_dir)
        if leftovers:
            progress(f"{label}: killed {leftovers} leftover process(es) of an earlier launch")
        summary = _read_summary(out_dir)
        if summary is not None and summary.get("status") == "ok":
            if summary.get("config_hash") == expected:
                progress(f"{label}: finished {'by another process' if waited else 'earlier'}, skipped ({out_dir.name})")
                state.current = None
                return True
            aside = _set_aside(out_dir, "foreign", RUN_FILES)
            progress(f"{label}: its summary.json records config hash {summary.get('config_hash')}, not this run's "
                     f"{expected} (another configuration): not finished; set aside in {aside.name}/, running it")
        elif summary is not None:
            # A failed or interrupted attempt is retried; its record is kept beside the new one.
            status = str(summary.get("status", "failed"))
            prefix = status if status in ("failed", "interrupted", "unreadable") else "failed"
            os.replace(out_dir / "summary.json", out_dir / f"{prefix}-{_stamp()}.json")
        resume, notes = prepare_run_directory(out_dir, expected)
        for note in notes:
            progress(f"{label}: {note}")
        if resume is not None:
            progress(f"{label}: resuming from its checkpoint at step {resume}")
        started = time.perf_counter()
        summary = _launch(config, experiment_dir, arm, seed, out_dir, network, signals, nodes)
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


def interrupt_report(config: ExperimentConfig, root: Path, jobs, state: _State, signal_name: str) -> str:
    """What an interruption stopped and what it kept, read back from the run directories."""
    lines = [f"stopped by {signal_name}: experiment {config.name} in {Path(root) / config.name}"]
    finished, failed, not_done = [], [], []
    for arm, seed in jobs:
        out_dir = run_directory(config, root, arm, seed)
        label = f"{arm} seed {seed}"
        summary = _read_summary(out_dir) or {}
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
