"""The ledger's figures: per arm, the median over its finished seeds of each line item
(setup, step x steps to target, checkpoint, expected recovery), each a measured
:class:`~sparsecomm.lab.results.quantity.Quantity` of its boundary; and the ledger of a whole
run directory (:func:`build_ledger`), the runs that are in no figure included."""
import statistics
from dataclasses import dataclass
from pathlib import Path

from sparsecomm.lab.results import (
    RunSummary,
    arms_configured_first,
    describe_counts,
    experiment_link,
    load_experiment,
    load_runs,
    status_counts,
)
from sparsecomm.lab.results.quantity import MEASURED, BoundaryError, Quantity
from sparsecomm.lab.results.target import DENSE_ARM, Target, resolve_target

NOT_MEASURED = {
    "checkpoint": "not measured (these runs saved no checkpoint: checkpoint_every = 0)",
    "recovery": "not measured (no fault was injected in these runs)",
}


def step_cost_to_target(step: Quantity, steps: Quantity) -> Quantity:
    """The line item "step cost x steps actually needed" (boundary: end_to_end)."""
    if (step.kind, steps.kind) != (MEASURED, MEASURED):
        raise BoundaryError(f"step x steps is a measured line item, got a {step.kind} step and {steps.kind} steps")
    if (step.boundary, steps.boundary) != ("step", "steps_to_target"):
        raise BoundaryError(
            f"step x steps needs a [step] and a [steps_to_target] figure, got [{step.boundary}] and [{steps.boundary}]"
        )
    if not (step.measured and steps.measured):
        return Quantity(None, "s", "end_to_end", steps.note or step.note, step.link)
    return Quantity(step.value * steps.value, "s", "end_to_end", link=step.link)


