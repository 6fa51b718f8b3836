"""Launch discovery and process-group initialisation: torchrun, mpiexec (MPICH, Open MPI), SLURM.

A training script that calls :func:`init_distributed` runs unchanged under::

    torchrun --nproc-per-node 2 train.py
    mpiexec -n 2 python train.py            # MPICH/Hydra or Open MPI
    srun -n 2 python train.py               # SLURM (set MASTER_ADDR/MASTER_PORT, or have mpi4py)

API:

* :func:`discover` reads the launcher's environment variables and returns a
  :class:`LaunchInfo` (rank, world size, local rank, launcher name, rendezvous address).
  It never touches the network.
* :func:`init_distributed` calls :func:`discover`, finds a rendezvous (the launcher's, or
  one rank 0 picks and broadcasts with mpi4py), initialises the default process group and
  returns the :class:`LaunchInfo` it used.
* :func:`shutdown` destroys the default group once the DDP models that hold it are gone.

Which launcher wins when several left variables behind (first match):

1. ``env``/``torchrun``: ``RANK`` and ``WORLD_SIZE`` (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``).
   torch's own convention, so an explicit setting always wins; ``torchrun`` when
   ``TORCHELASTIC_RUN_ID`` is set too, ``env`` otherwise.
2. ``openmpi``: ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``
   (``OMPI_COMM_WORLD_LOCAL_RANK``, ``OMPI_COMM_WORLD_LOCAL_SIZE``).
3. ``mpich``: ``PMI_RANK``, ``PMI_SIZE`` (``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``), set by
   MPICH's Hydra ``mpiexec`` and by Intel MPI.
4. ``slurm``: ``SLURM_PROCID``, ``SLURM_NTASKS`` (``SLURM_LOCALID``; the local size from
   ``SLURM_TASKS_PER_NODE`` at ``SLURM_NODEID``, else ``SLURM_NTASKS_PER_NODE``).

MPI comes before SLURM because ``mpiexec`` inside an ``sbatch`` allocation hands every
process the batch script's ``SLURM_PROCID=0``; the MPI variables are the ones that
describe the processes. Without any of these variables the process is a single-process
job (launcher ``none``, rank 0 of 1).

The rendezvous address is ``MASTER_ADDR``/``MASTER_PORT`` for every launcher (torchrun
sets them; under mpiexec or srun, set them or install mpi4py).
"""
import dataclasses
import gc
import os
import re
import socket
from collections.abc import Mapping
from datetime import timedelta

LAUNCHERS = ("torchrun", "env", "openmpi", "mpich", "slurm", "none")
BACKENDS = ("gloo", "nccl")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LaunchInfo:
    """Where this process sits in the job, as its launcher described it."""

    launcher: str  # one of LAUNCHERS: which variables the values came from
    rank: int  # global rank, 0 <= rank < world_size
    world_size: int  # number of processes in the job
    local_rank: int | None  # rank among the processes on this node (picks the GPU); None if unknown
    local_world_size: int | None  # processes on this node; None if unknown
    master_addr: str | None  # rendezvous host (MASTER_ADDR); None if not set
    master_port: int | None  # rendezvous port (MASTER_PORT); None if not set


# launcher -> (rank, world size, local rank, local world size) variables
_VARIABLES = {
    "env": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    "slurm": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None),
}


def discover(environ: Mapping[str, str] | None = None) -> LaunchInfo:
    """This process's rank, world size and rendezvous, read from the launcher's variables.

    Args:
        environ: the variables to read (default ``os.environ``).

    Returns:
        A :class:`LaunchInfo`; see the module docstring for the precedence of launchers.

    Raises:
        ValueError: a launcher's variables are incomplete (e.g. ``RANK`` without
            ``WORLD_SIZE``), not integers, or inconsistent (rank outside the world size);
            or only one of ``MASTER_ADDR``/``MASTER_PORT`` is set, or the port is not in
            1..65535. The message names the variables and their values.
    """
    env = os.environ if environ is None else environ
    master_addr, master_port = _rendezvous(env)
    for launcher, (rank_var, size_var, local_rank_var, local_size_var) in _VARIABLES.items():
        if rank_var not in env and size_var not in env:
            continue
        missing = [name for name in (rank_var, size_var) if name not in env]
        if missing:
            present = rank_var if rank_var in env else size_var
            raise ValueError(f"{present} is set but {missing[0]} is not: the {launcher} launch variables "
                             f"{rank_var} and {size_var} must be set together")
        world_size = _integer(env, size_var, low=1)
        rank = _integer(env, rank_var, low=0)
        if rank >= world_size:
            raise ValueError(f"{rank_var}={rank} must be smaller than {size_var}={world_size}")
        local_rank = _integer(env, local_rank_var, low=0) if local_rank_var in env else None
        if launcher == "slurm":
            local_size, local_size_var = _slurm_local_size(env)
        else:
            local_size = _integer(env, local_size_var, low=1) if local_size_var in env else None
        if local_size is not None and local_size > world_size:
            raise ValueError(f"the local world size {local_size} ({local_size_var}) exceeds {size_var}={world_size}")
        if local_rank is not None and local_size is not None and local_rank >= local_size:
            raise ValueError(f"{local_rank_var}={local_rank} must be smaller than the local world size "
                             f"{local_size} ({local_size_var})")
        if launcher == "env" and "TORCHELASTIC_RUN_ID" in env:
            launcher = "torchrun"
        return LaunchInfo(launcher=launcher, rank=rank, world_size=world_size, local_rank=local_rank,
                          local_world_size=local_size, master_addr=master_addr, master_port=master_port)
    return LaunchInfo(launcher="none", rank=0, world_size=1, local_rank=0, local_world_size=1,
                      master_addr=master_addr, master_port=master_port)


