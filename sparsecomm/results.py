"""Reading an experiment's result files. Needs no torch: reports can be made anywhere.

Layout of a run directory written by ``sparsecomm compare``::

    RUN_DIR/experiment.json                  config snapshot, policy, environment
    RUN_DIR/runs/<arm>-seed<s>-<hash>/summary.json   one paired run (arm x seed), when finished
    RUN_DIR/runs/<arm>-seed<s>-<hash>/steps.jsonl    one JSON object per line:
        {"kind": "train", "step", "train_loss", "step_seconds", "compute_seconds",
         "compress_seconds", "comm_wait_seconds", "bytes_sent", "bytes_dense", "elapsed_seconds"}
        {"kind": "eval", "step", "val_loss", "elapsed_seconds"}

``elapsed_seconds`` counts wall clock from the run's first data touch (evaluation
included). Steps are numbered from 1 (the step just completed).
"""
import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Eval:
    step: int
    elapsed_seconds: float
    val_loss: float


@dataclass(frozen=True)
class RunSummary:
    """One finished (or failed) arm x seed run."""

    arm: str
    seed: int
    status: str  # "ok" or "failed"
    path: Path
    config_hash: str = ""
    error: str = ""
    setup_seconds: float | None = None
    median_step_seconds: float | None = None
    median_compute_seconds: float | None = None
    median_compress_seconds: float | None = None
    median_comm_wait_seconds: float | None = None
    bytes_sent_per_step: float | None = None
    bytes_dense_per_step: float | None = None
    evals: tuple[Eval, ...] = ()
    extra: dict = field(default_factory=dict)

    @property
    def final_val_loss(self) -> float | None:
        return self.evals[-1].val_loss if self.evals else None

    def first_reaching(self, target: float) -> Eval | None:
        """The first evaluation at or below ``target`` (resolution: the eval cadence)."""
        return next((e for e in self.evals if e.val_loss <= target), None)


def load_experiment(run_dir: str | Path) -> dict:
    """The ``experiment.json`` snapshot (config, policy, environment)."""
    path = Path(run_dir) / "experiment.json"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not an experiment run directory: {path} is missing")
    return json.loads(path.read_text())


def experiment_link(experiment: dict) -> str:
    """The link the experiment's ranks were joined by (``loopback`` when none was emulated)."""
    return str(experiment["config"].get("link", "loopback"))


def arms_configured_first(configured, runs) -> list[str]:
    """The configured arms in their order, then any other arm found among ``runs``, sorted."""
    order = list(configured)
    return order + sorted({r.arm for r in runs} - set(order))


def load_summary(path: Path) -> RunSummary:
    raw = json.loads(path.read_text())
    evals = tuple(Eval(int(s), float(t), float(v)) for s, t, v in raw.pop("evals", []))
    known = {f for f in RunSummary.__dataclass_fields__ if f not in ("path", "evals", "extra")}
    fields = {k: raw.pop(k) for k in list(raw) if k in known}
    return RunSummary(path=path.parent, evals=evals, extra=raw, **fields)


def load_runs(run_dir: str | Path) -> list[RunSummary]:
    """The experiment's runs that have a summary, sorted by (arm, seed); failed runs included.

    Only the runs the current ``experiment.json`` lists count: runs of an earlier config
    stay on disk but are not mixed into this report.
    """
    run_dir = Path(run_dir)
    listed = load_experiment(run_dir).get("runs")
    if listed is None:
        summaries = sorted(run_dir.glob("runs/*/summary.json"))
    else:
        summaries = [run_dir / "runs" / name / "summary.json" for name in listed.values()]
    runs = [load_summary(p) for p in summaries if p.is_file()]
    return sorted(runs, key=lambda r: (r.arm, r.seed))


def load_steps(run_path: str | Path) -> list[dict]:
    """The rows of a run's ``steps.jsonl``."""
    with open(Path(run_path) / "steps.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]
