"""The "no loss" checker: is each sparse arm's final validation loss equivalent to dense?

Runs are paired by seed (same init, same data order), so the test is on the per-seed
differences d_s = arm_s - dense_s (or (arm_s - dense_s) / dense_s with ``--relative``).
Equivalence within a declared tolerance delta is shown with two one-sided tests (TOST) at
level alpha: both H0 "mean(d) <= -delta" and H0 "mean(d) >= +delta" must be rejected, which
is the same as the (1 - 2 alpha) confidence interval of mean(d) lying inside (-delta, +delta).

Verdicts per arm: ``equivalent`` (CI inside the bounds), ``worse`` (CI entirely above
+delta), ``better`` (CI entirely below -delta: no loss either), else ``inconclusive``
(fewer than 3 paired seeds, zero variance of the differences, or the CI crosses a bound).
A run that did not finish (any status other than "ok": failed, interrupted, or a summary
excluded as invalid because it is not the run its directory names, see
:mod:`sparsecomm.lab.results`) is never dropped silently: it is counted per arm with its
status and listed with its error; its seed has no pair. With no finished dense run
there is nothing to compare against: ``check`` says so, lists the failures, and exits 2.

Exit codes of ``sparsecomm check``: 0 every arm equivalent or better, 1 some arm worse,
2 usage error or unreadable run directory, 3 none worse but some inconclusive.

Needs no torch: reports are made anywhere.

    sparsecomm check RUN_DIR [--tolerance D] [--relative] [--alpha A]
"""
import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy import stats

from sparsecomm.lab.policy import format_policy
from sparsecomm.lab.text import fold_lines
from sparsecomm.lab.results import (
    ResultFileError,
    RunSummary,
    arms_configured_first,
    describe_counts,
    load_experiment,
    load_runs,
    status_counts,
    warnings_to_stderr,
)
from sparsecomm.lab.target import DENSE_ARM, Target, resolve_target

MIN_SEEDS = 3

# Differences of floats that are "the same" up to rounding (e.g. arm = dense + 0.01 on every
# seed) have a sd of ~1e-16 x the loss, not exactly 0; a t-test on that is a division by
# rounding noise and would call anything "equivalent". Anything below this fraction of the
# data's scale counts as zero variance.
_ZERO_SPREAD = 1e-12

ZERO_VARIANCE_REASON = "zero variance of the paired differences: the t-test is undefined"


# ---------------------------------------------------------------------------------------------
# Equivalence of final losses (TOST)


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


def _check_delta(delta: float) -> float:
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not math.isfinite(delta) or delta <= 0:
        raise ValueError(f"delta (--tolerance) must be a finite number > 0, got {delta!r}")
    return float(delta)


def _check_alpha(alpha: float) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 0.5:
        raise ValueError(f"alpha (--alpha) must be a number in (0, 0.5), got {alpha!r}")
    return float(alpha)


def _diff(x: float | None, relative: bool) -> str:
    if x is None:
        return "n/a"
    return f"{x:+.2%}" if relative else f"{x:+.4g}"


def _ci_label(alpha: float) -> str:
    return f"{1 - 2 * alpha:.0%} CI"


def equivalence(
    dense: dict[int, float], arm: dict[int, float], delta: float, *, relative: bool = False, alpha: float = 0.05,
    higher_is_better: bool = False,
) -> Equivalence:
    """Paired TOST of ``arm`` vs ``dense`` final losses over the seeds present in both.

    The difference is arm - dense (relative: over dense), so that > 0 is worse; with
    ``higher_is_better`` (a metric such as accuracy) it is dense - arm, for the same reading.
    """
    delta = _check_delta(delta)
    alpha = _check_alpha(alpha)
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
    zero_spread = sd is not None and sd <= _ZERO_SPREAD * max(scale, 1e-300)

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
    ci = f"{_ci_label(alpha)} [{_diff(lo, relative)}, {_diff(hi, relative)}]"
    bound = f"{delta:.2%}" if relative else f"{delta:g}"
    if -delta < lo and hi < delta:
        return result("equivalent", f"{ci} inside +-{bound}", mean, sd, lo, hi, p)
    if lo > delta:
        return result("worse", f"{ci} entirely above +{bound}", mean, sd, lo, hi, p)
    if hi < -delta:
        return result("better", f"{ci} entirely below -{bound}", mean, sd, lo, hi, p)
    return result("inconclusive", f"{ci} crosses the tolerance bound +-{bound}", mean, sd, lo, hi, p)


