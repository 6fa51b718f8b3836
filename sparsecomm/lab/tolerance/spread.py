"""What the verdicts rest on besides the equivalence test: the dense arm's run-to-run noise,
the spread of the arm/dense ratios of steps and time to target over seeds, and a one-sided
test of whether an arm needs more steps than dense."""
import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

from sparsecomm.lab.tolerance.tost import ZERO_SPREAD


@dataclass(frozen=True)
class NoiseFloor:
    """Spread of the dense arm's final loss over seeds: the run-to-run noise."""

    n: int
    mean: float | None
    sd: float | None  # ddof=1; None when n < 2
    min: float | None
    max: float | None
    range: float | None


def noise_floor(dense: dict[int, float]) -> NoiseFloor:
    values = np.array(list(dense.values()), dtype=float)
    n = len(values)
    if n == 0:
        return NoiseFloor(0, None, None, None, None, None)
    lo, hi = float(values.min()), float(values.max())
    sd = float(np.std(values, ddof=1)) if n >= 2 else None
    return NoiseFloor(n, float(values.mean()), sd, lo, hi, hi - lo)


@dataclass(frozen=True)
class RatioSpread:
    """Per-seed arm/dense ratios of a cost (steps or seconds to the target)."""

    ratios: dict[int, float | None]  # per paired seed; None if either side did not reach the target
    geo_mean: float | None  # over the defined ratios
    min: float | None
    max: float | None
    num_not_reached_arm: int
    num_not_reached_dense: int
    n: int  # paired seeds


def ratio_spread(dense: dict[int, float | None], arm: dict[int, float | None]) -> RatioSpread:
    """Arm/dense cost ratios over seeds present in both; None means "target not reached"."""
    seeds = sorted(set(dense) & set(arm))
    ratios: dict[int, float | None] = {}
    for s in seeds:
        a, b = arm[s], dense[s]
        for side, v in (("arm", a), ("dense", b)):
            if v is not None and not v > 0:
                raise ValueError(f"cost to target must be > 0 (or None: not reached), got {v!r} for {side} seed {s}")
        ratios[s] = None if a is None or b is None else a / b
    defined = [r for r in ratios.values() if r is not None]
    return RatioSpread(
        ratios=ratios,
        geo_mean=float(np.exp(np.mean(np.log(defined)))) if defined else None,
        min=min(defined) if defined else None,
        max=max(defined) if defined else None,
        num_not_reached_arm=sum(arm[s] is None for s in seeds),
        num_not_reached_dense=sum(dense[s] is None for s in seeds),
        n=len(seeds),
    )


@dataclass(frozen=True)
class OneSidedTest:
    """Paired one-sided t-test: does the arm need more steps than dense to reach the target?"""

    n: int
    p_value: float | None  # None when undefined
    mean_log_ratio: float | None
    reason: str


def steps_to_target_test(
    dense: dict[int, int | None], arm: dict[int, int | None], *, max_steps: int
) -> OneSidedTest:
    """One-sided paired t-test on log(arm/dense steps), H1: arm needs more steps (MLPerf-style).

    A run that never reached the target (None) counts as ``max_steps + 1`` steps: a lower
    bound on its true cost, so its ratio is a bound too.
    """
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
        raise ValueError(f"max_steps must be an integer >= 1, got {max_steps!r}")
    seeds = sorted(set(dense) & set(arm))
    n = len(seeds)
    censored = max_steps + 1
    cens_arm = sum(arm[s] is None for s in seeds)
    cens_dense = sum(dense[s] is None for s in seeds)
    logs = np.array([math.log((arm[s] or censored) / (dense[s] or censored)) for s in seeds], dtype=float)
    notes = []
    if cens_arm or cens_dense:
        notes.append(
            f"{cens_arm} arm / {cens_dense} dense run(s) did not reach the target within {max_steps} steps, "
            f"counted as {censored} (a lower bound)"
        )
    mean = float(logs.mean()) if n else None
    if n < 2:
        return OneSidedTest(n, None, mean, "; ".join([f"n={n} paired seeds < 2: the test is undefined"] + notes))
    sd = float(np.std(logs, ddof=1))
    # Steps are counted at the eval cadence, so equal ratios on every seed are common.
    if sd <= ZERO_SPREAD * max(1.0, float(np.max(np.abs(logs)))):
        return OneSidedTest(
            n, None, mean, "; ".join(["zero variance of the log step ratios: the t-test is undefined"] + notes)
        )
    p = float(stats.ttest_1samp(logs, 0.0, alternative="greater").pvalue)
    return OneSidedTest(n, p, mean, "; ".join(["paired one-sided t-test on log(arm/dense steps)"] + notes))
