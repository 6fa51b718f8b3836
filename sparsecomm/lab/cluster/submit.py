"""An experiment's unfinished runs as jobs: submitted, waited for, cancelled on Ctrl-C.

What the one-by-one runner guarantees holds here too, because each job trains its run
through the same code (:mod:`sparsecomm.lab.cluster.run_job`): finished runs are skipped
(re-running the command submits only what is missing), a run is trained once even when two
commands submit it (the run directory's lock), a failed run records its rank's own error,
and a run resumes from its latest checkpoint. The command adds:

- ``parallel``: locally, at most N jobs at once, each pinned to its share of the cores
  (:func:`core_slots`); on SLURM, one job array of every run, at most N at once (``%N``).
- A job that ended without recording its run (killed, or it failed before training, e.g. a
  module missing on the node) gets a "failed" record in its run directory with the job's
  own log tail, once the run's lock is free.
- SIGINT/SIGTERM: every job this command submitted is cancelled (locally SIGTERM, which the
  job turns into a recorded "interrupted" run; on SLURM ``scancel --signal=INT``, then a
  plain ``scancel`` for what is left after ``CANCEL_GRACE_S``); the command waits for them
  to end, then raises ExperimentInterrupted with what was stopped and what was kept. A signal
  that comes while jobs are being submitted waits for the submission to return (sbatch's
  answer: the ids of the jobs it queued), so that they are cancelled too.
- A submission that fails (sbatch's error) raises :class:`sbatch.SubmissionError`; nothing
  of it is left in ``jobs/``.
"""
import os
import subprocess
import sys
import time
from pathlib import Path

from sparsecomm.lab.cluster import executors
from sparsecomm.lab.cluster.run_job import RunJob
from sparsecomm.lab.experiment import run_sources
from sparsecomm.lab.experiment.config import ExperimentConfig
from sparsecomm.lab.experiment.files import private_directory
from sparsecomm.lab.experiment.interrupt_signals import Interrupt, InterruptSignals, signal_name
from sparsecomm.lab.experiment.launch import kill_leftovers
from sparsecomm.lab.experiment.progress import RunProgress
from sparsecomm.lab.experiment.run_locks import RunLock, hold_experiment
from sparsecomm.lab.experiment.run_records import finished_ok, log_tail, read_summary, record, run_directory
from sparsecomm.lab.experiment.runner import ExperimentInterrupted, check_run_directories, report_lines, write_snapshot
from sparsecomm.lab.experiment.worker import result_line
from sparsecomm.lab.results.layout import JOBS_DIR, STEPS_FILE, SUMMARY_FILE

POLL_S = 1.0
CANCEL_GRACE_S = 60.0
"""After cancelling, how long the jobs get to record their runs before they are killed."""
STATUS_EVERY_S = 30.0
REFRESH_S = 15.0
"""How often the cluster is asked for the jobs' states, once for all of them (between,
submitit's result files and its own sacct schedule say when a job ended)."""


def core_slots(parallel: int, cores: list[int] | None = None) -> list[list[int]]:
    """Slot s of ``parallel`` gets every parallel-th core of this process's cores, from the
    s-th on (with fewer cores than slots, slots share cores round robin). A run's ranks keep
    the one-by-one runner's thread count (OMP_NUM_THREADS, default 1), so its results do not
    depend on the slot: only where its processes run does."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else list(cores)
    if len(cores) < parallel:
        return [[cores[s % len(cores)]] for s in range(parallel)]
    return [cores[s::parallel] for s in range(parallel)]


class _Submitted:
    """One run's job, while the command watches it."""

    def __init__(self, job, kind: str, number: int, arm: str, seed: int, out_dir: Path, slot: int | None, steps: int):
        self.job, self.kind, self.number, self.arm, self.seed = job, kind, number, arm, seed
        self.out_dir, self.slot = out_dir, slot
        self.submitted = time.time()
        self.progress = RunProgress(f"{arm} seed {seed}", out_dir / STEPS_FILE, steps, is_terminal=False)

    def done(self, force: bool = False) -> bool:
        return self.job.done(force_check=force)

    def recorded(self) -> bool:
        """Whether the run's summary was written since this job was submitted (by the job, or by
        the command for it), not left from an earlier attempt."""
        path = self.out_dir / SUMMARY_FILE
        return read_summary(self.out_dir) is not None and path.stat().st_mtime >= self.submitted - 1


