"""The cost model's output, as tables for a person or JSON: every projected figure labelled
``[modelled, boundary: ...]``, the measured inputs beside them labelled ``[measured]``."""
from sparsecomm.lab.costmodel.run_projection import Projection, assumptions
from sparsecomm.lab.costmodel.scenario import format_rate
from sparsecomm.lab.costmodel.validation import Validation
from sparsecomm.lab.results.quantity import Quantity, format_value
from sparsecomm.lab.results.target import DENSE_ARM


def _measured_json(value, unit: str, boundary: str, link: str) -> dict:
    return Quantity(value, unit, boundary, link=link).to_json()



def _adds(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.3g}/s"


def _speedup(arm: Quantity, dense: Quantity | None) -> str:
    ratio = arm.speedup_over(dense).ratio if dense is not None else None
    return "n/a" if ratio is None else f"{ratio:.2f}x"


def format_projection(projection: Projection) -> str:
    run, scen = projection.run, projection.scenario
    dense = next((p for p in projection.arms if p.arm == DENSE_ARM), None)
    lines = [
        "sparsecomm project: MODELLED figures (alpha-beta cost model), not measurements",
        f"from run {run.run_dir}: {run.name}, measured on link {run.link} with {run.world_size} ranks",
        f"projected to {scen.workers} workers on link {scen.link.name} "
        f"({format_rate(scen.link.rate_bits_per_s)} per rank each way)",
        run.target.describe(),
        "assumptions:",
        *[f"  - {line}" for line in assumptions(run, scen)],
        "",
        "measured inputs [measured, medians over seeds]",
        f"  {'arm':<11} {'seeds':>5} {'compute':>9} {'compress':>9} {'sent/step':>10} {'dense/step':>10} "
        f"{'density':>8} {'unpack rate':>12} {'steps-to-target':>16}",
    ]
    for a in run.arms:
        steps = f"{a.steps_to_target:g}" if a.steps_to_target is not None else (a.steps_note or "n/a")
        lines.append(
            f"  {a.arm:<11} {a.num_seeds:>5} {format_value(a.compute_s, 's'):>9} {format_value(a.compress_s, 's'):>9} "
            f"{format_value(a.bytes_sent, 'B'):>10} {format_value(a.bytes_dense, 'B'):>10} "
            f"{(f'{a.density:.3g}' if a.sparse else '-'):>8} {_adds(a.unpack_adds_per_s):>12} {steps:>16}"
        )
    lines += [
        "",
        f"projected per arm at {scen.workers} workers, {scen.link.name} [modelled]",
        f"  {'arm':<11} {'mode':<16} {'comm':>9} {'unpack':>9} {'step':>9} {'vs dense':>8} "
        f"{'time-to-target':>14} {'vs dense':>8}",
    ]
    for p in projection.arms:
        lines.append(
            f"  {p.arm:<11} {p.mode:<16} {format_value(p.comm_s, 's'):>9} {format_value(p.unpack_s, 's'):>9} "
            f"{format_value(p.step.value, 's'):>9} {_speedup(p.step, dense and dense.step):>8} "
            f"{p.time_to_target.shown:>14} "
            f"{_speedup(p.time_to_target, dense and dense.time_to_target):>8}"
        )
        lines += [f"    note: {n}" for n in p.notes]
    lines.append("  step: [modelled, boundary: step]; time-to-target: [modelled, boundary: time_to_target] "
                 "= measured steps x modelled step")
    for arm, rows in projection.tables.items():
        lines += ["", f"{arm} at other densities [modelled; compress and steps-to-target as measured]",
                  f"  {'density':>8} {'mode':<16} {'step':>9} {'vs dense':>8} {'time-to-target':>14}"]
        for p in rows:
            lines.append(f"  {p.density:>8.3g} {p.mode:<16} {format_value(p.step.value, 's'):>9} "
                         f"{_speedup(p.step, dense and dense.step):>8} "
                         f"{p.time_to_target.shown:>14}")
    if projection.break_even:
        lines += ["", f"break-even against dense at {scen.workers} workers [modelled]: where each arm is cheaper",
                  f"  (density: on {scen.link.name}; link rate: at the arm's measured density)"]
        for arm, found in projection.break_even.items():
            lines.append(f"  {arm}:")
            lines += [f"    {b.quantity:<9} {'[' + b.boundary + ']':<16} {b.text}" for b in found]
        lines.append("  [time_to_target] weights each arm's step by its measured steps-to-target, "
                     "assumed to hold at every density and rate")
    elif dense is None:
        lines += ["", f"no {DENSE_ARM!r} arm in the run: no break-even"]
    return "\n".join(lines)