@dataclass(frozen=True)
class ArmLedger:
    arm: str
    num_ok: int
    num_failed: int  # runs that did not finish: status other than "ok", or ok without evaluations
    setup: Quantity  # end_to_end item
    step: Quantity
    bytes_per_step: Quantity
    steps_to_target: Quantity
    time_to_target: Quantity
    step_x_steps: Quantity  # end_to_end item
    checkpoint: Quantity  # end_to_end item
    recovery: Quantity  # end_to_end item
    residual_reset: bool = False  # some run restored without its error-feedback state
    unverified: tuple[str, ...] = ()  # reasons runs were marked unverified (residual staleness)
    rollbacks: int = 0  # corruptions detected and rolled back, all seeds
    checkpoint_fallbacks: int = 0  # resumes that skipped a latest checkpoint that did not verify, all seeds
    hook_path: tuple[int, int] | None = None  # (fused, all) sparse calls of the top-k hook, all seeds
    not_ok: tuple[tuple[str, int], ...] = ()  # (status, count) of the runs that did not finish
    num_missing: int = 0  # configured seeds with no summary at all
    exposed_comm: Quantity | None = None  # median wait for communication after backward (s per step)

    @property
    def runs_column(self) -> str:
        """"ok/failed", with the statuses when any is not plain "failed", and missing runs."""
        text = f"{self.num_ok}/{self.num_failed}"
        if any(status != "failed" for status, _ in self.not_ok):
            text += f" ({describe_counts(dict(self.not_ok))})"
        return text + (f", {self.num_missing} missing" if self.num_missing else "")

    @property
    def end_to_end(self) -> Quantity:
        return self.setup + self.step_x_steps + self.checkpoint + self.recovery

    @property
    def measured_part(self) -> Quantity:
        """The measured end_to_end items only: a partial total, never shown as the total."""
        items = [f for f in (self.setup, self.step_x_steps, self.checkpoint, self.recovery) if f.measured]
        total = items[0] if items else Quantity(None, "s", "end_to_end", link=self.step.link)
        for item in items[1:]:
            total = total + item
        return total

    @property
    def missing_items(self) -> list[str]:
        names = ("setup", "step x steps", "checkpoint", "recovery")
        figures = (self.setup, self.step_x_steps, self.checkpoint, self.recovery)
        return [name for name, f in zip(names, figures) if not f.measured]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def arm_ledger(arm: str, runs: list[RunSummary], target: Target, fault_rate_per_hour: float = 1.0,
               link: str = "loopback", num_missing: int = 0) -> ArmLedger:
    """Median over this arm's finished seeds of every figure, measured over ``link``."""

    def figure(value, unit: str, boundary: str, note: str = "") -> Quantity:
        return Quantity(value, unit, boundary, note, link)

    ok = [r for r in runs if r.arm == arm and r.finished]
    failed = [r for r in runs if r.arm == arm and not r.finished]
    reached = [r.first_reaching(target.val_loss, target.mode) for r in ok]
    hits = [e for e in reached if e is not None]
    not_reached = len(ok) - len(hits)
    if not ok:
        note = "no finished run"
    elif not_reached:
        # A median over only the seeds that made it would flatter the arm.
        note = f"not reached in {not_reached}/{len(ok)} seeds"
    else:
        note = ""
    steps = _median([e.step for e in hits]) if hits and not not_reached else None
    seconds = _median([e.elapsed_seconds for e in hits]) if hits and not not_reached else None
    step = figure(_median([r.median_step_seconds for r in ok]), "s", "step")
    steps_to_target = figure(steps, "steps", "steps_to_target", note)
    checkpoint_values = [r.extra.get("checkpoint_seconds") for r in ok]
    checkpoint = (figure(_median(checkpoint_values), "s", "end_to_end")
                  if ok and None not in checkpoint_values else figure(None, "s", "end_to_end", NOT_MEASURED["checkpoint"]))
    return ArmLedger(
        arm=arm,
        num_ok=len(ok),
        num_failed=len(failed),
        setup=figure(_median([r.setup_seconds for r in ok]), "s", "end_to_end"),
        step=step,
        bytes_per_step=figure(_median([r.bytes_sent_per_step for r in ok]), "B", "step"),
        steps_to_target=steps_to_target,
        time_to_target=figure(seconds, "s", "time_to_target", note),
        step_x_steps=step_cost_to_target(step, steps_to_target),
        checkpoint=checkpoint,
        recovery=_expected_recovery(ok, fault_rate_per_hour, link),
        residual_reset=any(r.extra.get("residual_reset") for r in ok),
        unverified=tuple(sorted({r.extra["unverified_reason"] for r in ok if r.extra.get("unverified_reason")})),
        rollbacks=sum(r.extra.get("rollbacks") or 0 for r in ok),
        checkpoint_fallbacks=sum(len(r.extra.get("checkpoint_fallbacks") or []) for r in ok),
        hook_path=_hook_path(ok),
        not_ok=tuple(status_counts(failed).items()),
        num_missing=num_missing,
        exposed_comm=figure(_median([r.median_comm_wait_seconds for r in ok
                                     if r.median_comm_wait_seconds is not None]), "s", "step"),
    )


def _hook_path(ok: list[RunSummary]) -> tuple[int, int] | None:
    """(sparse calls on the fused kernel, all sparse calls) of the top-k hook, or None
    when the arm has no such hook (or its runs predate the count)."""
    stats = [r.extra.get("hook_stats") or {} for r in ok]
    if not stats or not all("fused_calls" in s for s in stats):
        return None
    sparse = sum(s.get("sparse_calls", 0) for s in stats)
    return (sum(s["fused_calls"] for s in stats), sparse) if sparse else None


def _expected_recovery(ok: list[RunSummary], fault_rate_per_hour: float, link: str) -> Quantity:
    """Measured cost of one fault x expected faults in a run under the declared rate.

    Cost of one fault = recovery time (fault -> first completed step after the restore,
    measured from an injected fault) + lost work (steps recomputed since the checkpoint x
    step time). Expected faults = rate x the run's wall-clock hours.
    """
    measured = [r for r in ok if r.extra.get("recovery_seconds") is not None]
    if not measured:
        return Quantity(None, "s", "end_to_end", NOT_MEASURED["recovery"], link)
    per_fault = _median([r.extra["recovery_seconds"] + r.extra["lost_steps"] * r.median_step_seconds for r in measured])
    hours = _median([r.extra.get("total_seconds", 0.0) for r in ok]) / 3600
    return Quantity(per_fault * fault_rate_per_hour * hours, "s", "end_to_end",
                  f"{per_fault:.1f} s per fault x {fault_rate_per_hour:g}/h x {hours * 3600:.0f} s", link)


