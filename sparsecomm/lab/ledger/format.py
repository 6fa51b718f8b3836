"""The ledger as text within 100 columns: the experiment, one table row per arm with the
values alone, one legend naming each column's boundary and the link once, the notes, the
runs that are in no figure, and one speedup line per arm with a ratio per boundary."""
from sparsecomm.lab.ledger.items import ArmLedger, Ledger, exposed_fraction
from sparsecomm.lab.results import experiment_link
from sparsecomm.lab.results.layout import SUMMARY_FILE
from sparsecomm.lab.results.policy import format_policy
from sparsecomm.lab.results.quantity import Quantity, Speedup, format_value
from sparsecomm.lab.results.target import DENSE_ARM
from sparsecomm.lab.results.text import REPORT_WIDTH, fold_lines


def format_not_ok(runs, missing=()) -> str:
    """One line per run that is in no figure: its status and error; and per missing run."""
    lines = [f"  {r.arm} seed {r.seed}: {_clip(r.describe_problem())}" for r in runs if not r.finished]
    lines += [f"  {arm} seed {seed}: missing (no {SUMMARY_FILE}: not run, or still running)" for arm, seed in missing]
    if not lines:
        return ""
    return "\n".join([f"runs not in the figures, counted as failed ({len(lines)}):", *lines])


def _clip(text: str, width: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


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
