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

Whichever test asks first runs it, in the session's temporary directory; each test run alone
still gets it. The result is kept for the pytest process, failed or not.
"""
import json
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


def compare_point(tmp_path_factory) -> ComparePoint:
    """The compare, run on the first call of this pytest session (later calls return it)."""
    key = tmp_path_factory.getbasetemp()
    if key not in _POINTS:
        root = tmp_path_factory.mktemp("digits-point")
        config_file = root / f"{NAME}.json"
        config_file.write_text(json.dumps(point_config().to_dict()))
        command = [sys.executable, "-m", "sparsecomm", "compare", "--config", str(config_file),
                   "--out", str(root / "runs"), "--plots", str(root / "plots")]
        try:
            first = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired as expired:
            first = subprocess.CompletedProcess(command, None, _text(expired.stdout),
                                                _text(expired.stderr) + f"\n(killed: no exit within {TIMEOUT_S} s)")
        _POINTS[key] = ComparePoint(root / "runs", root / "plots", command, first)
    return _POINTS[key]


def _text(output) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")