@dataclass(frozen=True)
class Ledger:
    experiment: dict
    target: Target
    arms: list[ArmLedger]
    runs: tuple[RunSummary, ...] = ()
    missing: tuple[tuple[str, int], ...] = ()  # (arm, seed) configured, with no summary

    def arm(self, name: str) -> ArmLedger:
        return next(a for a in self.arms if a.arm == name)


def missing_runs(experiment: dict, runs: list[RunSummary]) -> list[tuple[str, int]]:
    """(arm, seed) pairs the config asks for that have no summary at all."""
    have = {(r.arm, r.seed) for r in runs}
    config = experiment["config"]
    return [(arm, seed) for arm in config["arms"] for seed in config["seeds"] if (arm, seed) not in have]


def no_finished_dense(runs: list[RunSummary], missing: list[tuple[str, int]] = ()) -> str | None:
    """"no dense run finished (N failed, ...)" when none did, else None."""
    dense = [r for r in runs if r.arm == DENSE_ARM]
    if any(r.finished for r in dense):
        return None
    counts = status_counts(dense)
    num_missing = sum(arm == DENSE_ARM for arm, _ in missing)
    if num_missing:
        counts["missing"] = num_missing
    return f"no dense run finished ({describe_counts(counts) or 'no dense run'})"


def build_ledger(run_dir: str | Path) -> Ledger:
    experiment = load_experiment(run_dir)
    runs = load_runs(run_dir)
    missing = missing_runs(experiment, runs)
    if experiment["config"].get("target_loss") is None:
        reason = no_finished_dense(runs, missing)
        if reason is not None:  # the target derives from dense
            raise ValueError(f"ledger not available: {reason}; declare target_loss in the config to see the "
                             "other arms alone")
    target = resolve_target(experiment, runs)
    order = arms_configured_first(experiment["config"]["arms"], runs)
    rate = experiment["config"].get("fault_rate_per_hour", 1.0)
    link = experiment_link(experiment)
    arms = [arm_ledger(arm, runs, target, rate, link, sum(a == arm for a, _ in missing)) for arm in order]
    return Ledger(experiment, target, arms, tuple(runs), tuple(missing))


def ledger_items_for_plot(run_dir: str | Path) -> dict[str, dict[str, float | int | bool | None]]:
    """Per arm, the four end_to_end line items in seconds (None: not measured), and what the
    plot needs to draw an arm that missed the target at its whole budget instead of as a short bar:

    - ``target_reached``: False when some finished seed never reached the target (then
      "step x steps" is None); None when the arm has no finished run;
    - ``budget_steps``: the configured steps per run;
    - ``budget_seconds``: median step x ``budget_steps``, the step cost of the whole run
      (None when the step was not measured).
    """
    built = build_ledger(run_dir)
    budget_steps = int(built.experiment["config"]["steps"])
    return {a.arm: _plot_items(a, budget_steps) for a in built.arms}


def _plot_items(a: ArmLedger, budget_steps: int) -> dict[str, float | int | bool | None]:
    return {
        "setup": a.setup.value, "step x steps": a.step_x_steps.value,
        "checkpoint": a.checkpoint.value, "recovery": a.recovery.value,
        "target_reached": a.steps_to_target.measured if a.num_ok else None,
        "budget_steps": budget_steps,
        "budget_seconds": a.step.value * budget_steps if a.step.measured else None,
    }


def exposed_fraction(a: ArmLedger) -> float | None:
    """The arm's median wait for communication after backward as a fraction of its median
    step (None where either was not measured)."""
    if a.exposed_comm is None or not a.exposed_comm.measured or not a.step.measured or not a.step.value:
        return None
    return a.exposed_comm.value / a.step.value
