"""The three numbers a leader signs before a run, printed at the head of every report.

- ``quality_tolerance``: the largest increase in final validation loss that still counts
  as "no loss" (absolute, in loss units), judged by the equivalence test over seeds.
- ``staleness_limit``: the most steps an error-feedback residual entry may wait before it
  is sent; monitors flag runs that exceed it.
- ``redundancy_budget``: the fraction of run time the job may spend on checkpoints and
  recovery (redundancy against faults).
"""
import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True, kw_only=True)
class Policy:
    quality_tolerance: float = 0.05
    staleness_limit: int = 1000
    redundancy_budget: float = 0.05

    def __post_init__(self):
        if not (isinstance(self.quality_tolerance, (int, float)) and math.isfinite(self.quality_tolerance)
                and self.quality_tolerance > 0):
            raise ValueError(f"policy.quality_tolerance must be a finite number > 0, got {self.quality_tolerance!r}")
        if not isinstance(self.staleness_limit, int) or isinstance(self.staleness_limit, bool) or self.staleness_limit < 1:
            raise ValueError(f"policy.staleness_limit must be an integer >= 1 (steps), got {self.staleness_limit!r}")
        if not (isinstance(self.redundancy_budget, (int, float)) and 0 <= self.redundancy_budget <= 1):
            raise ValueError(f"policy.redundancy_budget must be a fraction in [0, 1], got {self.redundancy_budget!r}")

    def to_dict(self) -> dict:
        return asdict(self)


def format_policy(policy: dict) -> str:
    """One header line naming the signed policy numbers."""
    return (
        f"policy: quality tolerance {policy['quality_tolerance']:g} (val loss), "
        f"staleness limit {policy['staleness_limit']} steps, "
        f"redundancy budget {policy['redundancy_budget']:.0%} of run time"
    )
