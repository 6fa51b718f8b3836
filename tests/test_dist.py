"""Launch discovery (sparsecomm.dist) from each launcher's variables, and real launches.

Discovery is tested on explicit environments (no process is started); the launches run
``experiments/examples/mpi_ddp.py`` as a plain user would: under ``mpiexec -n 2`` and as
a single process, with a hard timeout.
"""
import json
import os
import subprocess
import sys

import pytest

from mpi_launch import run_mpiexec
from sparsecomm.dist import LaunchInfo, discover, init_distributed

pytestmark = pytest.mark.timeout(120)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "experiments", "examples", "mpi_ddp.py")

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "node0",
            "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none"}
MPICH = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
OPENMPI = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
SLURM = {"SLURM_PROCID": "6", "SLURM_NTASKS": "7", "SLURM_LOCALID": "0", "SLURM_NODEID": "3",
         "SLURM_TASKS_PER_NODE": "2(x3),1"}


@pytest.mark.parametrize("env, expected", [
    (TORCHRUN, LaunchInfo(launcher="torchrun", rank=3, world_size=4, local_rank=1, local_world_size=2,
                          master_addr="node0", master_port=29500)),
    ({"RANK": "0", "WORLD_SIZE": "1"}, LaunchInfo(launcher="env", rank=0, world_size=1, local_rank=None,
                                                  local_world_size=None, master_addr=None, master_port=None)),
    (MPICH, LaunchInfo(launcher="mpich", rank=1, world_size=2, local_rank=1, local_world_size=2, master_addr=None,
                       master_port=None)),
    (OPENMPI, LaunchInfo(launcher="openmpi", rank=5, world_size=8, local_rank=1, local_world_size=4,
                         master_addr=None, master_port=None)),
    # Node 3 of "2(x3),1" is the fourth node, which runs one task.
    (SLURM, LaunchInfo(launcher="slurm", rank=6, world_size=7, local_rank=0, local_world_size=1, master_addr=None,
                       master_port=None)),
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "2"},
     LaunchInfo(launcher="slurm", rank=1, world_size=4, local_rank=1, local_world_size=2, master_addr=None,
                master_port=None)),
    ({}, LaunchInfo(launcher="none", rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr=None,
                    master_port=None)),
], ids=["torchrun", "env", "mpich", "openmpi", "slurm", "slurm-ntasks-per-node", "none"])
def test_discover_each_launcher(env, expected):
    assert discover(env) == expected


@pytest.mark.parametrize("env, launcher, rank", [
    (TORCHRUN | MPICH, "torchrun", 3),  # torchrun inside an mpiexec allocation: torch's variables win
    (OPENMPI | MPICH, "openmpi", 5),
    (MPICH | {"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, "mpich", 1),  # mpiexec inside sbatch
    (OPENMPI | SLURM, "openmpi", 5),
], ids=["torchrun-over-mpich", "openmpi-over-mpich", "mpich-over-slurm", "openmpi-over-slurm"])
def test_discover_precedence(env, launcher, rank):
    info = discover(env)
    assert (info.launcher, info.rank) == (launcher, rank)


def test_discover_reads_os_environ(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("RANK", "WORLD_SIZE", "OMPI_", "PMI_", "SLURM_", "MASTER_")):
            monkeypatch.delenv(name)
    for name, value in MPICH.items():
        monkeypatch.setenv(name, value)
    assert discover().launcher == "mpich"


@pytest.mark.parametrize("env, names", [
    ({"RANK": "0"}, ["RANK", "WORLD_SIZE"]),
    ({"PMI_SIZE": "2"}, ["PMI_SIZE", "PMI_RANK"]),
    ({"RANK": "2", "WORLD_SIZE": "2"}, ["RANK=2", "WORLD_SIZE=2"]),
    ({"PMI_RANK": "one", "PMI_SIZE": "2"}, ["PMI_RANK", "'one'"]),
    ({"OMPI_COMM_WORLD_RANK": "-1", "OMPI_COMM_WORLD_SIZE": "2"}, ["OMPI_COMM_WORLD_RANK", "'-1'"]),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "0"}, ["SLURM_NTASKS", ">= 1"]),
    (MPICH | {"MPI_LOCALRANKID": "2"}, ["MPI_LOCALRANKID=2", "MPI_LOCALNRANKS"]),
    (MPICH | {"MPI_LOCALNRANKS": "3"}, ["local world size 3", "PMI_SIZE=2"]),
    (SLURM | {"SLURM_TASKS_PER_NODE": "2x3"}, ["SLURM_TASKS_PER_NODE", "'2x3'"]),
    (SLURM | {"SLURM_NODEID": "4"}, ["SLURM_NODEID=4", "4 node(s)"]),
    (MPICH | {"MASTER_ADDR": "node0"}, ["MASTER_ADDR", "MASTER_PORT"]),
    (MPICH | {"MASTER_ADDR": "node0", "MASTER_PORT": "70000"}, ["MASTER_PORT", "1..65535"]),
], ids=["rank-without-size", "size-without-rank", "rank-out-of-range", "not-an-integer", "negative",
        "zero-size", "local-rank-out-of-range", "local-size-above-world", "slurm-tasks-malformed",
        "slurm-node-out-of-range", "addr-without-port", "port-out-of-range"])
def test_discover_rejects_bad_values_naming_the_variables(env, names):
    with pytest.raises(ValueError) as raised:
        discover(env)
    for name in names:
        assert name in str(raised.value), (name, str(raised.value))


@pytest.mark.parametrize("backend, error, words", [
    ("mpi", ValueError, ["backend", "'gloo'", "'nccl'", "MPI backend"]),
    ("tcp", ValueError, ["backend", "'gloo'", "'nccl'"]),
])
def test_init_distributed_rejects_backend(backend, error, words):
    with pytest.raises(error) as raised:
        init_distributed(backend)
    for word in words:
        assert word in str(raised.value)


def test_init_distributed_rejects_timeout_type():
    with pytest.raises(TypeError, match="timeout must be a datetime.timedelta"):
        init_distributed(timeout=30)


def test_init_distributed_without_rendezvous_or_mpi4py_asks_for_master_addr(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in MPICH.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # "import mpi4py" now raises ImportError
    with pytest.raises(RuntimeError) as raised:
        init_distributed("gloo")
    for word in ("MASTER_ADDR", "MASTER_PORT", "mpi4py"):
        assert word in str(raised.value)


def _run_example(tmp_path, *launcher):
    summary = tmp_path / "summary.json"
    args = [EXAMPLE, "--steps", "40", "--summary", str(summary)]
    if launcher:
        run_mpiexec(args, num_ranks=2, timeout=90)
    else:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("RANK", "WORLD_SIZE", "OMPI_", "PMI_", "SLURM_", "MASTER_"))}
        subprocess.run([sys.executable, *args], check=True, timeout=90, env=env, capture_output=True)
    return json.loads(summary.read_text())


def test_example_under_mpiexec_trains_with_the_hook(tmp_path):
    summary = _run_example(tmp_path, "mpiexec")
    assert summary["launch"]["world_size"] == 2
    assert summary["launch"]["launcher"] in ("mpich", "openmpi")
    losses = summary["losses"]
    # The teacher task is learnable: 40 steps cut the loss well below the start.
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses
    assert summary["stats"]["sparse_calls"] > 0
    # k = ceil(density * numel) per bucket: slightly above the declared 5%, never below.
    assert 0.05 <= summary["stats"]["effective_density"] < 0.0505


def test_example_runs_as_a_single_process(tmp_path):
    summary = _run_example(tmp_path)
    assert summary["launch"] == {"launcher": "none", "world_size": 1}
