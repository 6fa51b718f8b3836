"""The quality target a run must reach: declared in the config, or derived from dense.

Derived target = median final validation loss of the dense arm over seeds + the policy's
quality tolerance (for a metric where higher is better, ``mode="max"``: minus the tolerance). Either way the report prints which it was.
"""
import statistics
from dataclasses import dataclass

from sparsecomm.lab.results.reading import RunSummary

DENSE_ARM = "dense"


@dataclass(frozen=True)
class Target:
    val_loss: float
    """The target value of the experiment's metric (named val_loss for the built-in tasks' metric)."""
    how: str  # human-readable origin, printed in reports
    metric: str = "val_loss"
    mode: str = "min"
    """"min": reached at or below the value (a loss); "max": at or above it (an accuracy)."""

    def reached(self, value: float) -> bool:
        return value <= self.val_loss if self.mode == "min" else value >= self.val_loss

    @property
    def metric_label(self) -> str:
        """How reports name the metric: "val loss" for the built-in one, else its own name."""
        return "val loss" if self.metric == "val_loss" else self.metric

    def describe(self) -> str:
        return f"target: {self.metric_label} {'<=' if self.mode == 'min' else '>='} {self.val_loss:.4f} ({self.how})"


def resolve_target(experiment: dict, runs: list[RunSummary]) -> Target:
    """The declared ``target_loss`` of the config, else dense median final loss + tolerance."""
    config = experiment["config"]
    metric, mode = config.get("metric", "val_loss"), config.get("mode", "min")
    declared = config.get("target_loss")
    if declared is not None:
        return Target(float(declared), "declared in the config", metric, mode)
    tolerance = experiment["config"]["policy"]["quality_tolerance"]
    finals = [r.final_val_loss for r in runs if r.arm == DENSE_ARM and r.status == "ok" and r.evals]
    if not finals:
        raise ValueError(
            "cannot derive the target: no finished dense run in this directory; declare target_loss in the config"
        )
    median = statistics.median(finals)
    sign = "+" if mode == "min" else "-"  # the tolerance's side of dense: toward worse
    return Target(median + tolerance if mode == "min" else median - tolerance,
                  f"derived: dense median final {median:.4f} over {len(finals)} seeds {sign} tolerance {tolerance:g}",
                  metric, mode)
