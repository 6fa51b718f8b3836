"""Where compression pays: the section that ends the report ``sparsecomm compare`` prints.

On loopback dense allreduce is cheap, so a sparse arm is usually slower to the target there;
what a person wants to know is on what link it would win. For each arm whose verdict is
equivalent to dense (or better: no loss either, :attr:`sparsecomm.lab.tolerance.Equivalence.no_loss`)
this section prints its modelled break-even: the link rate per rank below which the arm reaches
the target sooner than dense (:func:`~sparsecomm.lab.costmodel.breakeven.break_even_rate` at
boundary ``time_to_target``: measured steps-to-target x modelled step), labelled as the cost
model labels its figures, and the ``sparsecomm compare --link`` command that measures it on
an emulated link at a rate just below it (:func:`link_just_below`).

The scenario is the run's own: its world size, alpha from its link's latency or else the
model's default, communication not overlapped with compute (the model's default); one line
says so. The other outcomes: an arm sooner at every rate, or already sooner than dense on the
run's own link (measured, from the ledger), says so; an arm no rate favours says "never" and
why (its time to the target without transfers, and the bytes it transfers, each against
dense's); an arm the model does not cover (local steps with an outer sync) is named as such;
with no equivalent arm the section says that nothing is equivalent and prints no break-even.
"""
import math
from pathlib import Path

from sparsecomm.lab import ledger, tolerance
from sparsecomm.lab.costmodel.breakeven import BreakEven, break_even_rate
from sparsecomm.lab.costmodel.inputs import ArmInputs, RunInputs, read_run
from sparsecomm.lab.costmodel.projection import project_arm
from sparsecomm.lab.costmodel.scenario import Scenario, format_rate, make_scenario
from sparsecomm.lab.results.quantity import Quantity, format_value
from sparsecomm.lab.results import load_experiment
from sparsecomm.lab.results.target import DENSE_ARM
from sparsecomm.lab.results.text import CONTINUATION, REPORT_WIDTH, fold, fold_lines
from sparsecomm.links.spec import RATE_RANGE_BITS, link_name, parse_link

BOUNDARY = "time_to_target"
LABEL = Quantity.modelled(None, "bit/s", BOUNDARY).label  # "[modelled, boundary: time_to_target]"
RANGE = f"{format_rate(RATE_RANGE_BITS[0])} to {format_rate(RATE_RANGE_BITS[1])}"  # the rates a link takes
HEADER = f"where compression pays {LABEL}: the link rate per rank below which an arm reaches the target sooner than dense"


def break_even_lines(run_dir: str | Path) -> list[str]:
    """The section's lines, each within :data:`~sparsecomm.lab.results.text.REPORT_WIDTH` columns."""
    arms = [a.arm for a in tolerance.check(run_dir).arms if a.equivalence.no_loss]
    if not arms:
        return fold_lines([HEADER, "  no arm is equivalent to dense (or better), so no break-even is printed: "
                                   "a faster arm that loses quality is no win"])
    config = load_experiment(run_dir)["config"]
    parallelism = config.get("parallelism") or "ddp"
    if parallelism != "ddp":
        return fold_lines([HEADER, f"  not modelled: parallelism {parallelism}: the model has one reduction over all "
                                   "ranks per bucket, as DDP's, not FSDP's traffic within and across replicas"])
    try:
        run = read_run(run_dir)
    except (ValueError, KeyError) as error:  # summaries without step timings: say why, keep the report
        return fold_lines([HEADER, f"  not available: {error}"])
    dense = run.arm(DENSE_ARM)
    if dense is None:
        return fold_lines([HEADER, f"  not available: no finished {DENSE_ARM} run recorded its step timings"])
    measured_on = parse_link(run.link)
    # break_even_rate sweeps the rate; the link only lends its latency to alpha (else the model's default).
    scenario = make_scenario(run.world_size, measured_on if measured_on.emulated else "1gbit")
    times = ledger.build_ledger(run_dir)
    lines = fold_lines([HEADER, f"  assumptions: {run.world_size} workers (the run's world size); alpha "
                                f"{scenario.alpha_s * 1e6:g} us per message ({scenario.alpha_source}); communication "
                                f"not overlapped with compute; compute, compress and steps-to-target as measured "
                                f"on {run.link}"])
    arm_lines = [_arm_lines(name, run, dense, scenario, times) for name in arms]
    for outcome, command in arm_lines:
        lines += outcome + command
    if any(command for _, command in arm_lines):  # the commands name FILE
        lines += fold_lines([_file_legend(run_dir, config)])
    return lines


