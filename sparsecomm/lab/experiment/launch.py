"""The processes of one run: the commands that start its ranks, the marks they carry, and
killing what an earlier launch of the run left behind.

On loopback one torchrun (or mpiexec) starts the ranks; on an emulated link, one process
per rank, each inside its own network namespace. A run on several nodes starts one torchrun
per node (:class:`Nodes`, which :class:`sparsecomm.lab.cluster.node_group.NodeGroup` is).
"""
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Protocol

from sparsecomm.lab.experiment.config import ExperimentConfig
from sparsecomm.lab.experiment.process_tree import LAUNCH_ENV, RUN_DIR_ENV, kill_marked, marked_processes
from sparsecomm.lab.experiment.script_run import LAUNCH_TIME_ENV, RUN_CONFIG_ENV
from sparsecomm.lab.results.layout import RUN_CONFIG
from sparsecomm.links.netns import INTERFACE, STORE_PORT, EmulatedNetwork


class Nodes(Protocol):
    """This node's part in a run on several nodes."""

    run_id: str
    """The run's rendezvous id, also the launch id every process of it carries."""

    def torchrun_arguments(self) -> list[str]:
        """What tells this node's torchrun how many nodes and ranks there are and where they meet."""


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


def torchrun_command(config: ExperimentConfig, arm: str, seed: int, out_dir: Path,
                     nodes: Nodes | None = None) -> list[str]:
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


def launch_commands(config: ExperimentConfig, network: EmulatedNetwork | None, arm: str, seed: int, out_dir: Path,
                    nodes: Nodes | None = None) -> list[tuple[list[str], dict | None]]:
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
        return [(torchrun_command(config, arm, seed, out_dir, nodes), None)]
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


def kill_leftovers(out_dir: Path) -> int:
    """Processes of an earlier launch of this run directory still alive (their runner was
    SIGKILLed and the death signal missed them): killed. The caller holds the run's lock, so
    no live runner owns them. Returns how many there were."""
    marked = marked_processes(RUN_DIR_ENV, str(out_dir.resolve()))
    if marked:
        kill_marked(RUN_DIR_ENV, str(out_dir.resolve()))
    return len(marked)