def _left_the_queue(in_flight: list) -> set[str]:
    """SLURM jobs among ``in_flight`` that squeue no longer lists (one call for all). submitit
    asks sacct, which a cluster without accounting storage does not answer: a job that left the
    queue without a result has ended all the same. Empty when squeue cannot say."""
    ids = [str(item.job.job_id) for item in in_flight if item.kind == "slurm"]
    if not ids:
        return set()
    try:
        listed = subprocess.run(["squeue", "--noheader", "--array", "--jobs", ",".join(ids), "--format=%i"],
                                capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return set()
    return set() if listed.returncode != 0 else set(ids) - set(listed.stdout.split())


def run_on_cluster(config: ExperimentConfig, root: Path, *, progress=print) -> Path:
    """Run what is missing of ``config`` as jobs (``config.cluster``); returns the experiment
    directory, as :func:`runner.run_experiment` does."""
    settings = config.cluster_settings
    runs = [(arm, seed) for seed in config.seeds for arm in config.arms]
    signals = InterruptSignals()
    signals.install()
    in_flight: list[_Submitted] = []
    try:
        check_run_directories(config, root)
        if config.code is not None:
            for line in run_sources.describe(config.code):
                progress(line)
        hold_experiment(config, root, progress)
        experiment_dir = write_snapshot(config, root)
        record = {"config": config.to_dict(), "directory": str(Path.cwd()),
                  "code": config.code.to_record() if config.code is not None else None}
        todo = []
        for number, (arm, seed) in enumerate(runs, start=1):
            out_dir = run_directory(config, root, arm, seed)
            if finished_ok(out_dir, config.run_hash(arm, seed)):
                progress(f"[{number}/{len(runs)}] {arm} seed {seed}: finished earlier, skipped ({out_dir.name})")
            else:
                private_directory(out_dir, root)  # where its job's outcome is recorded, whatever happens to the job
                todo.append((number, arm, seed, out_dir))
        if todo:
            jobs_dir = private_directory(experiment_dir / JOBS_DIR, root)  # the pickles its jobs unpickle
            executor = executors.make_executor(settings, experiment_dir, config.name, config.world_size, len(todo))
            jobs = [RunJob(record, str(root), arm, seed, number, len(runs)) for number, arm, seed, _ in todo]
            where = (f"SLURM job array, at most {settings.parallel or len(todo)} at once" if settings.kind == "slurm"
                     else f"local jobs, {settings.parallel or 1} at a time")
            progress(f"submitting {len(todo)} run(s) as {where}; job files in {jobs_dir}")
            if settings.kind == "slurm":
                _run_array(executor, jobs, todo, config, in_flight, progress, signals)
            else:
                _run_local(executor, jobs, todo, config, settings.parallel or 1, in_flight, progress, signals)
    except (Interrupt, KeyboardInterrupt) as stop:
        name = signal_name(stop)
        with signals.deferred():
            cancelled = _cancel(in_flight, settings.kind, config, progress)
        raise ExperimentInterrupted(_interrupt_report(config, root, runs, name, cancelled), name) from None
    finally:
        signals.restore()
    return experiment_dir


def _run_local(executor, jobs, todo, config, parallel: int, in_flight: list, progress, signals) -> None:
    slots = core_slots(parallel)
    free = list(range(parallel))
    waiting = list(zip(jobs, todo))
    watch = _Watch()
    while waiting or in_flight:
        while waiting and free:
            job, (number, arm, seed, out_dir) = waiting.pop(0)
            slot = free.pop(0)
            job.cores = slots[slot]
            with signals.deferred():  # a job started is a job in in_flight, which a signal cancels
                in_flight.append(_Submitted(executor.submit(job), "local", number, arm, seed, out_dir, slot,
                                            config.steps))
            signals.check()
        _wait_for_one(in_flight, config, progress, free, watch)


def _run_array(executor, jobs, todo, config, in_flight: list, progress, signals) -> None:
    with signals.deferred():  # until sbatch answers: the jobs it queued are in in_flight, which a signal cancels
        with executor.batch():
            submitted = [executor.submit(job) for job in jobs]
        for job, (number, arm, seed, out_dir) in zip(submitted, todo):
            in_flight.append(_Submitted(job, "slurm", number, arm, seed, out_dir, None, config.steps))
    progress(f"submitted SLURM job {submitted[0].job_id.split('_')[0]} ({len(submitted)} elements)")
    signals.check()
    watch = _Watch()
    while in_flight:
        _wait_for_one(in_flight, config, progress, [], watch)


class _Watch:
    """When the cluster was last asked, and which jobs squeue then no longer listed."""

    def __init__(self):
        self.asked = time.monotonic()
        self.gone: set[str] = set()
        self.status = time.monotonic()

    def refresh(self, in_flight: list) -> bool:
        if time.monotonic() - self.asked < REFRESH_S:
            return False
        self.asked = time.monotonic()
        self.gone = _left_the_queue(in_flight)
        return True


def _wait_for_one(in_flight: list, config, progress, free: list, watch: _Watch) -> None:
    """Wait until a job ends; report it (and free its slot)."""
    while True:
        refresh = watch.refresh(in_flight)  # ask the cluster itself (sacct through submitit, squeue)
        for item in list(in_flight):
            if item.done(force=refresh) or str(item.job.job_id) in watch.gone:
                in_flight.remove(item)
                if item.slot is not None:
                    free.append(item.slot)
                _report_end(item, config, progress)
                return
            item.progress.poll()
        if sys.stdout.isatty() and time.monotonic() - watch.status > STATUS_EVERY_S:
            print("running:" + ";".join(i.progress.describe() for i in in_flight), flush=True)
            watch.status = time.monotonic()
        time.sleep(POLL_S)


def _report_end(item: _Submitted, config, progress) -> None:
    label = f"[{item.number}/{len(config.seeds) * len(config.arms)}] {item.arm} seed {item.seed}"
    took = time.time() - item.submitted
    summary = read_summary(item.out_dir) if item.recorded() else _record_lost_job(item, config)
    if summary is None:
        progress(f"{label}: its job {item.job.job_id} ended; another process holds the run, which records it")
    elif summary.get("status") == "ok":
        progress(f"{label}: {result_line(summary)}, {took:.0f} s (job {item.job.job_id})")
    else:
        progress(f"{label}: {str(summary.get('status')).upper()} after {took:.0f} s (job {item.job.job_id}): "
                 f"{str(summary.get('error'))[:300]}")


def _record_lost_job(item: _Submitted, config) -> dict | None:
    """The job ended without recording its run: record it failed, with the job's log tail
    (unless another process now holds the run and will record it)."""
    lock = RunLock(item.out_dir)
    if not lock.acquire():
        return None
    try:
        if finished_ok(item.out_dir, config.run_hash(item.arm, item.seed)):
            return read_summary(item.out_dir)  # a job of another command finished it
        log = _job_log_tail(item.job)
        return record(config, item.arm, item.seed, item.out_dir, "none", exit_code=None,
                      error=f"its job {item.job.job_id} ended without recording the run: {log}",
                      stop=None, survivors=[])
    finally:
        lock.release()


def _job_log_tail(job, num_lines: int = 8) -> str:
    try:
        return log_tail(job.paths.stdout.read_text(errors="replace"), num_lines)
    except OSError:
        return "(no job log)"


def _cancel(in_flight: list, kind: str, config: ExperimentConfig, progress) -> int:
    """Cancel every job still running, let them record their runs, then make sure they are
    gone; how many were cancelled."""
    if not in_flight:
        return 0
    progress(f"cancelling {len(in_flight)} job(s): {', '.join(str(i.job.job_id) for i in in_flight)}")
    for item in in_flight:
        if kind == "local":
            item.job._process.terminate()  # SIGTERM: the controller forwards it to the job
        else:
            subprocess.call(["scancel", "--signal=INT", "--full", str(item.job.job_id)])
    deadline = time.monotonic() + CANCEL_GRACE_S
    while _running(in_flight) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    for item in _running(in_flight):  # past the grace: killed
        if kind == "local":
            item.job._process.kill()
            item.job._process.wait()
        else:
            item.job.cancel(check=False)
    deadline = time.monotonic() + CANCEL_GRACE_S
    while _running(in_flight) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    for item in in_flight:
        _record_if_lost(item, config)
    return len(in_flight)


def _running(in_flight: list) -> list:
    gone = _left_the_queue(in_flight)
    return [item for item in in_flight if not (item.done(force=True) or str(item.job.job_id) in gone)]


def _record_if_lost(item: _Submitted, config: ExperimentConfig) -> None:
    """A cancelled job that could not record its run (it was killed): its leftovers killed and
    the run recorded "interrupted", as the runner records a run it stops."""
    if item.recorded():
        return
    lock = RunLock(item.out_dir)
    if not lock.acquire():
        return  # another process trains it now, and records it
    try:
        kill_leftovers(item.out_dir)
        if not finished_ok(item.out_dir, config.run_hash(item.arm, item.seed)):
            record(config, item.arm, item.seed, item.out_dir, "none", exit_code=None, error=None,
                   stop=f"the cancellation of job {item.job.job_id}", survivors=[])
    finally:
        lock.release()


def _interrupt_report(config: ExperimentConfig, root: Path, runs, name: str, cancelled: int) -> str:
    """What the interruption stopped and kept, read back from the run directories."""
    jobs = f"its {cancelled} running job(s) were cancelled" if cancelled else "no job of it was running"
    lines = [f"stopped by {name}: experiment {config.name} in {Path(root) / config.name}; {jobs}"]
    finished, interrupted, other = [], [], []
    for arm, seed in runs:
        out_dir = run_directory(config, root, arm, seed)
        summary = read_summary(out_dir) or {}
        label = f"{arm} seed {seed}"
        if finished_ok(out_dir, config.run_hash(arm, seed)):
            finished.append(label)
        elif summary.get("status") == "interrupted":
            resume = summary.get("resume_from_step")
            interrupted.append(f"{label} (after step {summary.get('last_step')}; "
                               + (f"resumes from its checkpoint at step {resume})" if resume else "starts over)"))
        elif summary.get("status") is not None:
            other.append(f"{label} ({summary.get('status')})")
        else:
            other.append(f"{label} (not run)")
    return report_lines(lines, finished, [("interrupted", interrupted), ("not finished", other)])
