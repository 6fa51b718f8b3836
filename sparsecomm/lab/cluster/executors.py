"""submitit executors for an experiment's runs, and the sbatch script a SLURM array gets.

Every job's files (its pickled function, submitit's logs) go under the experiment's
``jobs/`` directory; the run's own files stay in its run directory. On SLURM, the job runs
``python -u -m submitit.core._submit`` with the Python that submitted it, so the nodes need
the same path to the same environment (a shared file system, as they need for the runs).
"""
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import submitit
from submitit.local import local as submitit_local

from sparsecomm.lab.cluster.settings import ClusterSettings

REQUEUE_LIMIT = 3
"""How often a job that reaches its time limit (or is preempted) is requeued."""
SIGNAL_DELAY_S = 120
"""SLURM sends SIGUSR2 this long before the time limit: time to stop the run and requeue."""


def jobs_folder(experiment_dir: Path) -> Path:
    return Path(experiment_dir) / "jobs" / "%j"


def make_executor(settings: ClusterSettings, experiment_dir: Path, name: str, world_size: int, runs: int):
    """An executor for ``runs`` runs of experiment ``name``, configured from ``settings``."""
    folder = jobs_folder(experiment_dir)
    if settings.kind == "local":
        executor = _LocalExecutor(folder, max_num_timeout=REQUEUE_LIMIT)
        executor.update_parameters(timeout_min=settings.time_limit_min, tasks_per_node=1)
        return executor
    check_slurm_available()
    executor = submitit.SlurmExecutor(folder, max_num_timeout=REQUEUE_LIMIT)
    executor.update_parameters(**slurm_parameters(settings, name, world_size, runs))
    return executor


def check_slurm_available() -> None:
    if shutil.which("sbatch") is None or shutil.which("srun") is None:
        raise RuntimeError("cluster kind 'slurm': no sbatch/srun on PATH; submit from a machine of the SLURM cluster "
                           "(a login node), or use --cluster local")


def slurm_parameters(settings: ClusterSettings, name: str, world_size: int, runs: int) -> dict:
    """submitit's SlurmExecutor parameters for ``runs`` runs of experiment ``name``."""
    return dict(job_name=f"sparsecomm-{name}", time=settings.time_limit_min, nodes=settings.nodes,
                ntasks_per_node=1,  # one torchrun per node, which starts the node's ranks
                cpus_per_task=settings.ranks_per_node(world_size), gpus_per_node=settings.gpus_per_node,
                partition=settings.partition, signal_delay_s=SIGNAL_DELAY_S,
                array_parallelism=settings.parallel or max(runs, 1), stderr_to_stdout=True,
                additional_parameters=dict(settings.slurm), wckey="sparsecomm")


def sbatch_script(settings: ClusterSettings, experiment_dir: Path, name: str, world_size: int, runs: int) -> str:
    """The sbatch script SLURM gets for an array of ``runs`` runs (what ``compare`` submits)."""
    folder = jobs_folder(experiment_dir)
    command = f"{shlex.quote(sys.executable)} -u -m submitit.core._submit {shlex.quote(str(folder))}"
    parameters = {k: v for k, v in slurm_parameters(settings, name, world_size, runs).items() if v is not None}
    return submitit.slurm.slurm._make_sbatch_string(command=command, folder=folder, map_count=runs, **parameters)


class _LocalExecutor(submitit.LocalExecutor):
    """submitit's LocalExecutor whose job controllers start in their own session: a Ctrl-C at
    the terminal reaches the command only, which cancels its jobs with SIGTERM (the controller
    forwards it to the job, which records the run). submitit's own controller, in the
    terminal's process group, would get the Ctrl-C too and SIGKILL the job a second later."""

    def _submit_command(self, command: str):
        env = {**os.environ, "SUBMITIT_LOCAL_NTASKS": "1", "SUBMITIT_LOCAL_COMMAND": command,
               "SUBMITIT_LOCAL_TIMEOUT_S": str(int(60 * self.parameters["timeout_min"])),
               "SUBMITIT_LOCAL_SIGNAL_DELAY_S": str(int(self.parameters.get("signal_delay_s", 30))),
               "SUBMITIT_LOCAL_NODEID": "0", "SUBMITIT_LOCAL_JOB_NUM_NODES": "1", "SUBMITIT_STDERR_TO_STDOUT": "1",
               "SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_WITH_SHELL": ""}
        process = subprocess.Popen([sys.executable, "-m", "submitit.local._local", str(self.folder)], env=env,
                                   start_new_session=True)
        return submitit_local.LocalJob(folder=self.folder, job_id=str(process.pid), process=process, tasks=[0])
