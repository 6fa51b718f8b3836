"""One real ``sparsecomm compare`` shared by three end-to-end tests, so its six launches are paid once.

digits-quick's dense vs topk-ef at density 0.001, 3 seeds x 2 gloo ranks, 50 steps, started
as a subprocess (``python -m sparsecomm compare --config ...``):

* test_experiment_runner checks what the command printed (ledger, verdict against scipy,
  plots), its run directory, and that a re-run skips the finished runs;
* test_frontier's end-to-end frontier sweeps densities 1 and 0.001 with the same settings into
  the same ``--out``. The experiment here is named as the frontier names its density-0.001
  point (``digits-quick-frontier-d0.001``), and a run's hash leaves the experiment's name out,
  so the frontier finds these six runs finished and skips them, as any re-run does; it trains
  only its density-1 point;
* test_experiment_wire's codec sweep (density 0.001, seed 0, same steps, same ``--out``) copies
  its dense run from here into each codec's experiment, as the frontier reuses a density's
  dense runs across wires, and trains only its top-k runs.

Whichever test asks first runs it; each test run alone still gets it. Under pytest-xdist the
test workers share it too: the first worker to ask trains it under a file lock, in a folder of
this test run that every worker sees; the others wait for the lock and reuse it (a second
compare would cost a 2-core machine about a minute and a half). Every caller gets its own
copy of the runs and plots, so what one test adds (the frontier's runs, a re-run) is not
seen by another. The result is kept for the pytest process, failed or not.
"""
import fcntl
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from sparsecomm.lab.experiment.config import ExperimentConfig
from sparsecomm.lab.experiment.named import digits_quick

DENSITY = 0.001
STEPS = 50
SEEDS = (0, 1, 2)
NAME = f"digits-quick-frontier-d{DENSITY:g}"  # sparsecomm.lab.frontier's name of this density's experiment
TIMEOUT_S = 420  # a hang guard: 6 launches take about 1 min on an idle 2-core machine, 3 on a busy one


def point_config() -> ExperimentConfig:
    return digits_quick().with_overrides(name=NAME, density=DENSITY, steps=STEPS, seeds=SEEDS)


@dataclass(frozen=True)
class ComparePoint:
    out: Path  # the --out root; the experiment is out / NAME
    plots: Path  # the --plots root
    command: list[str]
    first: subprocess.CompletedProcess  # the first compare (it launched the runs)

    @property
    def experiment_dir(self) -> Path:
        return self.out / NAME


_POINTS: dict[Path, ComparePoint] = {}


def _command(root: Path) -> list[str]:
    return [sys.executable, "-m", "sparsecomm", "compare", "--config", str(root / f"{NAME}.json"),
            "--out", str(root / "runs"), "--plots", str(root / "plots")]


def _shared_root(tmp_path_factory) -> Path:
    """Where the trained compare lives: beside the workers' temporary folders under xdist
    (named after this test run, so no other run's files are reused), else in this session's."""
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    base = tmp_path_factory.getbasetemp()
    root = base.parent / f"digits-point-{run_id}" if run_id else base / "digits-point-shared"
    root.mkdir(parents=True, exist_ok=True)
    return root


def _train_once(root: Path) -> dict:
    """The compare's outcome, training it unless a worker already did (under the lock)."""
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        outcome_file = root / "outcome.json"
        if outcome_file.exists():
            return json.loads(outcome_file.read_text())
        (root / f"{NAME}.json").write_text(json.dumps(point_config().to_dict()))
        command = _command(root)
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
            outcome = {"returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr}
        except subprocess.TimeoutExpired as expired:
            outcome = {"returncode": None, "stdout": _text(expired.stdout),
                       "stderr": _text(expired.stderr) + f"\n(killed: no exit within {TIMEOUT_S} s)"}
        outcome_file.write_text(json.dumps(outcome))
        return outcome


def compare_point(tmp_path_factory) -> ComparePoint:
    """The compare, run on the first call of this test run (later calls return it)."""
    key = tmp_path_factory.getbasetemp()
    if key not in _POINTS:
        shared = _shared_root(tmp_path_factory)
        outcome = _train_once(shared)
        root = tmp_path_factory.mktemp("digits-point")  # this process's copy
        shutil.copy(shared / f"{NAME}.json", root / f"{NAME}.json")
        for folder in ("runs", "plots"):
            if (shared / folder).exists():
                shutil.copytree(shared / folder, root / folder)
        command = _command(root)
        # What it printed, as if it had run here (it names its folders).
        stdout, stderr = (outcome[name].replace(str(shared), str(root)) for name in ("stdout", "stderr"))
        first = subprocess.CompletedProcess(command, outcome["returncode"], stdout, stderr)
        _POINTS[key] = ComparePoint(root / "runs", root / "plots", command, first)
    return _POINTS[key]


def _text(output) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")
