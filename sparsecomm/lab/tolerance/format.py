"""The verdicts as text for a person: one line per arm and the overall result first, then what
they rest on (policy, target, tolerance, noise floor), each arm's detail and the runs not
compared; every line within 100 columns."""
from sparsecomm.lab.results import describe_counts
from sparsecomm.lab.results.policy import format_policy
from sparsecomm.lab.results.text import fold_lines
from sparsecomm.lab.tolerance.spread import RatioSpread
from sparsecomm.lab.tolerance.tost import Equivalence, ci_label, format_difference
from sparsecomm.lab.tolerance.verdicts import ArmResult, CheckReport


def _failed_text(failed: int, not_ok) -> str:
    """"2" or "2 (1 failed, 1 interrupted)" when a status other than plain "failed" is among them."""
    if any(status != "failed" for status, _ in not_ok):
        return f"{failed} ({describe_counts(dict(not_ok))})"
    return str(failed)


def _num(x: float | None, fmt: str = ".4g") -> str:
    return "n/a" if x is None else format(x, fmt)


def _ratio_line(label: str, r: RatioSpread, baseline: str) -> str:
    if r.geo_mean is None:
        spread = "n/a (no seed reached it on both sides)"
    else:
        spread = f"geo-mean {r.geo_mean:.2f}x (min-max {r.min:.2f}-{r.max:.2f}x)"
    return (
        f"  {label} arm/{baseline}: {spread}; not reached: "
        f"arm {r.num_not_reached_arm}/{r.n}, {baseline} {r.num_not_reached_dense}/{r.n}"
    )


EXIT_MEANING = {
    0: "every arm equivalent or better",
    1: "some arm worse than the baseline beyond the tolerance",
    3: "no arm worse, but some inconclusive",
}


def format_report(report: CheckReport) -> str:
    """The verdicts first, one line per arm, and the overall result; then what they rest on
    (policy, target, tolerance, noise floor), each arm's detail and the runs not compared.
    Every line fits in 100 columns."""
    lines = [*_verdict_lines(report), "", *_context_lines(report)]
    for a in report.arms:
        lines += ["", *_arm_detail(a, report.target.metric_label, report.baseline)]
    if report.not_compared:
        lines += ["", f"runs not compared, counted as failed ({len(report.not_compared)}):"]
        lines += [f"  {line}" for line in report.not_compared]
    return "\n".join(fold_lines(lines))


def _bound(delta: float, relative: bool) -> str:
    return f"{delta:.2%}" if relative else f"{delta:g}"


def _verdict_lines(report: CheckReport) -> list[str]:
    """The heading, one line per arm, and the overall result with the exit code."""
    heading = (f"verdicts vs {report.baseline} (final {report.target.metric_label}, {_difference_label(report)}: "
               f"mean [{ci_label(report.alpha)}]; steps to target, arm/{report.baseline}):")
    width = max(len(a.arm) for a in report.arms)
    lines = [heading]
    lines += [f"  {a.arm:<{width}}  {a.equivalence.verdict.upper():<12}  {_difference(a.equivalence)}; "
              f"{_steps_summary(a.steps_ratio, report.baseline)}" for a in report.arms]
    code = report.exit_code
    return lines + [f"overall: {EXIT_MEANING[code]} (sparsecomm check exits {code})"]


def _difference_label(report: CheckReport) -> str:
    """How the paired difference is taken: always so that > 0 means the arm is worse."""
    base = report.baseline
    difference = f"{base} - arm" if report.target.mode == "max" else f"arm - {base}"
    return f"({difference}) / {base}" if report.relative else difference


def _difference(e: Equivalence) -> str:
    """"+0.008 [+0.0065, +0.0095] inside +-0.05" (mean [CI]), with the reason when the interval
    alone does not explain an inconclusive verdict (too few seeds, no variance, ...)."""
    mean = format_difference(e.mean_diff, e.relative)
    # The reason's first clause is its gist ("zero variance of the paired differences").
    why = e.reason.split(":")[0]
    if e.ci_low is None:
        return f"{mean}, no CI ({why})"
    side = _ci_side(e)
    text = (f"{mean} [{format_difference(e.ci_low, e.relative)}, {format_difference(e.ci_high, e.relative)}] "
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


def _steps_summary(r: RatioSpread, baseline: str) -> str:
    """"steps 1.05x", with the seeds that did not reach the target on either side."""
    if not r.n:
        return "steps n/a (no paired seed)"
    ratio = "n/a" if r.geo_mean is None else f"{r.geo_mean:.2f}x"
    missed = [f"{side} {count}/{r.n}" for side, count in (("arm", r.num_not_reached_arm),
                                                          (baseline, r.num_not_reached_dense)) if count]
    return f"steps {ratio}" + (f" (not reached: {', '.join(missed)})" if missed else "")


def _context_lines(report: CheckReport) -> list[str]:
    """Policy, target, tolerance and test, the dense noise floor, and dense's unpaired seeds."""
    nf = report.noise_floor
    if report.relative:
        tol = f"tolerance: {report.tolerance:.2%} of the {report.baseline} final loss (relative)"
    else:
        tol = f"tolerance: {report.tolerance:g} in {report.target.metric_label} (absolute)"
    lines = [
        format_policy(report.policy),
        report.target.describe(),
        f"{tol}; TOST at alpha {report.alpha:g} ({ci_label(report.alpha)}), paired by seed",
        f"{report.baseline} seed spread (noise floor): sd {_num(nf.sd)}, range {_num(nf.range)} over {nf.n} seeds"
        f" (mean {_num(nf.mean)})",
    ]
    if report.dense_failed or report.dense_missing:
        lines.append(
            f"{report.baseline}: {_failed_text(report.dense_failed, report.dense_not_ok)} failed run(s), "
            f"{report.dense_missing} missing: their seeds have no pair"
        )
    return lines


def _arm_detail(a: ArmResult, metric: str, baseline: str) -> list[str]:
    e = a.equivalence
    return [
        f"{a.arm}: {e.verdict.upper()} ({e.reason})",
        f"  final {metric} difference: mean {format_difference(e.mean_diff, e.relative)}, sd {_num(e.sd_diff)}, "
        f"p_TOST {_num(e.p_tost, '.3g')}",
        f"  n={e.n} paired seeds; failed runs {_failed_text(a.failed, a.not_ok)}, missing {a.missing}",
        _ratio_line("steps-to-target", a.steps_ratio, baseline),
        _ratio_line("time-to-target ", a.time_ratio, baseline),
        f"  more steps than {baseline}? one-sided p {_num(a.steps_test.p_value, '.3g')} ({a.steps_test.reason})",
    ]
