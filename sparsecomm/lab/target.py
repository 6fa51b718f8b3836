"""The quality target a run must reach: declared in the config, or derived from dense.

Derived target = median final validation loss of the dense arm over seeds + the policy's
quality tolerance. Either way the report prints which it was.
"""
import statistics
from dataclasses import dataclass

from sparsecomm.lab.results import RunSummary

DENSE_ARM = "dense"


@dataclass(frozen=True)
class Target:
    val_loss: float
    how: str  # human-readable origin, printed in reports

    def describe(self) -> str:
        return f"target: val loss <= {self.val_loss:.4f} ({self.how})"


def resolve_target(experiment: dict, runs: list[RunSummary]) -> Target:
    """The declared ``target_loss`` of the config, else dense median final loss + tolerance."""
    declared = experiment["config"].get("target_loss")
    if declared is not None:
        return Target(float(declared), "declared in the config")
    tolerance = experiment["config"]["policy"]["quality_tolerance"]
    finals = [r.final_val_loss for r in runs if r.arm == DENSE_ARM and r.status == "ok" and r.evals]
    if not finals:
        raise ValueError(
            "cannot derive the target: no finished dense run in this directory; declare target_loss in the config"
        )
    median = statistics.median(finals)
    return Target(median + tolerance, f"derived: dense median final {median:.4f} over {len(finals)} seeds + tolerance {tolerance:g}")
