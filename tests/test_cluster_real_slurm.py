"""An experiment through a real SLURM: a paired digits experiment submitted with
``--cluster slurm`` to the running controller gives the one-by-one runner's results.

Slow, and skipped unless a SLURM answers on this machine (``bash scripts/start_local_slurm.sh``
starts a single-node one as root; scripts/run_slow_tests.sh runs this file).
"""
import shutil
import subprocess

import pytest

from test_cluster import final_losses, one_by_one, run_compare  # noqa: F401  (one_by_one: the module's oracle)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def slurm_answers() -> bool:
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return False
    try:
        return subprocess.run(["sinfo", "--noheader"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.mark.skipif(not slurm_answers(), reason="no SLURM controller answers here (scripts/start_local_slurm.sh)")
def test_a_real_slurm_job_array_gives_the_one_by_one_results(tmp_path, one_by_one):
    assert run_compare(tmp_path, "--cluster", "slurm", "--parallel", "2", "--time", "10") == 0
    assert final_losses(tmp_path / "runs") == one_by_one