def _integer(env: Mapping[str, str], name: str, *, low: int) -> int:
    text = env[name].strip()
    if not re.fullmatch(r"\d+", text) or int(text) < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {env[name]!r}")
    return int(text)


def _rendezvous(env: Mapping[str, str]) -> tuple[str | None, int | None]:
    addr, port = env.get("MASTER_ADDR") or None, env.get("MASTER_PORT") or None
    if (addr is None) != (port is None):
        present, absent = ("MASTER_ADDR", "MASTER_PORT") if addr is not None else ("MASTER_PORT", "MASTER_ADDR")
        raise ValueError(f"{present} is set but {absent} is not: set both (rank 0's host and a free port) or neither")
    if port is None:
        return None, None
    number = _integer(env, "MASTER_PORT", low=1)
    if number > 65535:
        raise ValueError(f"MASTER_PORT must be in 1..65535, got {port!r}")
    return addr, number


def _slurm_local_size(env: Mapping[str, str]) -> tuple[int | None, str | None]:
    """Tasks on this node and the variable they came from: ``SLURM_TASKS_PER_NODE``
    ("2(x3),1") at ``SLURM_NODEID``, else ``SLURM_NTASKS_PER_NODE``; (None, None) if neither."""
    per_node = env.get("SLURM_TASKS_PER_NODE")
    if per_node is not None and "SLURM_NODEID" in env:
        counts = []
        for part in per_node.split(","):
            match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
            if match is None:
                raise ValueError(f"SLURM_TASKS_PER_NODE must look like '2(x3),1', got {per_node!r}")
            counts += [int(match.group(1))] * int(match.group(2) or 1)
        node = _integer(env, "SLURM_NODEID", low=0)
        if node >= len(counts):
            raise ValueError(f"SLURM_NODEID={node} but SLURM_TASKS_PER_NODE={per_node!r} lists {len(counts)} node(s)")
        return counts[node], "SLURM_TASKS_PER_NODE"
    if re.fullmatch(r"\d+", env.get("SLURM_NTASKS_PER_NODE", "").strip()):
        return _integer(env, "SLURM_NTASKS_PER_NODE", low=1), "SLURM_NTASKS_PER_NODE"
    return None, None