# ---------------------------------------------------------------------------------------------
# Noise floor, cost ratios, steps-to-target test


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
    if sd <= _ZERO_SPREAD * max(1.0, float(np.max(np.abs(logs)))):
        return OneSidedTest(
            n, None, mean, "; ".join(["zero variance of the log step ratios: the t-test is undefined"] + notes)
        )
    p = float(stats.ttest_1samp(logs, 0.0, alternative="greater").pvalue)
    return OneSidedTest(n, p, mean, "; ".join(["paired one-sided t-test on log(arm/dense steps)"] + notes))


# ---------------------------------------------------------------------------------------------
# The whole run directory


@dataclass(frozen=True)
class ArmResult:
    arm: str
    equivalence: Equivalence
    failed: int  # runs with status != "ok": counted, not compared
    missing: int  # configured seeds with no summary, or a finished run with no evaluation
    steps_ratio: RatioSpread
    time_ratio: RatioSpread
    steps_test: OneSidedTest
    not_ok: tuple[tuple[str, int], ...] = ()  # (status, count) of the runs counted in failed


@dataclass(frozen=True)
class CheckReport:
    policy: dict
    target: Target
    tolerance: float
    relative: bool
    alpha: float
    noise_floor: NoiseFloor
    dense_failed: int
    dense_missing: int
    arms: tuple[ArmResult, ...]
    max_steps: int
    run_dir: str = ""
    dense_not_ok: tuple[tuple[str, int], ...] = ()
    not_compared: tuple[str, ...] = ()  # "arm seed s: status: error", one per run that did not finish

    @property
    def exit_code(self) -> int:
        verdicts = {a.equivalence.verdict for a in self.arms}
        if "worse" in verdicts:
            return 1
        if "inconclusive" in verdicts:
            return 3
        return 0


def _arm_data(runs: list[RunSummary], arm: str, seeds: list[int], target: Target):
    mine = [r for r in runs if r.arm == arm]
    ok = [r for r in mine if r.finished]
    failed = sum(r.status != "ok" for r in mine)
    have = {r.seed for r in mine}
    missing = sum(s not in have for s in seeds) + sum(r.status == "ok" and not r.evals for r in mine)
    finals = {r.seed: r.final_val_loss for r in ok}
    hits = {r.seed: r.first_reaching(target.val_loss, target.mode) for r in ok}
    steps = {s: (e.step if e else None) for s, e in hits.items()}
    times = {s: (e.elapsed_seconds if e else None) for s, e in hits.items()}
    return finals, steps, times, failed, missing, tuple(status_counts(r for r in mine if r.status != "ok").items())


def check(
    run_dir: str | Path, *, tolerance: float | None = None, relative: bool = False, alpha: float = 0.05
) -> CheckReport:
    """Judge every non-dense arm of a ``sparsecomm compare`` run directory against dense."""
    alpha = _check_alpha(alpha)
    if tolerance is not None:
        _check_delta(tolerance)
    experiment = load_experiment(run_dir)
    config = experiment["config"]
    policy = config["policy"]
    if tolerance is None:
        if relative:
            # The policy's number is in loss units; reading 0.05 as "5%" would be a silent unit change.
            raise ValueError(
                "--relative needs an explicit --tolerance (a fraction): the policy's quality_tolerance "
                f"({policy['quality_tolerance']:g}) is absolute, in val-loss units"
            )
        tolerance = _check_delta(policy["quality_tolerance"])
    runs = load_runs(run_dir)

    arm_names = arms_configured_first(config.get("arms") or [], runs)
    if DENSE_ARM not in arm_names or not any(r.arm == DENSE_ARM for r in runs):
        raise ValueError(f"{run_dir}: no {DENSE_ARM!r} runs to compare against (arms: {arm_names or 'none'})")
    others = [a for a in arm_names if a != DENSE_ARM]
    if not others:
        raise ValueError(f"{run_dir}: only {DENSE_ARM!r} runs; there is no other arm to check")

    not_compared = tuple(f"{r.arm} seed {r.seed}: {' '.join(r.describe_problem().split())[:300]}"
                         for r in runs if not r.finished)
    if not any(r.arm == DENSE_ARM and r.finished for r in runs):
        counts = describe_counts(status_counts(r for r in runs if r.arm == DENSE_ARM))
        raise NoFinishedDense(f"{run_dir}: verdicts not available: no dense run finished ({counts})", not_compared)
    target = resolve_target(experiment, runs)
    seeds = list(config.get("seeds") or [])
    max_steps = int(config["steps"])
    d_final, d_steps, d_times, d_failed, d_missing, d_not_ok = _arm_data(runs, DENSE_ARM, seeds, target)
    results = []
    for arm in others:
        finals, steps, times, failed, missing, not_ok = _arm_data(runs, arm, seeds, target)
        results.append(ArmResult(
            arm=arm,
            equivalence=equivalence(d_final, finals, tolerance, relative=relative, alpha=alpha,
                                    higher_is_better=target.mode == "max"),
            failed=failed,
            missing=missing,
            steps_ratio=ratio_spread(d_steps, steps),
            time_ratio=ratio_spread(d_times, times),
            steps_test=steps_to_target_test(d_steps, steps, max_steps=max_steps),
            not_ok=not_ok,
        ))
    return CheckReport(
        policy=policy, target=target, tolerance=float(tolerance), relative=relative, alpha=alpha,
        noise_floor=noise_floor(d_final), dense_failed=d_failed, dense_missing=d_missing,
        arms=tuple(results), max_steps=max_steps, run_dir=str(run_dir), dense_not_ok=d_not_ok,
        not_compared=not_compared,
    )


