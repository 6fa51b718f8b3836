"""What the commands that sweep one setting share (``sparsecomm frontier``: densities,
``sparsecomm scale``: world sizes): one paired experiment per point, judged as ``compare``
judges it (the ledger and the equivalence verdicts), and the plain-text table they print.

A point whose dense runs all failed has nothing to compare against: its outcome carries no
ledger and no verdicts, and the commands report its arms as :data:`UNAVAILABLE`, never a guess.
"""
import sys
from dataclasses import dataclass, field
from pathlib import Path

UNAVAILABLE = "unavailable"  # no dense run finished at that point
VERDICT_MARKERS = {"equivalent": "o", "better": "o", "inconclusive": "s", "worse": "x"}
"""Matplotlib marker per verdict (inconclusive drawn hollow by the plots that use it)."""


@dataclass(frozen=True)
class PointOutcome:
    """One point's experiment, run and read back."""

    run_dir: Path
    runs: list  # RunSummary, every run with a summary (failed ones too)
    ledger: object | None  # sparsecomm.lab.ledger.Ledger; None when no dense run finished
    report: object | None  # sparsecomm.lab.tolerance.CheckReport; None likewise
    counts: dict = field(default_factory=dict)  # arm -> (runs not finished or missing, their statuses)

    @property
    def available(self) -> bool:
        return self.report is not None

    def failures(self, arm: str) -> dict:
        """``failed``, ``dense_failed`` and ``not_ok`` ("arm: 1 interrupted; dense: 2 failed") of ``arm``."""
        failed, text = self.counts.get(arm, (0, ""))
        dense_failed, dense_text = self.counts.get("dense", (0, ""))
        parts = [f"arm: {text}"] * bool(text) + [f"dense: {dense_text}"] * bool(dense_text)
        return {"failed": failed, "dense_failed": dense_failed, "not_ok": "; ".join(parts)}


def run_point(config, out_root: Path) -> PointOutcome:
    """Run what is missing of ``config``'s experiment under ``out_root`` (finished runs are
    reused, as ``compare`` reuses them) and read its runs, ledger and verdicts."""
    from sparsecomm.lab import ledger, tolerance
    from sparsecomm.lab.run_where import run_experiment
    from sparsecomm.lab.results import describe_counts, load_experiment, load_runs, status_counts

    run_dir = run_experiment(config, out_root)
    runs = load_runs(run_dir)
    missing = ledger.missing_runs(load_experiment(run_dir), runs)
    counts = {}
    for arm in dict.fromkeys([*config.arms, *(r.arm for r in runs)]):
        mine = status_counts(r for r in runs if r.arm == arm)
        num_missing = sum(a == arm for a, _ in missing)
        if num_missing:
            mine["missing"] = num_missing
        counts[arm] = (sum(mine.values()), describe_counts(mine))
    if ledger.no_finished_dense(runs, missing) is not None:
        return PointOutcome(run_dir, runs, None, None, counts)
    return PointOutcome(run_dir, runs, ledger.build_ledger(run_dir), tolerance.check(run_dir), counts)


def run_and_read(prog: str, work):
    """``work()`` (it launches runs and reads them) with the result files' warnings on stderr:
    ``(its result, None)``, or ``(None, exit code)``: 130 / 143 when Ctrl-C / SIGTERM stopped it
    (what was kept printed), 2 when a result file could not be read, a run directory was
    refused or sbatch failed (named on stderr)."""
    from sparsecomm.lab.cluster.sbatch import SubmissionError
    from sparsecomm.lab.compare import stop_on_interrupt
    from sparsecomm.lab.experiment.files import RunDirectoryError
    from sparsecomm.lab.experiment.runner import ExperimentInterrupted
    from sparsecomm.lab.results import ResultFileError, warnings_to_stderr

    try:
        with warnings_to_stderr(prog):
            return work(), None
    except ExperimentInterrupted as error:
        return None, stop_on_interrupt(error)
    except (ResultFileError, FileNotFoundError, RunDirectoryError, SubmissionError) as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return None, 2


def fmt(value, unit: str = "") -> str:
    """A figure to 4 significant digits with its unit, or "n/a"."""
    return "n/a" if value is None else f"{value:.4g}{unit}"


def aligned(rows: list[list[str]]) -> list[str]:
    """Rows of cells as left-aligned columns, two spaces apart (the first row is the header)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def markdown_table(rows: list[list[str]]) -> list[str]:
    """The same rows as a Markdown table (the first row is the header)."""
    def line(row):
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |"

    return [line(rows[0]), "|" + "---|" * len(rows[0]), *map(line, rows[1:])]
