"""A whole run projected: every arm at the scenario, the top-k arms at other densities, the
break-evens against dense, and the assumptions printed with them."""
from dataclasses import dataclass, field

from sparsecomm.lab.costmodel.breakeven import break_even_density, break_even_rate
from sparsecomm.lab.costmodel.inputs import RunInputs
from sparsecomm.lab.costmodel.projection import ArmProjection, project_arm
from sparsecomm.lab.costmodel.scenario import Scenario
from sparsecomm.lab.results.quantity import MODEL_BOUNDARIES
from sparsecomm.lab.results.target import DENSE_ARM


@dataclass(frozen=True)
class Projection:
    run: RunInputs
    scenario: Scenario
    arms: tuple[ArmProjection, ...]
    tables: dict = field(default_factory=dict)  # arm -> tuple of ArmProjection at the requested densities
    break_even: dict = field(default_factory=dict)  # arm -> list of BreakEven


def assumptions(run: RunInputs, scenario: Scenario) -> list[str]:
    lines = [
        f"alpha {scenario.alpha_s * 1e6:g} us per message ({scenario.alpha_source})",
        f"{run.buckets_per_step} bucket(s) per step, {run.buckets_source}",
        "communication exposed (not overlapped with backward): an upper bound" if not scenario.overlap else
        "overlap: all but the last bucket's communication hides behind compute (optimistic bound)",
        "compute and compress per worker as measured at the run's world size (weak scaling)",
        f"run's own comm wait (link {run.link}) not used: communication is modelled",
    ]
    if run.not_modelled:
        lines.append(f"not projected: {', '.join(run.not_modelled)} (local steps with an outer sync, or nothing "
                     "sent: one collective per period, which this model does not cover)")
    if scenario.exchange != "allgather":
        how = ("through range owners" if scenario.exchange == "owner"
               else "by the cheaper of all-gather and owner, per arm")
        lines.append(f"top-k arms exchanged {how} (--exchange), whatever exchange the run used")
    if scenario.unpack_adds_per_s:
        lines.append(f"unpack rate {scenario.unpack_adds_per_s:.3g} adds/s (assumed, --unpack-rate)")
    else:
        lines.append("unpack rate measured from hook_stats (includes per-call overhead)")
    return lines


def project(run: RunInputs, scenario: Scenario, densities: tuple[float, ...] = ()) -> Projection:
    arms = tuple(project_arm(a, run, scenario) for a in run.arms)
    dense = run.arm(DENSE_ARM)
    tables, breaks = {}, {}
    for a in run.arms:
        if a.sparse and densities:
            tables[a.arm] = tuple(project_arm(a, run, scenario, d) for d in densities)
        if dense is None or a.arm == DENSE_ARM:
            continue
        found = []
        if a.sparse:
            found += [break_even_density(a, dense, run, scenario, b) for b in MODEL_BOUNDARIES]
        found += [break_even_rate(a, dense, run, scenario, b) for b in MODEL_BOUNDARIES]
        breaks[a.arm] = found
    return Projection(run, scenario, arms, tables, breaks)