class NoFinishedDense(ValueError):
    """No dense run finished: nothing to compare against. ``not_compared``: the runs that did not finish."""

    def __init__(self, message: str, not_compared: tuple[str, ...] = ()):
        super().__init__(message)
        self.not_compared = not_compared


def _failed_text(failed: int, not_ok) -> str:
    """"2" or "2 (1 failed, 1 interrupted)" when a status other than plain "failed" is among them."""
    if any(status != "failed" for status, _ in not_ok):
        return f"{failed} ({describe_counts(dict(not_ok))})"
    return str(failed)


# ---------------------------------------------------------------------------------------------
# Report


def _num(x: float | None, fmt: str = ".4g") -> str:
    return "n/a" if x is None else format(x, fmt)


def _ratio_line(label: str, r: RatioSpread) -> str:
    if r.geo_mean is None:
        spread = "n/a (no seed reached it on both sides)"
    else:
        spread = f"geo-mean {r.geo_mean:.2f}x (min-max {r.min:.2f}-{r.max:.2f}x)"
    return (
        f"  {label} arm/dense: {spread}; not reached: "
        f"arm {r.num_not_reached_arm}/{r.n}, dense {r.num_not_reached_dense}/{r.n}"
    )


EXIT_MEANING = {
    0: "every arm equivalent or better",
    1: "some arm worse than dense beyond the tolerance",
    3: "no arm worse, but some inconclusive",
}


def format_report(report: CheckReport) -> str:
    """The verdicts first, one line per arm, and the overall result; then what they rest on
    (policy, target, tolerance, noise floor), each arm's detail and the runs not compared.
    Every line fits in 100 columns."""
    lines = [*_verdict_lines(report), "", *_context_lines(report)]
    for a in report.arms:
        lines += ["", *_arm_detail(a, report.target.metric_label)]
    if report.not_compared:
        lines += ["", f"runs not compared, counted as failed ({len(report.not_compared)}):"]
        lines += [f"  {line}" for line in report.not_compared]
    return "\n".join(fold_lines(lines))


def _bound(delta: float, relative: bool) -> str:
    return f"{delta:.2%}" if relative else f"{delta:g}"


def _verdict_lines(report: CheckReport) -> list[str]:
    """The heading, one line per arm, and the overall result with the exit code."""
    heading = (f"verdicts vs dense (final {report.target.metric_label}, {_difference_label(report)}: mean "
               f"[{_ci_label(report.alpha)}]; steps to target, arm/dense):")
    width = max(len(a.arm) for a in report.arms)
    lines = [heading]
    lines += [f"  {a.arm:<{width}}  {a.equivalence.verdict.upper():<12}  {_difference(a.equivalence)}; "
              f"{_steps_summary(a.steps_ratio)}" for a in report.arms]
    code = report.exit_code
    return lines + [f"overall: {EXIT_MEANING[code]} (sparsecomm check exits {code})"]


def _difference_label(report: CheckReport) -> str:
    """How the paired difference is taken: always so that > 0 means the arm is worse."""
    difference = "dense - arm" if report.target.mode == "max" else "arm - dense"
    return f"({difference}) / dense" if report.relative else difference


def _difference(e: Equivalence) -> str:
    """"+0.008 [+0.0065, +0.0095] inside +-0.05" (mean [CI]), with the reason when the interval
    alone does not explain an inconclusive verdict (too few seeds, no variance, ...)."""
    mean = _diff(e.mean_diff, e.relative)
    # The reason's first clause is its gist ("zero variance of the paired differences").
    why = e.reason.split(":")[0]
    if e.ci_low is None:
        return f"{mean}, no CI ({why})"
    side = _ci_side(e)
    text = (f"{mean} [{_diff(e.ci_low, e.relative)}, {_diff(e.ci_high, e.relative)}] "
            f"{side} {_BOUND_SIGN[side]}{_bound(e.delta, e.relative)}")
    return text + (f" ({why})" if e.verdict == "inconclusive" and side != "crosses" else "")


