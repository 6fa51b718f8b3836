"""The equivalence of paired final losses: two one-sided tests (TOST) at level alpha on the
per-seed differences against +-delta, and the verdict they give (equivalent, worse, better
or inconclusive)."""
import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

MIN_SEEDS = 3

# Differences of floats that are "the same" up to rounding (e.g. arm = dense + 0.01 on every
# seed) have a sd of ~1e-16 x the loss, not exactly 0; a t-test on that is a division by
# rounding noise and would call anything "equivalent". Anything below this fraction of the
# data's scale counts as zero variance.
ZERO_SPREAD = 1e-12

ZERO_VARIANCE_REASON = "zero variance of the paired differences: the t-test is undefined"


@dataclass(frozen=True)
class Equivalence:
    """TOST of the paired final-loss differences (arm - dense) against +-delta."""

    verdict: str  # "equivalent", "worse", "better" or "inconclusive"
    reason: str
    n: int
    mean_diff: float | None
    sd_diff: float | None
    ci_low: float | None  # (1 - 2 alpha) confidence interval of mean_diff
    ci_high: float | None
    p_tost: float | None  # None when the test is undefined
    delta: float
    relative: bool
    seeds: tuple[int, ...]
    alpha: float = 0.05

    @property
    def no_loss(self) -> bool:
        return self.verdict in ("equivalent", "better")


def checked_delta(delta: float) -> float:
    """The tolerance as a float; ValueError unless a finite number > 0."""
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not math.isfinite(delta) or delta <= 0:
        raise ValueError(f"delta (--tolerance) must be a finite number > 0, got {delta!r}")
    return float(delta)


def checked_alpha(alpha: float) -> float:
    """The level of each one-sided test as a float; ValueError unless in (0, 0.5)."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 0.5:
        raise ValueError(f"alpha (--alpha) must be a number in (0, 0.5), got {alpha!r}")
    return float(alpha)


def format_difference(x: float | None, relative: bool) -> str:
    """A paired difference with its sign: "+0.008", or "+1.50%" when relative."""
    if x is None:
        return "n/a"
    return f"{x:+.2%}" if relative else f"{x:+.4g}"


def ci_label(alpha: float) -> str:
    """The confidence interval TOST at ``alpha`` amounts to: "90% CI" at 0.05."""
    return f"{1 - 2 * alpha:.0%} CI"


def equivalence(
    dense: dict[int, float], arm: dict[int, float], delta: float, *, relative: bool = False, alpha: float = 0.05,
    higher_is_better: bool = False,
) -> Equivalence:
    """Paired TOST of ``arm`` vs ``dense`` final losses over the seeds present in both.

    The difference is arm - dense (relative: over dense), so that > 0 is worse; with
    ``higher_is_better`` (a metric such as accuracy) it is dense - arm, for the same reading.
    """
    delta = checked_delta(delta)
    alpha = checked_alpha(alpha)
    seeds = tuple(sorted(set(dense) & set(arm)))
    n = len(seeds)

    def result(verdict, reason, mean=None, sd=None, lo=None, hi=None, p=None):
        return Equivalence(verdict, reason, n, mean, sd, lo, hi, p, delta, relative, seeds, alpha)

    a = np.array([arm[s] for s in seeds], dtype=float)
    b = np.array([dense[s] for s in seeds], dtype=float)
    bad = [s for s, x, y in zip(seeds, a, b) if not (math.isfinite(x) and math.isfinite(y))]
    if bad:
        # A diverged run (nan/inf loss) makes the mean meaningless; say so rather than guess.
        return result("inconclusive", f"non-finite final loss at seed(s) {bad}: the test is undefined")
    if relative:
        if np.any(b <= 0):
            raise ValueError("a relative tolerance needs positive dense losses; use an absolute tolerance")
        d = (b - a) / b if higher_is_better else (a - b) / b
        scale = float(np.max(np.abs(a / b))) if n else 1.0
    else:
        d = b - a if higher_is_better else a - b
        scale = float(max(np.max(np.abs(a)), np.max(np.abs(b)))) if n else 1.0

    mean = float(np.mean(d)) if n else None
    sd = float(np.std(d, ddof=1)) if n >= 2 else None
    zero_spread = sd is not None and sd <= ZERO_SPREAD * max(scale, 1e-300)

    lo = hi = p = None
    if sd is not None and not zero_spread:
        df = n - 1
        se = sd / math.sqrt(n)
        half = float(stats.t.ppf(1 - alpha, df)) * se
        lo, hi = mean - half, mean + half
        p_lower = float(stats.t.sf((mean + delta) / se, df))  # H0: mean <= -delta
        p_upper = float(stats.t.cdf((mean - delta) / se, df))  # H0: mean >= +delta
        p = max(p_lower, p_upper)

    if n < MIN_SEEDS:
        return result("inconclusive", f"n={n} paired seeds < {MIN_SEEDS}", mean, sd, lo, hi, p)
    if zero_spread:
        # Identical differences on every seed (often: nothing was actually compared) give no
        # estimate of the noise; never call that equivalent.
        return result("inconclusive", ZERO_VARIANCE_REASON, mean, sd)
    ci = f"{ci_label(alpha)} [{format_difference(lo, relative)}, {format_difference(hi, relative)}]"
    bound = f"{delta:.2%}" if relative else f"{delta:g}"
    if -delta < lo and hi < delta:
        return result("equivalent", f"{ci} inside +-{bound}", mean, sd, lo, hi, p)
    if lo > delta:
        return result("worse", f"{ci} entirely above +{bound}", mean, sd, lo, hi, p)
    if hi < -delta:
        return result("better", f"{ci} entirely below -{bound}", mean, sd, lo, hi, p)
    return result("inconclusive", f"{ci} crosses the tolerance bound +-{bound}", mean, sd, lo, hi, p)