def init_distributed(backend: str | None = None, *, timeout: timedelta | None = None) -> LaunchInfo:
    """Initialise the default process group for however this process was launched.

    1. :func:`discover` the rank, world size and local rank.
    2. Backend: ``backend`` or, by default, ``"nccl"`` when CUDA is available, else
       ``"gloo"``. With NCCL the current CUDA device becomes ``local_rank``. (PyPI torch has
       no MPI backend; under mpiexec, gloo/NCCL still carry the collectives.)
    3. Rendezvous (a TCPStore):
       - ``MASTER_ADDR``/``MASTER_PORT`` set: torch's ``env://`` rendezvous. Under torchrun
         with ``TORCHELASTIC_USE_AGENT_STORE=True`` the agent hosts the store; otherwise
         rank 0 hosts it at that address.
       - not set, a single process: a store on 127.0.0.1 and a free port.
       - not set, several processes, mpi4py installed and MPI ``COMM_WORLD`` matching the
         discovered rank and world size: rank 0 starts the store on a free port (the
         kernel picks it, so no other process can take it in between) and broadcasts its
         host and port with mpi4py. The host is 127.0.0.1 when all ranks share one node,
         else rank 0's host name.
       - otherwise: ``RuntimeError`` asking for ``MASTER_ADDR``/``MASTER_PORT``.

    Args:
        backend: ``"gloo"``, ``"nccl"`` or None (choose as above).
        timeout: collective and rendezvous timeout (default: torch's default).

    Returns:
        The :class:`LaunchInfo` used, with the rendezvous address and port filled in.

    Raises:
        ValueError: bad ``backend``/``timeout`` or launch variables (see :func:`discover`).
        RuntimeError: torch.distributed is already initialised, no rendezvous can be
            found, NCCL without a usable GPU, or MPI disagrees with the launch variables.

    Example::
        >>> # xdoctest: +SKIP
        >>> info = sparsecomm.dist.init_distributed()
        >>> ddp_model = DDP(model)
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    if backend is not None and backend not in BACKENDS:
        hint = ""
        if backend == "mpi":
            hint = " (PyPI torch is built without the MPI backend; mpiexec works with gloo/NCCL)"
        raise ValueError(f"backend must be one of None, {', '.join(map(repr, BACKENDS))}; got {backend!r}{hint}")
    if timeout is not None and not isinstance(timeout, timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta or None, got {type(timeout).__name__}")
    if dist.is_initialized():
        raise RuntimeError("init_distributed: torch.distributed is already initialised in this process")
    info = discover()
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    timeout = timeout or default_pg_timeout
    if backend == "nccl":
        _set_cuda_device(info)

    if info.master_addr is not None:
        # env:// reads MASTER_ADDR/MASTER_PORT and honours TORCHELASTIC_USE_AGENT_STORE.
        dist.init_process_group(backend, init_method="env://", rank=info.rank, world_size=info.world_size,
                                timeout=timeout)
        return info
    if info.world_size == 1:
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout, wait_for_workers=False)
    else:
        store = _store_over_mpi(info, timeout)
    dist.init_process_group(backend, store=store, rank=info.rank, world_size=info.world_size, timeout=timeout)
    return dataclasses.replace(info, master_addr=store.host, master_port=store.port)


def _set_cuda_device(info: LaunchInfo) -> None:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("backend='nccl' needs CUDA, and torch.cuda.is_available() is False: use backend='gloo'")
    if info.local_rank is None:
        raise RuntimeError(f"backend='nccl' picks the GPU from the local rank, but the {info.launcher} launcher "
                           "set no local rank variable; set LOCAL_RANK")
    if info.local_rank >= torch.cuda.device_count():
        raise RuntimeError(f"local rank {info.local_rank} has no GPU: this node has {torch.cuda.device_count()}; "
                           "start at most one process per GPU")
    torch.cuda.set_device(info.local_rank)


def _store_over_mpi(info: LaunchInfo, timeout: timedelta):
    """A TCPStore hosted by rank 0, its address broadcast over MPI COMM_WORLD."""
    import torch.distributed as dist

    try:
        from mpi4py import MPI
    except ImportError:
        raise RuntimeError(
            f"init_distributed: MASTER_ADDR and MASTER_PORT are not set ({info.launcher} launch, "
            f"{info.world_size} processes) and mpi4py is not installed to agree on them: export "
            "MASTER_ADDR=<rank 0's host> MASTER_PORT=<free port> on every rank, or pip install mpi4py"
        ) from None
    comm = MPI.COMM_WORLD
    if (comm.Get_size(), comm.Get_rank()) != (info.world_size, info.rank):
        rank_var, size_var = _VARIABLES["env" if info.launcher == "torchrun" else info.launcher][:2]
        raise RuntimeError(
            f"init_distributed: MPI COMM_WORLD has rank {comm.Get_rank()} of {comm.Get_size()}, but "
            f"{rank_var}={info.rank} and {size_var}={info.world_size}: launch with mpiexec directly, "
            "or set MASTER_ADDR and MASTER_PORT"
        )
    hostname = socket.gethostname()
    one_node = len(set(comm.allgather(hostname))) == 1
    store = None
    if info.rank == 0:
        # Port 0: the kernel picks a free port while the store binds it (no race with others).
        host = "127.0.0.1" if one_node else hostname
        store = dist.TCPStore(host, 0, info.world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        address = (host, store.port)
    else:
        address = None
    host, port = comm.bcast(address, root=0)
    if store is None:
        store = dist.TCPStore(host, port, info.world_size, is_master=False, timeout=timeout)
    return store


def shutdown() -> None:
    """Destroy the default process group, after freeing the objects that still hold it.

    A DDP model (and a hook state) keeps its process group alive through reference
    cycles, so ``destroy_process_group()`` alone leaves the gloo group to be torn down at
    interpreter exit, where it can abort the process ("terminate called without an active
    exception"; seen in about 1 run in 4 under mpiexec). Call this after the function that
    trained has returned (its DDP model is then unreachable): collecting first lets the
    group go down while the interpreter is still whole.
    """
    import torch.distributed as dist

    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
