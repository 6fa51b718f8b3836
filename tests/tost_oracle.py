"""An independent TOST verdict for paired loss differences, straight from scipy's t-tests.

sparsecomm.lab.tolerance decides from the (1 - 2 alpha) confidence interval of the mean
difference; this oracle decides from the p-values of one-sided one-sample t-tests
(``scipy.stats.ttest_1samp``), the other, equivalent formulation of the same test:

* equivalent: both H0 "mean <= -delta" and H0 "mean >= +delta" are rejected at alpha;
* worse: H0 "mean <= +delta" is rejected (the mean difference is above +delta);
* better: H0 "mean >= -delta" is rejected (the mean difference is below -delta);
* inconclusive otherwise, and with fewer than 3 paired seeds (sparsecomm's documented minimum).

Zero-variance differences are not handled here (the t statistic is undefined and scipy
returns nan); tests work those out by hand against sparsecomm's documented rule.
"""
import numpy as np
from scipy import stats

MIN_SEEDS = 3  # documented in sparsecomm.lab.tolerance: fewer paired seeds are never judged


def scipy_tost_verdict(diffs, delta: float, alpha: float = 0.05) -> str:
    d = np.asarray(diffs, dtype=float)
    if d.size < MIN_SEEDS:
        return "inconclusive"
    if not np.ptp(d) > 1e-9 * max(1.0, float(np.max(np.abs(d)))):
        raise ValueError(f"(near) zero-variance differences {d}: work the verdict out by hand")

    def p(popmean: float, alternative: str) -> float:
        return float(stats.ttest_1samp(d, popmean, alternative=alternative).pvalue)

    if p(-delta, "greater") < alpha and p(delta, "less") < alpha:
        return "equivalent"
    if p(delta, "greater") < alpha:
        return "worse"
    if p(-delta, "less") < alpha:
        return "better"
    return "inconclusive"


def paired_diffs(dense: dict[int, float], arm: dict[int, float]) -> list[float]:
    """arm - dense over the seeds present in both, in seed order."""
    return [arm[s] - dense[s] for s in sorted(set(dense) & set(arm))]
