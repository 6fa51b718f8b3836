"""Scaling capture: the share of dense's gain from the smallest p to a larger p that an arm keeps.

Per seed s that finished at both world sizes in both arms (runs are paired by seed: same
initial weights and data order at every p), on the final metric (at dense's step count):

    capture_s(p) = (L_arm,s(p_min) - L_arm,s(p)) / (L_dense,s(p_min) - L_dense,s(p))

for a metric where lower is better (both gains flip sign where higher is better, which leaves
the ratio as it is). 1: the arm gains what dense gains; 0: nothing; < 0: it loses quality as
p grows. Over the paired seeds: the mean and its (1 - 2 alpha) confidence interval, a t
interval computed by the equivalence test of ``sparsecomm check``
(:func:`sparsecomm.lab.tolerance.equivalence`, at its default level: a 90% CI).

Undefined, said so and never a number, where dense gains nothing to share: its gain is <= 0
at some paired seed (the ratio has no meaning there), or its mean gain is within noise (the
same interval over the seeds' dense gains reaches 0).
"""
import math
from dataclasses import dataclass, field

from sparsecomm.lab.results.target import DENSE_ARM


@dataclass(frozen=True)
class Capture:
    arm: str
    low: int  # the smallest world size
    world_size: int
    seeds: tuple[int, ...]  # paired: finished at both world sizes, in the arm and in dense
    per_seed: dict = field(default_factory=dict)  # seed -> capture (only when defined)
    dense_gain: dict = field(default_factory=dict)  # seed -> dense's gain, > 0 better at world_size
    arm_gain: dict = field(default_factory=dict)  # seed -> the arm's gain
    mean: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    ci: str = ""  # the interval's name, "90% CI"
    undefined: str = ""  # why there is no capture ("" when there is one)

    @property
    def defined(self) -> bool:
        return not self.undefined

    def shown(self) -> str:
        """"0.42 [0.30, 0.55] (3 seeds)", or "undefined: <why>"."""
        if self.undefined:
            return f"undefined: {self.undefined}"
        interval = (f" [{self.ci_low:.2f}, {self.ci_high:.2f}]" if self.ci_low is not None
                    else " (no CI: " + ("1 seed" if len(self.seeds) < 2 else "zero spread") + ")")
        return f"{self.mean:.2f}{interval} ({len(self.seeds)} seed{'s' * (len(self.seeds) != 1)})"


def mean_interval(values: dict[int, float]):
    """Mean of per-seed values and its (1 - 2 alpha) t interval, as ``sparsecomm check``
    computes the interval of the paired differences: its own test, on the values paired with
    zeros (the interval of mean(value - 0)); the interval is None with fewer than 2 values or
    a zero spread. Returns the test's result (``mean_diff``, ``ci_low``, ``ci_high``, ``alpha``)."""
    from sparsecomm.lab.tolerance import equivalence

    return equivalence(dict.fromkeys(values, 0.0), values, delta=1.0)  # delta: no verdict is read


def capture(arm: str, low: int, p: int, metric: dict, mode: str = "min") -> Capture:
    """``arm``'s capture of dense's gain from world size ``low`` to ``p``; ``metric[(p, arm)]``
    is ``{seed: final metric}`` of the finished runs, ``mode`` "min" (lower is better) or "max"."""
    from sparsecomm.lab.tolerance.tost import ci_label

    tables = [metric.get((q, a), {}) for q in (low, p) for a in (DENSE_ARM, arm)]
    seeds = tuple(sorted(s for s in set.intersection(*(set(t) for t in tables))
                         if all(math.isfinite(t[s]) for t in tables)))
    d_low, a_low, d_p, a_p = tables
    sign = 1.0 if mode == "min" else -1.0
    dense_gain = {s: sign * (d_low[s] - d_p[s]) for s in seeds}
    arm_gain = {s: sign * (a_low[s] - a_p[s]) for s in seeds}
    result = dict(arm=arm, low=low, world_size=p, seeds=seeds, dense_gain=dense_gain, arm_gain=arm_gain)
    if not seeds:
        return Capture(**result, undefined=f"no seed finished (finite) at both p={low} and p={p} in both {arm} "
                                           f"and {DENSE_ARM}")
    nothing = [s for s in seeds if dense_gain[s] <= 0]
    if nothing:
        return Capture(**result, undefined=f"{DENSE_ARM} gains nothing from p={low} to p={p} at seed(s) "
                                           f"{', '.join(map(str, nothing))} (gain <= 0)")
    gain = mean_interval(dense_gain)
    if gain.ci_low is not None and gain.ci_low <= 0:
        return Capture(**result, undefined=f"{DENSE_ARM}'s gain from p={low} to p={p}, {gain.mean_diff:+.4g} "
                                           f"({ci_label(gain.alpha)} [{gain.ci_low:+.4g}, {gain.ci_high:+.4g}]), "
                                           "is within noise")
    per_seed = {s: arm_gain[s] / dense_gain[s] for s in seeds}
    kept = mean_interval(per_seed)
    return Capture(**result, per_seed=per_seed, mean=kept.mean_diff, ci_low=kept.ci_low, ci_high=kept.ci_high,
                   ci=ci_label(kept.alpha))


def captures(points, world_sizes: tuple[int, ...], arms, mode: str = "min") -> list[Capture]:
    """Every arm but dense at every world size but the smallest, from the points' per-seed metrics."""
    metric = {(q.world_size, q.arm): q.metric_by_seed for q in points}
    low = world_sizes[0]
    return [capture(arm, low, p, metric, mode) for arm in arms if arm != DENSE_ARM for p in world_sizes[1:]]
