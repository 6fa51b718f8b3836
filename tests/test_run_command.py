"""``sparsecomm run`` under mpiexec: one arm x seed per job, rank and rendezvous from MPI,
the same run directory and the same numbers, bit for bit, as ``sparsecomm compare`` (torchrun)."""
import os
import subprocess
import sys

import pytest

from mpi_launch import run_mpiexec
from sparsecomm.lab.experiment.named import digits_quick
from sparsecomm.lab.experiment.runner import run_experiment
from sparsecomm.lab.results import load_runs, load_steps

pytestmark = pytest.mark.timeout(240)

STEPS = 20


def _train_losses(run) -> list[float]:
    return [row["train_loss"] for row in load_steps(run.path) if row["kind"] == "train"]


@pytest.mark.slow  # ~1 min; scripts launched by mpiexec are tested in test_bring_your_own.py, the hook in test_dist.py
def test_mpiexec_runs_match_torchrun_runs_bit_for_bit(tmp_path):
    arms = ("dense", "topk-ef")
    config = digits_quick().with_overrides(arms=arms, seeds=(1,), steps=STEPS)
    by_torchrun = {r.arm: r for r in load_runs(run_experiment(config, tmp_path / "torchrun", progress=lambda _: None))}
    assert set(by_torchrun) == set(arms) and {r.status for r in by_torchrun.values()} == {"ok"}

    # topk-ef (the sparse hook: its exchange, error feedback, every rank's own data slice) under
    # mpiexec, into a directory of its own: trained again, to the same numbers.
    out = run_mpiexec(["-m", "sparsecomm", "run", "--experiment", "digits-quick", "--arm", "topk-ef", "--seed", "1",
                       "--steps", str(STEPS), "--out", str(tmp_path / "mpi")], timeout=120)
    assert "2 ranks (mpich)" in out.stdout or "2 ranks (openmpi)" in out.stdout, out.stdout
    assert "topk-ef seed 1: final val loss" in out.stdout
    (by_mpi,) = load_runs(tmp_path / "mpi" / "digits-quick")
    assert (by_mpi.arm, by_mpi.status) == ("topk-ef", "ok")
    assert by_mpi.path.name == by_torchrun["topk-ef"].path.name  # the same run, found by the same hash
    assert _train_losses(by_mpi) == _train_losses(by_torchrun["topk-ef"])
    assert by_mpi.final_val_loss == by_torchrun["topk-ef"].final_val_loss

    # dense under mpiexec, into compare's directory: the run compare finished (the same hash),
    # so it is not redone.
    again = run_mpiexec(["-m", "sparsecomm", "run", "--experiment", "digits-quick", "--arm", "dense", "--seed", "1",
                         "--steps", str(STEPS), "--out", str(tmp_path / "torchrun")], timeout=120)
    assert f"dense seed 1: finished earlier, skipped ({by_torchrun['dense'].path})" in again.stdout, again.stdout


@pytest.mark.parametrize("args, message", [
    (["--arm", "dense", "--seed", "0"], "needs >= 2 processes (found 1, launcher none)"),
    (["--arm", "sparse", "--seed", "0"], "argument --arm: 'sparse' is neither a preset"),
    (["--arm", "dense", "--seed", "-1"], "--seed must be an integer >= 0"),
])
def test_bad_use_is_refused_before_any_collective(args, message, tmp_path):
    env_free = {k: v for k, v in os.environ.items()
                if k not in ("RANK", "WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")}
    result = subprocess.run([sys.executable, "-m", "sparsecomm", "run", *args, "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=60, env=env_free)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not any(tmp_path.iterdir())
