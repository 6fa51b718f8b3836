"""What a scaling study's runs recorded: per world size and arm, the verdict against dense at
that size, the final metric, the bytes a rank sent and received per step (and where the
received figure comes from), and steps and time to target.

"Final" is at dense's step count (the experiment's ``steps``): with a step budget the other
arms train longer, and are judged where dense stopped; their steps- and time-to-target use
the whole run."""
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from sparsecomm.lab.ledger.items import exposed_fraction
from sparsecomm.lab.results.target import DENSE_ARM
from sparsecomm.lab.scaling.study import Study
from sparsecomm.lab.sweep import UNAVAILABLE, run_point

BASELINE = "baseline"  # dense's verdict cell: the arm the others are judged against

RECEIVED_HOOK = "the top-k hook's counters (last completed step)"

RECEIVED_AVERAGER = "the averager's counters (total / steps: its syncs amortised)"

RECEIVED_RING = "derived: torch's hook counts none; ring allreduce of the bytes sent, 2(p-1)/p x sent"

RECEIVED_NOTHING = "nothing sent"


@dataclass(frozen=True)
class ScalePoint:
    world_size: int
    arm: str
    batch_size: int  # per rank
    verdict: str  # against dense at this world size; "baseline" for dense; "unavailable": no dense finished
    metric_gap: float | None  # mean paired difference to dense, > 0 worse (the verdict's mean_diff)
    final_metric_mean: float | None  # mean over the arm's finished seeds, at dense's step count
    seeds_finished: int
    bytes_sent_per_step: float | None  # per rank, median over seeds
    bytes_received_per_step: float | None  # per rank, median over seeds
    received_source: str
    steps_to_target: float | None  # median over seeds; None if not reached in some seed
    time_to_target_s: float | None
    run_dir: str
    failed: int = 0  # this arm's runs that did not finish (any status but "ok", or missing)
    dense_failed: int = 0
    not_ok: str = ""
    exposed_comm_fraction: float | None = None  # median wait for communication after backward / median step
    steps: int | None = None  # the arm's steps per run (dense's x the step budget for the other arms)
    metric_by_seed: dict = field(default_factory=dict)  # seed -> final metric (at dense's step count), finished runs
    budget_metric_mean: float | None = None  # with a step budget: mean of the metric at the arm's own last step


def median_known(values) -> float | None:
    """The median of the values that are known (not None); None when none is."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def received_per_step(run, world_size: int) -> tuple[float | None, str]:
    """Bytes rank 0 of ``run`` took in per step, and where the figure comes from."""
    from sparsecomm.comm.link_model import ring_allreduce_bytes

    stats = run.extra.get("hook_stats")
    reducer = (run.extra.get("arm_spec") or {}).get("reducer")
    if isinstance(stats, dict):
        last = stats.get("last_step")
        if isinstance(last, dict) and last.get("bytes_received") is not None:
            return float(last["bytes_received"]), RECEIVED_HOOK
        if stats.get("steps") and stats.get("bytes_received") is not None:
            return stats["bytes_received"] / stats["steps"], RECEIVED_AVERAGER
    if reducer == "local":
        return 0.0, RECEIVED_NOTHING
    if reducer in (None, "allreduce", "fp16", "bf16", "powersgd") and run.bytes_sent_per_step is not None:
        return float(ring_allreduce_bytes(run.bytes_sent_per_step, world_size)), RECEIVED_RING
    return None, "not recorded"


def metric_at_step(run, step: int) -> float | None:
    """The run's metric at ``step``: its evaluation there, or its last one where the run ended
    before (a diverged run's non-finite value); None where it went past ``step`` without one."""
    before = [e for e in run.evals if e.step <= step]
    if before and (before[-1].step == step or before[-1] is run.evals[-1]):
        return before[-1].val_loss
    return None


def judged_at_dense_steps(report, dense: dict, arm: dict):
    """The verdict of ``sparsecomm check`` (its test, tolerance and level, from ``report``) on
    the metric at dense's step count, ``{seed: value}`` of dense and of the arm; the same as
    the check's own where every arm trains as long as dense."""
    from sparsecomm.lab.tolerance import equivalence

    return equivalence(dense, arm, report.tolerance, relative=report.relative, alpha=report.alpha,
                       higher_is_better=report.target.mode == "max")


def points_at(outcome, study: Study, p: int) -> list[ScalePoint]:
    """One point per arm of the experiment at world size ``p``."""
    config = study.point_config(p)
    at_dense_steps = {arm: {r.seed: value for r in outcome.runs if r.arm == arm and r.finished
                            if (value := metric_at_step(r, config.steps)) is not None} for arm in config.arms}
    points = []
    for arm in config.arms:
        finished = [r for r in outcome.runs if r.arm == arm and r.finished]
        received = [received_per_step(r, p) for r in finished]
        entry = outcome.ledger.arm(arm) if outcome.available else None
        if not outcome.available:
            verdict, gap = UNAVAILABLE, None
        elif arm == DENSE_ARM:
            verdict, gap = BASELINE, None
        else:
            judged = judged_at_dense_steps(outcome.report, at_dense_steps[DENSE_ARM], at_dense_steps[arm])
            verdict, gap = judged.verdict, judged.mean_diff
        finals = list(at_dense_steps[arm].values())
        budget = config.steps_of(arm) != config.steps
        points.append(ScalePoint(
            world_size=p,
            arm=arm,
            batch_size=config.batch_size,
            verdict=verdict,
            metric_gap=gap,
            final_metric_mean=statistics.fmean(finals) if finals else None,
            seeds_finished=len(finished),
            bytes_sent_per_step=(entry.bytes_per_step.value if entry is not None
                                 else median_known(r.bytes_sent_per_step for r in finished)),
            bytes_received_per_step=median_known(value for value, _ in received),
            received_source="; ".join(dict.fromkeys(source for _, source in received)),
            steps_to_target=entry.steps_to_target.value if entry is not None else None,
            time_to_target_s=entry.time_to_target.value if entry is not None else None,
            exposed_comm_fraction=exposed_fraction(entry) if entry is not None else None,
            run_dir=str(outcome.run_dir),
            steps=config.steps_of(arm),
            metric_by_seed=at_dense_steps[arm],
            budget_metric_mean=(statistics.fmean(r.final_val_loss for r in finished) if budget and finished
                                else None),
            **outcome.failures(arm),
        ))
    return points


def run_study(study: Study, out_root: Path) -> list[ScalePoint]:
    """One paired experiment per world size, smallest first; a point per (p, arm)."""
    points = []
    for p in study.world_sizes:
        config = study.point_config(p)
        print(f"scale: world size {p}: {len(config.arms)} arms x {len(config.seeds)} seeds, {config.batch_size} "
              f"samples per rank (global {p * config.batch_size}) -> {out_root / config.name}", flush=True)
        points += points_at(run_point(config, out_root), study, p)
    return points


def growth(points: list[ScalePoint], arm: str, low: int, high: int) -> float | None:
    """Bytes received per rank at world size ``high`` over those at ``low`` (None: not both known)."""
    at = {p.world_size: p.bytes_received_per_step for p in points if p.arm == arm}
    if not at.get(low) or at.get(high) is None:
        return None
    return at[high] / at[low]


def ring_growth(low: int, high: int) -> float:
    """How the bytes a ring allreduce brings into each rank grow from ``low`` to ``high``
    workers (dense's own growth): 2 (high-1)/high over 2 (low-1)/low."""
    from sparsecomm.comm.link_model import exchange_bytes_received

    return exchange_bytes_received("dense", 0.0, 1.0, high) / exchange_bytes_received("dense", 0.0, 1.0, low)