_BOUND_SIGN = {"inside": "+-", "above": "+", "below": "-", "crosses": "+-"}


def _ci_side(e: Equivalence) -> str:
    """Where the confidence interval lies against the tolerance bounds +-delta."""
    if -e.delta < e.ci_low and e.ci_high < e.delta:
        return "inside"
    if e.ci_low > e.delta:
        return "above"
    if e.ci_high < -e.delta:
        return "below"
    return "crosses"


def _steps_summary(r: RatioSpread) -> str:
    """"steps 1.05x", with the seeds that did not reach the target on either side."""
    if not r.n:
        return "steps n/a (no paired seed)"
    ratio = "n/a" if r.geo_mean is None else f"{r.geo_mean:.2f}x"
    missed = [f"{side} {count}/{r.n}" for side, count in (("arm", r.num_not_reached_arm),
                                                          ("dense", r.num_not_reached_dense)) if count]
    return f"steps {ratio}" + (f" (not reached: {', '.join(missed)})" if missed else "")


def _context_lines(report: CheckReport) -> list[str]:
    """Policy, target, tolerance and test, the dense noise floor, and dense's unpaired seeds."""
    nf = report.noise_floor
    if report.relative:
        tol = f"tolerance: {report.tolerance:.2%} of the dense final loss (relative)"
    else:
        tol = f"tolerance: {report.tolerance:g} in {report.target.metric_label} (absolute)"
    lines = [
        format_policy(report.policy),
        report.target.describe(),
        f"{tol}; TOST at alpha {report.alpha:g} ({_ci_label(report.alpha)}), paired by seed",
        f"dense seed spread (noise floor): sd {_num(nf.sd)}, range {_num(nf.range)} over {nf.n} seeds"
        f" (mean {_num(nf.mean)})",
    ]
    if report.dense_failed or report.dense_missing:
        lines.append(
            f"dense: {_failed_text(report.dense_failed, report.dense_not_ok)} failed run(s), "
            f"{report.dense_missing} missing: their seeds have no pair"
        )
    return lines


def _arm_detail(a: ArmResult, metric: str) -> list[str]:
    e = a.equivalence
    return [
        f"{a.arm}: {e.verdict.upper()} ({e.reason})",
        f"  final {metric} difference: mean {_diff(e.mean_diff, e.relative)}, sd {_num(e.sd_diff)}, "
        f"p_TOST {_num(e.p_tost, '.3g')}",
        f"  n={e.n} paired seeds; failed runs {_failed_text(a.failed, a.not_ok)}, missing {a.missing}",
        _ratio_line("steps-to-target", a.steps_ratio),
        _ratio_line("time-to-target ", a.time_ratio),
        f"  more steps than dense? one-sided p {_num(a.steps_test.p_value, '.3g')} ({a.steps_test.reason})",
    ]


# ---------------------------------------------------------------------------------------------
# CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sparsecomm check",
        description="Is each arm's final validation loss equivalent to dense's (paired TOST over seeds)?",
        epilog="exit codes: 0 all equivalent or better, 1 some arm worse, 2 usage error, 3 inconclusive",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by `sparsecomm compare`")
    p.add_argument("--tolerance", type=float, default=None,
                   help="equivalence bound delta (default: the policy's quality_tolerance); "
                        "a fraction with --relative")
    p.add_argument("--relative", action="store_true",
                   help="compare (arm - dense) / dense instead of arm - dense")
    p.add_argument("--alpha", type=float, default=0.05, help="level of each one-sided test (default 0.05)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.tolerance is not None and not (math.isfinite(args.tolerance) and args.tolerance > 0):
        parser.error(f"--tolerance must be a finite number > 0, got {args.tolerance}")
    if not (0 < args.alpha < 0.5):
        parser.error(f"--alpha must be in (0, 0.5), got {args.alpha}")
    if not Path(args.run_dir).is_dir():
        print(f"sparsecomm check: error: {args.run_dir} is not a directory", file=sys.stderr)
        return 2
    try:
        with warnings_to_stderr("sparsecomm check"):
            report = check(args.run_dir, tolerance=args.tolerance, relative=args.relative, alpha=args.alpha)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        # OSError covers a missing experiment.json; ResultFileError (a ValueError) names the bad file.
        detail = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc)
        prefix = "" if isinstance(exc, (ResultFileError, NoFinishedDense)) else f"{args.run_dir}: "
        print(f"sparsecomm check: error: {prefix}{detail}", file=sys.stderr)
        for line in getattr(exc, "not_compared", ()):
            print(f"  {line}", file=sys.stderr)
        return 2
    print(format_report(report))
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
