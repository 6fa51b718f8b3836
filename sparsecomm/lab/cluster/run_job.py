"""One (arm, seed) run as a job: what a submitit job executes, on this machine or a node.

The job trains the run exactly as the one-by-one runner does
(:func:`sparsecomm.lab.experiment.runner.run_one`): the run directory's lock (a run is trained once, even when two commands submit it), the
checks of what a directory already holds, resumption from the run's latest checkpoint, the
launch under a supervisor, and the run's summary, "failed" with the rank's own error when it
fails. The job returns that summary; the submitting command reads the run directory.

Signals. Locally the job's controller forwards SIGTERM (the command's cancel): the run is
killed and recorded "interrupted", and the job ends. On SLURM, SIGTERM is left to submitit
(which ignores it: preemption sends SIGTERM before SIGUSR2) and the command cancels with
SIGINT. SIGUSR2 (the warning before a job's time limit: SLURM's, or a local job's
controller's; on SLURM also before a preemption) lets submitit requeue the job
(:meth:`RunJob.checkpoint`); the run is recorded "interrupted" with its latest checkpoint,
and the requeued job resumes from it.

On several nodes, the job's task on node 0 does all of the above; the other nodes' tasks
start their node's torchrun once node 0 has written this attempt's launch into the run's
``run-config.json``, and end when it ends (:mod:`sparsecomm.lab.cluster.node_group`).
"""
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import submitit

from sparsecomm.lab.cluster.node_group import NodeGroup
from sparsecomm.lab.experiment import launch_supervisor
from sparsecomm.lab.experiment.config import ExperimentConfig
from sparsecomm.lab.experiment.interrupt_signals import Interrupt, InterruptSignals
from sparsecomm.lab.experiment.launch import launch_marks, torchrun_command
from sparsecomm.lab.experiment.process_tree import death_signal_preexec
from sparsecomm.lab.experiment.run_records import finished_ok, read_summary, run_directory
from sparsecomm.lab.experiment.runner import RunState, run_one
from sparsecomm.lab.results.layout import RUN_CONFIG, node_launch_log

FOLLOWER_WAIT_S = 600.0
"""How long a node other than the first waits for the first to start the run."""


class RunJob(submitit.helpers.Checkpointable):
    """The job of one run. ``record`` is the run's config as its ranks read it (config,
    directory, code; :meth:`ExperimentConfig.of_run`), so a job computes the run hash the
    command computed, and refuses code that changed since the command started."""

    def __init__(self, record: dict, root: str, arm: str, seed: int, number: int, total: int,
                 cores: list[int] | None = None):
        self.record, self.root, self.arm, self.seed = record, root, arm, seed
        self.number, self.total = number, total
        self.cores = cores
        """Local runs in parallel: the CPU cores this run's processes are pinned to."""

    def __call__(self) -> dict | None:
        config = ExperimentConfig.of_run(self.record)
        root = Path(self.root)
        settings = config.cluster_settings
        if self.cores:
            os.sched_setaffinity(0, self.cores)  # inherited by the launch and every rank
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # as the one-by-one runner: identical results
        nodes = _node_group(config, settings)
        out_dir = run_directory(config, root, self.arm, self.seed)
        if nodes is not None and nodes.node != 0:
            return _follow(config, self.arm, self.seed, out_dir, nodes)
        signals = InterruptSignals()
        requeued = []
        # On SLURM, SIGTERM stays submitit's (ignored: preemption sends it before SIGUSR2).
        signals.install((signal.SIGINT,) if settings.kind == "slurm" else (signal.SIGINT, signal.SIGTERM))
        _on_usr2(signals, requeued)  # SIGUSR2 requeues the job, then stops the run here
        try:
            run_one(config, root, self.number, self.total, self.arm, self.seed, progress=_print, signals=signals,
                    state=RunState(), wait=True, nodes=nodes)
        except Interrupt:
            if requeued:
                raise requeued[0]  # submitit's exit: the job is requeued and resumes from the run's checkpoint
        finally:
            signals.restore()
        return read_summary(out_dir)

    def checkpoint(self, *args, **kwargs) -> submitit.helpers.DelayedSubmission:
        """Requeue as is: the run's own checkpoints (``checkpoint_every``) carry its state."""
        return submitit.helpers.DelayedSubmission(self)


def _print(line: str) -> None:
    print(line, flush=True)


def _on_usr2(signals, requeued: list) -> None:
    """SIGUSR2: submitit's handler (checkpoint + requeue, then SystemExit), then an Interrupt
    that kills and records the run; ``requeued`` receives submitit's SystemExit when it
    requeued the job, for the job to exit with once the run is recorded."""
    submitits = signal.getsignal(signal.SIGUSR2)

    def handle(signum, frame):
        if callable(submitits):
            try:
                submitits(signum, frame)
            except SystemExit as requeue:  # locally its exit code asks the controller to start the job again
                requeued.append(requeue)
            except Exception as error:  # noqa: BLE001 - e.g. timed out too often: not requeued
                _print(f"job not requeued: {error}")
        signals.interrupt("SIGUSR2")

    signal.signal(signal.SIGUSR2, handle)


def _node_group(config, settings) -> NodeGroup | None:
    """This task's place in a run on several nodes (None on one node)."""
    if settings.nodes == 1:
        return None
    env = submitit.JobEnvironment()
    job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job_id = f"{job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if job else env.job_id
    restart = os.environ.get("SLURM_RESTART_COUNT", "0")
    return NodeGroup(nodes=settings.nodes, ranks_per_node=settings.ranks_per_node(config.world_size),
                     first_node=env.hostnames[0], run_id=f"job{job_id}-{restart}", node=env.node)


def _follow(config, arm: str, seed: int, out_dir: Path, nodes: NodeGroup) -> None:
    """A node other than the first: its torchrun, once node 0 has started this attempt."""
    deadline = time.monotonic() + FOLLOWER_WAIT_S
    while _launch_in(out_dir) != nodes.run_id:
        if finished_ok(out_dir, config.run_hash(arm, seed)):
            return None  # finished earlier: node 0 skipped it
        if time.monotonic() > deadline:
            raise RuntimeError(f"node {nodes.node}: node 0 did not start run {out_dir.name} within "
                               f"{FOLLOWER_WAIT_S:g} s")
        time.sleep(1.0)
    argv = torchrun_command(config, arm, seed, out_dir, nodes)
    env = {**os.environ, **launch_marks(nodes.run_id, out_dir)}
    log_path = out_dir / node_launch_log(nodes.node)
    with open(log_path, "w") as log:
        process = subprocess.Popen(launch_supervisor.command(argv), env=env, stdout=log, stderr=subprocess.STDOUT,
                                   preexec_fn=death_signal_preexec())
        code = process.wait()
    if code != 0:
        raise RuntimeError(f"node {nodes.node}: torchrun exited with {code} (see {log_path})")
    return None


def _launch_in(out_dir: Path) -> str | None:
    """The launch id node 0 wrote for the attempt it started (None before it did)."""
    try:
        return json.loads((out_dir / RUN_CONFIG).read_text()).get("launch_id")
    except (OSError, ValueError, AttributeError):
        return None