def _arm_lines(name: str, run: RunInputs, dense: ArmInputs, scenario: Scenario,
               times: ledger.Ledger) -> tuple[list[str], list[str]]:
    """One arm's outcome, and the command that measures its break-even (none without one)."""
    arm = run.arm(name)
    if name in run.not_modelled or arm is None:
        why = ("it trains locally and syncs once per period, which the model does not cover"
               if name in run.not_modelled else "no finished run recorded its step timings")
        return fold_lines([f"  {name}: not modelled: {why}"]), []
    found = break_even_rate(arm, dense, run, scenario, BOUNDARY)
    outcome = fold_lines([f"  {name}: {_outcome(found, arm, dense, run, scenario)}"
                          f"{_already_sooner(times, name, run.link)}"])
    link = link_just_below(found.value) if found.kind == "below" else None
    if link is None:
        return outcome, []
    latency = run.link.partition("@")[2]  # alpha came from it: measure with it too
    link += f"@{latency}" if latency else ""
    return outcome, _command_lines(f"    sparsecomm compare --config FILE --arms {DENSE_ARM} {name} --link {link} "
                                   f"--name {run.name}-{link.replace('@', '-')}")


def link_just_below(bits_per_s: float) -> str | None:
    """The name of a rate ``--link`` accepts just below ``bits_per_s``: the largest rate of two
    significant digits under it (4.12e8 gives ``410mbit``, 1e9 ``990mbit``); None when that is
    below the slowest rate a link takes."""
    step = 10.0 ** (math.floor(math.log10(bits_per_s)) - 1)  # the second significant digit's
    digits = math.ceil(bits_per_s / step) - 1
    while digits * step >= bits_per_s:  # the division rounded up: stay strictly below
        digits -= 1
    if digits < 10:  # a power of ten: two digits of the decade below
        step, digits = step / 10, 99
    rate = digits * step
    return link_name(rate) if rate >= RATE_RANGE_BITS[0] else None


def _outcome(found: BreakEven, arm: ArmInputs, dense: ArmInputs, run: RunInputs, scenario: Scenario) -> str:
    if found.kind == "below":
        return f"below {format_rate(found.value)} {LABEL}"
    if found.kind == "above":
        return f"only above {format_rate(found.value)} {LABEL}, on faster links"
    if found.kind == "always":
        return f"sooner at every rate, {RANGE} {LABEL}"
    if found.kind == "never":
        (free, moved), (dense_free, dense_moved) = (_to_target(a, run, scenario) for a in (arm, dense))
        return (f"never {LABEL}: no rate from {RANGE} favours it; without transfers (compute + compress + "
                f"unpack + latency per message) it takes {format_value(free, 's')} to the target against dense's "
                f"{format_value(dense_free, 's')}; it transfers {format_value(moved, 'B')} per rank against "
                f"dense's {format_value(dense_moved, 'B')}")
    return f"no break-even: {found.text.removeprefix('n/a: ')}"  # n/a, or crossings on several intervals


def _to_target(arm: ArmInputs, run: RunInputs, scenario: Scenario) -> tuple[float, float]:
    """(seconds that no link rate changes, bytes transferred per rank) until the target.

    On an infinitely fast link only the first is left; what a finite rate adds is the bytes'
    transfer time, so the bytes are that time x the rate."""
    at_rate = project_arm(arm, run, scenario).step.value
    free = project_arm(arm, run, scenario.with_rate(math.inf)).step.value
    return arm.steps_to_target * free, arm.steps_to_target * (at_rate - free) * scenario.rate_bytes_per_s


def _already_sooner(times: ledger.Ledger, name: str, link: str) -> str:
    """"; already sooner than dense on loopback (measured ...)" when the ledger says so, else ""."""
    arm, dense = times.arm(name).time_to_target, times.arm(DENSE_ARM).time_to_target
    ratio = arm.speedup_over(dense).ratio
    if ratio is None or ratio <= 1:
        return ""
    return f"; already sooner than dense on {link} (measured: {arm.shown} vs {dense.shown} to the target)"


def _command_lines(command: str) -> list[str]:
    """A command folded with shell continuations, so that it still runs when pasted."""
    parts = fold(command, REPORT_WIDTH - 2, CONTINUATION)
    return [part + " \\" for part in parts[:-1]] + parts[-1:]


def _file_legend(run_dir: str | Path, config: dict) -> str:
    legend = f"  FILE: this run's config, the \"config\" object of {Path(run_dir) / 'experiment.json'}"
    if config.get("max_restarts") or config.get("fault"):
        legend += ", with max_restarts 0 and fault null (an emulated link cannot restart a run)"
    return legend
