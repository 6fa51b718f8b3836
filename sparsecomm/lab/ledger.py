"""The time-to-quality ledger: what a run costs until it reaches the target, item by item.

Line items per arm (median over seeds): setup, step cost x steps actually needed,
checkpoint, expected recovery. Every figure carries the boundary it was measured against:

- ``step``: one training step (compute + compression + communication);
- ``steps_to_target``: steps until the validated target is first reached (resolution:
  the evaluation cadence);
- ``time_to_target``: wall clock from first data touch to the target, evaluation included;
- ``end_to_end``: setup + step x steps + checkpoint + expected recovery.

Checkpoint = blocking time spent saving verified checkpoints; recovery = measured cost of
one injected fault (recovery time + recomputed steps) x the declared fault rate x run
hours. Every figure is a measured :class:`sparsecomm.lab.quantity.Quantity`: adding or dividing
figures of different boundaries (or links) raises :class:`BoundaryError`; the only
cross-boundary operation is :func:`step_cost_to_target` (step x steps), which is how
the ledger defines that line item. An item not measured yet is ``not measured`` ("n/m" in
the table), never zero, and a total that includes it is ``not measured`` too (the table
shows ">= " its measured part, a lower bound). An arm that did not reach the target in some
seed has no steps-to-target figure: its row says "not reached in N steps".

The printed ledger fits in 100 columns: one row per arm with the values alone, one legend
naming each column's boundary and the link once, and one speedup line per arm with a ratio
per boundary ("step 1.90x ... total 1.20x": a step speedup and an end_to_end speedup are
different claims).

Runs that did not finish (any status other than "ok", e.g. failed, interrupted, or a
summary excluded as invalid; see :mod:`sparsecomm.lab.results`) are not in any figure, but
each is counted in its arm's "runs" column (finished/not) and listed with its status and
error below the table; so are configured runs that have no summary at all (missing).

Needs no torch.

    sparsecomm ledger RUN_DIR      # exit 0; 2 for an unreadable run directory, or no finished dense run
"""
import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from sparsecomm.lab.policy import format_policy
from sparsecomm.lab.quantity import MEASURED, BoundaryError, Quantity, Speedup, format_value
from sparsecomm.lab.results import (
    ResultFileError,
    RunSummary,
    arms_configured_first,
    describe_counts,
    experiment_link,
    load_experiment,
    load_runs,
    status_counts,
    warnings_to_stderr,
)
from sparsecomm.lab.target import DENSE_ARM, Target, resolve_target
from sparsecomm.lab.text import REPORT_WIDTH, fold_lines

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


def format_not_ok(runs, missing=()) -> str:
    """One line per run that is in no figure: its status and error; and per missing run."""
    lines = [f"  {r.arm} seed {r.seed}: {_clip(r.describe_problem())}" for r in runs if not r.finished]
    lines += [f"  {arm} seed {seed}: missing (no summary.json: not run, or still running)" for arm, seed in missing]
    if not lines:
        return ""
    return "\n".join([f"runs not in the figures, counted as failed ({len(lines)}):", *lines])


