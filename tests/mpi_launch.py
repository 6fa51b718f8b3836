"""Run a script under ``mpiexec -n N`` from a test, with a hard timeout; skip without MPI.

The mpiexec next to the running Python comes first (the ``mpich`` wheel installs it into
the virtual environment, matching mpi4py), then the one on PATH. On timeout the whole
process group (mpiexec, its proxies and ranks) is killed, so a hang never blocks CI.
"""
import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

from deadline import run_with_deadline

# Variables that would make the ranks believe another launcher started them.
_LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                     "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE")


def find_mpiexec() -> str | None:
    beside_python = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.access(beside_python, os.X_OK):
        return beside_python
    return shutil.which("mpiexec")


def mpiexec_or_skip() -> str:
    """The mpiexec to use, or skip the test saying what is missing."""
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py is not installed (pip install mpi4py mpich)")
    mpiexec = find_mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec beside the Python interpreter or on PATH (pip install mpich)")
    return mpiexec


def run_mpiexec(script_args: list[str], *, num_ranks: int = 2, timeout: float = 60.0,
                extra_env: dict | None = None) -> subprocess.CompletedProcess:
    """``mpiexec -n num_ranks python *script_args``; fails the test on timeout or a non-zero exit."""
    mpiexec = mpiexec_or_skip()
    env = {name: value for name, value in os.environ.items() if name not in _LAUNCH_VARIABLES}
    # Open MPI refuses to run as root and to start more ranks than cores unless told;
    # MPICH ignores these variables.
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1",
               PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe")
    env.update(extra_env or {})
    command = [mpiexec, "-n", str(num_ranks), sys.executable, *script_args]
    result = run_with_deadline(command, timeout=timeout, env=env)
    if result.returncode != 0:
        pytest.fail(f"{' '.join(command)} exited with {result.returncode}. Output:\n{result.stdout}")
    return result
