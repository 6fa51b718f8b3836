"""submitit executors for an experiment's runs, and the sbatch script a SLURM array gets.

Every job's files (its pickled function, submitit's logs) go under the experiment's
``jobs/`` directory (a private directory of the user, checked as run directories are:
whoever could write there could swap a pickle, which the job unpickles); the run's own files
stay in its run directory. On SLURM, the job runs ``python -u -m submitit.core._submit``
with the Python that submitted it, so the nodes need the same path to the same environment
(a shared file system, as they need for the runs).
"""
import os
import shlex
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import submitit
from submitit.core.utils import JobPaths
from submitit.local import local as submitit_local
from submitit.slurm import slurm as submitit_slurm

from sparsecomm.lab.cluster import sbatch
from sparsecomm.lab.experiment.cluster_settings import ClusterSettings
from sparsecomm.lab.experiment.process_tree import death_signal_preexec
from sparsecomm.lab.results.layout import JOBS_DIR

REQUEUE_LIMIT = 3
"""How often a job that reaches its time limit (or is preempted) is requeued."""
SIGNAL_DELAY_S = 120
"""SLURM sends SIGUSR2 this long before the time limit: time to stop the run and requeue."""
SLURM_COMMANDS = ("sbatch", "scancel", "squeue", "sacct", "srun", "scontrol")
"""What the SLURM path calls: the command sbatch (submit), scancel (cancel), squeue and sacct
(whether a job ended; sacct through submitit); the jobs srun (in their script) and scontrol
(submitit's requeue)."""


def jobs_folder(experiment_dir: Path) -> Path:
    return Path(experiment_dir) / JOBS_DIR / "%j"


def make_executor(settings: ClusterSettings, experiment_dir: Path, name: str, world_size: int, runs: int):
    """An executor for ``runs`` runs of experiment ``name``, configured from ``settings``."""
    folder = jobs_folder(experiment_dir)
    if settings.kind == "local":
        executor = _LocalExecutor(folder, max_num_timeout=REQUEUE_LIMIT)
        executor.update_parameters(timeout_min=settings.time_limit_min, tasks_per_node=1)
        return executor
    check_slurm_available()
    executor = _SlurmArrayExecutor(folder, max_num_timeout=REQUEUE_LIMIT)
    executor.update_parameters(**slurm_parameters(settings, name, world_size, runs))
    return executor


def check_slurm_available() -> None:
    missing = [command for command in SLURM_COMMANDS if shutil.which(command) is None]
    if missing:
        raise RuntimeError(f"cluster kind 'slurm': no {', '.join(missing)} on PATH (it needs {', '.join(SLURM_COMMANDS)});"
                           " submit from a machine of the SLURM cluster (a login node), or use --cluster local")


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


class _SlurmArrayExecutor(submitit.SlurmExecutor):
    """submitit's SlurmExecutor that submits every run as one job array (one run: an array of
    one) through :func:`sbatch.submit`: a failing sbatch raises its SubmissionError, and the
    pickles and script written for it are removed (no job will read them)."""

    def _internal_process_submissions(self, delayed_submissions):
        folder = JobPaths.get_first_id_independent_folder(self.folder)  # jobs/, checked by the command
        pickles = [folder / f".{uuid.uuid4().hex}.pkl" for _ in delayed_submissions]
        script = folder / f".submission-{uuid.uuid4().hex}.sh"
        try:
            for delayed, pickle in zip(delayed_submissions, pickles):
                delayed.set_timeout(self.parameters["time"], self.max_num_timeout)
                delayed.dump(pickle)
            script.write_text(submitit_slurm._make_sbatch_string(
                command=self._submitit_command_str, folder=self.folder, map_count=len(pickles), **self.parameters))
            array = sbatch.submit(script)
        except BaseException:
            for path in (*pickles, script):
                path.unlink(missing_ok=True)
            raise
        jobs = [submitit_slurm.SlurmJob(folder=self.folder, job_id=f"{array}_{element}", tasks=range(self._num_tasks()))
                for element in range(len(pickles))]
        for job, pickle in zip(jobs, pickles):
            job.paths.move_temporary_file(pickle, "submitted_pickle")
        submitit_slurm.SlurmJob(folder=self.folder, job_id=array).paths.move_temporary_file(script, "submission_file")
        return jobs


class _LocalExecutor(submitit.LocalExecutor):
    """submitit's LocalExecutor whose job controllers start in their own session: a Ctrl-C at
    the terminal reaches the command only, which cancels its jobs with SIGTERM (the controller
    forwards it to the job, which records the run). submitit's own controller, in the
    terminal's process group, would get the Ctrl-C too and SIGKILL the job a second later.
    A controller gets the same SIGTERM when the command dies, however it dies (a SIGKILL
    cannot be caught): its job is cancelled as by Ctrl-C, never left training unwatched."""

    def _submit_command(self, command: str):
        env = {**os.environ, "SUBMITIT_LOCAL_NTASKS": "1", "SUBMITIT_LOCAL_COMMAND": command,
               "SUBMITIT_LOCAL_TIMEOUT_S": str(int(60 * self.parameters["timeout_min"])),
               "SUBMITIT_LOCAL_SIGNAL_DELAY_S": str(int(self.parameters.get("signal_delay_s", 30))),
               "SUBMITIT_LOCAL_NODEID": "0", "SUBMITIT_LOCAL_JOB_NUM_NODES": "1", "SUBMITIT_STDERR_TO_STDOUT": "1",
               "SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_WITH_SHELL": ""}
        process = subprocess.Popen([sys.executable, "-m", "submitit.local._local", str(self.folder)], env=env,
                                   start_new_session=True, preexec_fn=death_signal_preexec(signal.SIGTERM))
        return submitit_local.LocalJob(folder=self.folder, job_id=str(process.pid), process=process, tasks=[0])
