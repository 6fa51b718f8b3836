"""The verdicts of a run directory: every non-dense arm judged against dense over its seeds,
paired by seed, with the runs that did not finish counted and listed, never dropped."""
from dataclasses import dataclass
from pathlib import Path

from sparsecomm.lab.results import (
    RunSummary,
    arms_configured_first,
    describe_counts,
    load_experiment,
    load_runs,
    status_counts,
)
from sparsecomm.lab.results.target import DENSE_ARM, Target, resolve_target
from sparsecomm.lab.tolerance.spread import (
    NoiseFloor,
    OneSidedTest,
    RatioSpread,
    noise_floor,
    ratio_spread,
    steps_to_target_test,
)
from sparsecomm.lab.tolerance.tost import Equivalence, checked_alpha, checked_delta, equivalence


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
    baseline: str = DENSE_ARM  # the arm every other is judged against (dense unless --baseline)

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
    run_dir: str | Path, *, tolerance: float | None = None, relative: bool = False, alpha: float = 0.05,
    baseline: str = DENSE_ARM,
) -> CheckReport:
    """Judge every other arm of a ``sparsecomm compare`` run directory against ``baseline``
    (dense unless given: e.g. a dense arm under another optimizer). The target of the
    steps-to-target figures is dense's, whatever the baseline."""
    alpha = checked_alpha(alpha)
    if tolerance is not None:
        checked_delta(tolerance)
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
        tolerance = checked_delta(policy["quality_tolerance"])
    runs = load_runs(run_dir)

    arm_names = arms_configured_first(config.get("arms") or [], runs)
    if baseline not in arm_names or not any(r.arm == baseline for r in runs):
        raise ValueError(f"{run_dir}: no {baseline!r} runs to compare against (arms: {arm_names or 'none'})")
    others = [a for a in arm_names if a != baseline]
    if not others:
        raise ValueError(f"{run_dir}: only {baseline!r} runs; there is no other arm to check")

    not_compared = tuple(f"{r.arm} seed {r.seed}: {' '.join(r.describe_problem().split())[:300]}"
                         for r in runs if not r.finished)
    if not any(r.arm == baseline and r.finished for r in runs):
        counts = describe_counts(status_counts(r for r in runs if r.arm == baseline))
        raise NoFinishedDense(f"{run_dir}: verdicts not available: no {baseline} run finished ({counts})",
                              not_compared)
    target = resolve_target(experiment, runs)
    seeds = list(config.get("seeds") or [])
    max_steps = int(config["steps"])
    d_final, d_steps, d_times, d_failed, d_missing, d_not_ok = _arm_data(runs, baseline, seeds, target)
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
        not_compared=not_compared, baseline=baseline,
    )


class NoFinishedDense(ValueError):
    """No dense run finished: nothing to compare against. ``not_compared``: the runs that did not finish."""

    def __init__(self, message: str, not_compared: tuple[str, ...] = ()):
        super().__init__(message)
        self.not_compared = not_compared