def projection_json(projection: Projection) -> dict:
    run, scen = projection.run, projection.scenario
    return {
        "kind": "projection",
        "modelled": True,
        "run_dir": run.run_dir,
        "run_link": run.link,
        "run_world_size": run.world_size,
        "workers": scen.workers,
        "link": scen.link.name,
        "rate_bits_per_s": scen.link.rate_bits_per_s,
        "alpha_s": scen.alpha_s,
        "overlap": scen.overlap,
        "buckets_per_step": run.buckets_per_step,
        "target_val_loss": run.target.val_loss,
        "assumptions": assumptions(run, scen),
        "measured": {a.arm: {
            "compute_seconds": _measured_json(a.compute_s, "s", "step", run.link),
            "compress_seconds": _measured_json(a.compress_s, "s", "step", run.link),
            "bytes_sent_per_step": _measured_json(a.bytes_sent, "B", "step", run.link),
            "bytes_dense_per_step": _measured_json(a.bytes_dense, "B", "step", run.link),
            "steps_to_target": _measured_json(a.steps_to_target, "steps", "steps_to_target", run.link),
            "density": a.density, "collective": a.collective, "num_seeds": a.num_seeds,
        } for a in run.arms},
        "projected": [p.to_json() for p in projection.arms],
        "densities": {arm: [p.to_json() for p in rows] for arm, rows in projection.tables.items()},
        "break_even": {arm: [b.to_json() for b in found] for arm, found in projection.break_even.items()},
    }



def format_validation(v: Validation) -> str:
    lines = [
        "sparsecomm project --against: MODELLED step of each arm vs the step MEASURED in the other run",
        f"model inputs from {v.source.run_dir} (link {v.source.link}, {v.source.world_size} ranks); "
        f"measured in {v.other.run_dir} (link {v.other.link}, {v.other.world_size} ranks)",
        "assumptions:",
        *[f"  - {line}" for line in assumptions(v.source, v.scenario)],
        "",
        f"  {'arm':<11} {'predicted step':>15} {'measured step':>14} {'rel. error':>10} {'measured comm wait':>19}",
    ]
    for r in v.rows:
        lines.append(f"  {r.arm:<11} {format_value(r.predicted.value, 's'):>15} {format_value(r.measured_step_s, 's'):>14} "
                     f"{r.relative_error:>+10.1%} {format_value(r.measured_comm_wait_s, 's'):>19}")
    lines.append("  predicted: [modelled, boundary: step]; measured: [measured, boundary: step, median over seeds]")
    return "\n".join(lines)


def validation_json(v: Validation) -> dict:
    return {
        "kind": "validation",
        "source_run": v.source.run_dir, "source_link": v.source.link,
        "other_run": v.other.run_dir, "other_link": v.other.link, "workers": v.scenario.workers,
        "alpha_s": v.scenario.alpha_s,
        "assumptions": assumptions(v.source, v.scenario),
        "arms": [{"arm": r.arm, "predicted_step": r.predicted.to_json(),
                  "measured_step": _measured_json(r.measured_step_s, "s", "step", v.other.link),
                  "relative_error": r.relative_error} for r in v.rows],
    }