def _clip(text: str, width: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


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


NOT_MEASURED_CELL = "n/m"
# (top line, bottom line) of each column's header: two lines keep the columns narrow. The
# end_to_end items sit left of "steps" so that the target-dependent cells are contiguous.
_COLUMNS = (("", "arm"), ("", "runs"), ("", "step"), ("sent", "/step"), ("", "setup"), ("", "ckpt"),
            ("", "recovery"), ("", "steps"), ("step x", "steps"), ("", "total"), ("to", "target"))


def _describe_link(link: str) -> str:
    if link == "loopback":
        return "the machine's loopback device (not emulated)"
    return f"an emulated {link} link per rank (network namespaces + tc)"


def format_ledger(ledger: Ledger, *, context: bool = True) -> str:
    """The ledger as text within 100 columns: the experiment, one table row per arm, one
    legend naming the boundaries and the link, the notes, and one speedup line per arm.

    ``context=False`` leaves out the policy and target lines, for a report that printed them.
    """
    link = experiment_link(ledger.experiment)
    budget_steps = ledger.experiment["config"]["steps"]
    lines = fold_lines(_header_lines(ledger, link, context))
    lines += ["", *_table([_row(a, budget_steps) for a in ledger.arms])]
    lines += ["", *fold_lines([_legend(link), *_notes(ledger, budget_steps)])]
    not_ok = format_not_ok(ledger.runs, ledger.missing)
    if not_ok:
        lines += ["", *fold_lines(not_ok.splitlines())]
    dense = next((a for a in ledger.arms if a.arm == DENSE_ARM), None)
    if dense is not None and len(ledger.arms) > 1:
        lines += ["", "speedup vs dense (dense cost / arm cost; > 1: the arm is cheaper):"]
        lines += fold_lines(_speedup_lines(ledger.arms, dense))
    return "\n".join(lines)


def _header_lines(ledger: Ledger, link: str, context: bool) -> list[str]:
    config = ledger.experiment["config"]
    lines = [format_policy(config["policy"]), ledger.target.describe()] if context else []
    source = f"task {config['task']}" if config.get("task") is not None else f"script {config.get('script')}"
    lines.append(f"experiment {config['name']}: {source}, {config['world_size']} ranks linked by "
                 f"{link}, {config['steps']} steps, seeds {config['seeds']}; figures are medians over finished seeds")
    if config.get("checkpoint_every"):
        lines.append(f"verified checkpoint every {config['checkpoint_every']} steps")
    if config.get("fault"):
        fault = config["fault"]
        lines.append(f"injected fault in every run: {fault['kind']} on rank {fault['rank']} after step {fault['step']} "
                     f"(torchrun --max-restarts {config['max_restarts']}); time to target includes its recovery")
    reset = [a.arm for a in ledger.arms if a.residual_reset]
    if reset:
        lines.append(f"error-feedback state reset on restore (not bit-exact): {', '.join(reset)}")
    for a in ledger.arms:
        lines += _arm_remarks(a)
    return lines


def _arm_remarks(a: ArmLedger) -> list[str]:
    """What the figures alone do not say about this arm's runs."""
    lines = [f"UNVERIFIED {a.arm}: {'; '.join(a.unverified)}"] if a.unverified else []
    if a.rollbacks:
        lines.append(f"{a.arm}: {a.rollbacks} detected corruption(s) rolled back to the last verified checkpoint")
    if a.checkpoint_fallbacks:
        lines.append(f"{a.arm}: {a.checkpoint_fallbacks} resume(s) skipped a latest checkpoint that did not verify "
                     "and restored an older one (more steps recomputed)")
    if a.hook_path is not None:
        fused, sparse = a.hook_path
        why = ("" if fused == sparse else ": the others formed acc in the bucket first (momentum correction, "
               "the model budget counting it, local clipping, or an observer reading it); same bits, slower")
        lines.append(f"{a.arm}: hook path: fused kernel in {fused} of {sparse} sparse calls{why}")
    if exposed_fraction(a):
        lines.append(f"{a.arm}: exposed communication (the wait for it after backward) "
                     f"{a.exposed_comm.value * 1e3:.1f} ms per step, {exposed_fraction(a):.0%} of the step")
    return lines


def exposed_fraction(a: ArmLedger) -> float | None:
    """The arm's median wait for communication after backward as a fraction of its median
    step (None where either was not measured)."""
    if a.exposed_comm is None or not a.exposed_comm.measured or not a.step.measured or not a.step.value:
        return None
    return a.exposed_comm.value / a.step.value


def _row(a: ArmLedger, budget_steps: int) -> list[str]:
    """One arm's cells; an arm without the target-dependent figures ends in one cell saying why."""
    cells = [a.arm, f"{a.num_ok}/{a.num_failed + a.num_missing}"]
    if not a.num_ok:
        return cells + ["no finished run"]
    cells += [_cell(f) for f in (a.step, a.bytes_per_step, a.setup, a.checkpoint, a.recovery)]
    if not a.steps_to_target.measured:  # finished runs, but some seed never reached the target
        return cells + [f"not reached in {budget_steps} steps"]
    return cells + [_cell(a.steps_to_target), _cell(a.step_x_steps), _total_cell(a), _cell(a.time_to_target)]


def _cell(figure: Quantity) -> str:
    """The value alone: the legend names its boundary and link."""
    if not figure.measured:
        return NOT_MEASURED_CELL
    return f"{figure.value:g}" if figure.unit == "steps" else format_value(figure.value, figure.unit)


def _total_cell(a: ArmLedger) -> str:
    """The total, or ">= " its measured part: a lower bound, never shown as the total."""
    if a.end_to_end.measured:
        return _cell(a.end_to_end)
    return f">= {_cell(a.measured_part)}" if a.measured_part.measured else NOT_MEASURED_CELL


def _table(rows: list[list[str]]) -> list[str]:
    """The rows aligned under the two-line header of _COLUMNS. A row shorter than the header
    ends in a cell that runs over the empty columns to its right, so it widens no column.
    Two spaces between columns, one where two would not fit in REPORT_WIDTH."""
    grid = [[top for top, _ in _COLUMNS], [bottom for _, bottom in _COLUMNS], *rows]

    def sets_width(row: list[str], i: int) -> bool:
        return i < len(row) - 1 or len(row) == len(_COLUMNS)

    widths = [max(len(row[i]) for row in grid if i < len(row) and sets_width(row, i)) for i in range(len(_COLUMNS))]
    for gap in ("  ", " "):
        lines = [gap.join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in grid]
        if max(map(len, lines)) <= REPORT_WIDTH:
            break
    return lines


def _legend(link: str) -> str:
    return ("boundaries: step, sent/step = step; setup, ckpt, recovery, step x steps, total = end_to_end; "
            "steps = steps_to_target; to target = time_to_target (evaluation included); "
            f"all measured @{link}: ranks linked by {_describe_link(link)}")


def _notes(ledger: Ledger, budget_steps: int) -> list[str]:
    """What the cells abbreviate: runs, n/m, partial totals, and why an item is missing."""
    lines = ["cells: runs = finished/not finished seeds (the others are listed below); "
             f"{NOT_MEASURED_CELL} = not measured; total = setup + ckpt + recovery + step x steps, or >= its "
             f"measured items when one is {NOT_MEASURED_CELL}; not reached: by some seed, so no figure (a median "
             "over the others would flatter the arm)"]
    lines += [f"{a.arm}: target {a.steps_to_target.note} within {budget_steps} steps"
              for a in ledger.arms if a.num_ok and not a.steps_to_target.measured]
    for name in ("checkpoint", "recovery"):
        notes = {a.arm: getattr(a, name).note for a in ledger.arms if getattr(a, name).note}
        if len(set(notes.values())) == 1 and len(notes) == len(ledger.arms):
            lines.append(f"{name}: {next(iter(notes.values()))}")
        else:
            lines += [f"{arm} {name}: {note}" for arm, note in notes.items()]
    return lines


def _speedup_lines(arms: list[ArmLedger], dense: ArmLedger) -> list[str]:
    width = max(len(a.arm) for a in arms)
    return [f"  {a.arm:<{width}}  {_speedups(a, dense)}" for a in arms if a.arm != DENSE_ARM]


def _speedups(a: ArmLedger, dense: ArmLedger) -> str:
    if not a.num_ok:
        return "n/a: no finished run"
    step = f"step {_times(a.step.speedup_over(dense.step))}"
    if not a.steps_to_target.measured:
        return f"{step}  steps, time, total: n/a (target not reached)"
    return "  ".join([step, f"steps {_times(a.steps_to_target.speedup_over(dense.steps_to_target))}",
                      f"time {_times(a.time_to_target.speedup_over(dense.time_to_target))}",
                      f"total {_total_speedup(a, dense)}"])


def _times(speedup: Speedup) -> str:
    return "n/a" if speedup.ratio is None else f"{speedup.ratio:.2f}x"


def _total_speedup(a: ArmLedger, dense: ArmLedger) -> str:
    """The end_to_end ratio; without it, the ratio of the measured parts when both sides miss
    the same items (unlike sums never compare)."""
    total = a.end_to_end.speedup_over(dense.end_to_end)
    if total.ratio is not None or a.missing_items != dense.missing_items:
        return _times(total)
    return f"{_times(a.measured_part.speedup_over(dense.measured_part))} (without {', '.join(a.missing_items)})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sparsecomm ledger", description="Print the time-to-quality ledger of a run directory.")
    parser.add_argument("run_dir", type=Path, help="experiment directory written by sparsecomm compare")
    args = parser.parse_args(argv)
    try:
        with warnings_to_stderr("sparsecomm ledger"):
            print(format_ledger(build_ledger(args.run_dir)))
    except (OSError, ValueError) as error:  # FileNotFoundError: no experiment.json; ResultFileError names the file
        print(f"sparsecomm ledger: error: {error}", file=sys.stderr)
        if isinstance(error, ValueError) and not isinstance(error, ResultFileError):
            try:  # say which runs failed, when the directory itself is readable
                runs = load_runs(args.run_dir)
                text = format_not_ok(runs, missing_runs(load_experiment(args.run_dir), runs))
            except (OSError, ValueError):
                text = ""
            if text:
                print(text, file=sys.stderr)
        return 2
    return 0
