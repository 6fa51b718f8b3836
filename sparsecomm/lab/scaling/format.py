"""A scaling study's report: printed, as ``scaling.md`` and ``scaling.json``, and drawn as
``scaling.png`` (the gap to dense and the bytes received per rank, against p)."""
import math
from dataclasses import asdict
from pathlib import Path

from sparsecomm.lab.results.target import DENSE_ARM
from sparsecomm.lab.results.text import fold_lines
from sparsecomm.lab.scaling.modelled import MODELLED_WORLD_SIZES, ModelledTraffic, format_bytes
from sparsecomm.lab.scaling.points import RECEIVED_RING, ScalePoint, growth
from sparsecomm.lab.scaling.study import Study
from sparsecomm.lab.sweep import UNAVAILABLE, VERDICT_MARKERS, aligned, fmt, markdown_table


def _ratio(value) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def _header(study: Study, metric: str) -> list[str]:
    config = study.config
    return [
        f"scaling study {config.name}: world sizes {', '.join(map(str, study.world_sizes))}; arms "
        f"{', '.join(config.arms)}; seeds {list(config.seeds)}; {config.steps} steps; link {config.link}",
        study.describe_batch() + "; optimizer settings the same at every p",
        f"verdict: equivalence (TOST) of the final {metric} against dense at the same p over paired seeds, "
        f"tolerance {config.policy.quality_tolerance:g} (fewer than 3 seeds: inconclusive); gap = mean(arm - dense), "
        "> 0 worse",
    ]


def _tables(study: Study, points: list[ScalePoint], modelled: list[ModelledTraffic], metric: str) -> dict:
    low, high = study.world_sizes[0], study.world_sizes[-1]
    main = [["p", "arm", "batch/rank", "verdict", "gap", f"final {metric}", "sent/step", "recv/step", "steps [s2t]",
             "time [t2t]", "failed arm/dense", "exposed comm"]]
    main += [[str(p.world_size), p.arm, str(p.batch_size), p.verdict, fmt(p.metric_gap), fmt(p.final_metric_mean),
              format_bytes(p.bytes_sent_per_step), format_bytes(p.bytes_received_per_step), fmt(p.steps_to_target),
              fmt(p.time_to_target_s, " s"),
              f"{p.failed}/{p.dense_failed}" + (f" ({p.not_ok})" if p.not_ok else ""),
              "n/a" if p.exposed_comm_fraction is None else f"{p.exposed_comm_fraction:.0%}"] for p in points]
    model = {m.arm: m for m in modelled}
    grow = [["arm", f"recv/step p={low}", f"recv/step p={high}", "growth (measured)", "growth (modelled)"]]
    for arm in study.config.arms:
        at = {p.world_size: p.bytes_received_per_step for p in points if p.arm == arm}
        m = model.get(arm)
        modelled_growth = (m.bytes_received[high] / m.bytes_received[low]
                           if m is not None and m.bytes_received.get(low) and m.bytes_received.get(high) is not None
                           else None)
        grow.append([arm, format_bytes(at.get(low)), format_bytes(at.get(high)), _ratio(growth(points, arm, low, high)),
                     _ratio(modelled_growth)])
    projected = [["arm (modelled)", *(f"p={p}" for p in MODELLED_WORLD_SIZES)]]
    projected += [[m.arm, *(format_bytes(m.bytes_received.get(p)) for p in MODELLED_WORLD_SIZES)] for m in modelled]
    return {"main": main, "growth": grow, "modelled": projected}


def _notes(study: Study, points: list[ScalePoint], modelled: list[ModelledTraffic], model_p: int | None) -> list[str]:
    lines = ["bytes per rank per step (rank 0): sent = mean over the steps after warm-up (every arm's hook "
             "metered); received:"]
    sources = {}
    for p in points:
        if p.received_source:
            sources.setdefault(p.arm, p.received_source)
    lines += [f"  {arm}: {source}" for arm, source in sources.items()]
    lines.append("steps/time to target: median over seeds (n/a: not reached in some seed), against a target derived "
                 "at each p from that p's dense runs (median final + tolerance)")
    failed = sum(p.failed for p in points if p.arm != DENSE_ARM) + sum(
        {p.run_dir: p.dense_failed for p in points}.values())
    lines.append(f"failed runs (any status but ok, or missing; not compared): {failed}"
                 + ("; unavailable: no dense run finished at that p" if any(p.verdict == UNAVAILABLE for p in points)
                    else ""))
    if model_p is None:
        lines.append("modelled: not available (no world size with a finished dense run to start from)")
    else:
        lines.append(f"modelled (alpha-beta cost model, sparsecomm.lab.costmodel; never measured): bytes received per "
                     f"rank per step from the bytes per step measured at p={model_p}, per-rank traffic as at that p:")
        lines += [f"  {m.arm}: {m.how}" for m in modelled]
    return lines


def format_study(study: Study, points, modelled, model_p, metric: str) -> str:
    tables = _tables(study, points, modelled, metric)
    low, high = study.world_sizes[0], study.world_sizes[-1]
    lines = [*fold_lines(_header(study, metric)), "", *aligned(tables["main"]), "",
             f"bytes received per rank per step, p={low} -> p={high}:", *aligned(tables["growth"]), "",
             "modelled bytes received per rank per step:", *aligned(tables["modelled"]), "",
             *fold_lines(_notes(study, points, modelled, model_p))]
    return "\n".join(lines)


def markdown_study(study: Study, points, modelled, model_p, metric: str) -> str:
    tables = _tables(study, points, modelled, metric)
    low, high = study.world_sizes[0], study.world_sizes[-1]
    lines = [f"# Scaling study: {study.config.name}", "", *(f"- {line}" for line in _header(study, metric)), "",
             "## Per world size and arm (measured)", "", *markdown_table(tables["main"]), "",
             f"## Bytes received per rank per step, p={low} to p={high}", "", *markdown_table(tables["growth"]), "",
             "## Bytes received per rank per step at more workers (modelled)", "",
             *markdown_table(tables["modelled"]), "", "## Notes", "",
             *(line.replace("  ", "  - ", 1) if line.startswith("  ") else f"- {line}"
               for line in _notes(study, points, modelled, model_p)), "", "![scaling](scaling.png)", ""]
    return "\n".join(lines)


def study_json(study: Study, points, modelled, model_p, metric: str) -> dict:
    config = study.config
    low, high = study.world_sizes[0], study.world_sizes[-1]
    return {
        "study": {"experiment": config.name, "world_sizes": list(study.world_sizes), "batch": study.batch,
                  "batch_per_rank": {str(p): study.batch_size(p) for p in study.world_sizes},
                  "global_batch": {str(p): study.batch_size(p) * p for p in study.world_sizes},
                  "experiments": {str(p): study.point_config(p).name for p in study.world_sizes},
                  "arms": list(config.arms), "seeds": list(config.seeds), "steps": config.steps, "link": config.link,
                  "metric": metric, "mode": config.mode, "tolerance": config.policy.quality_tolerance},
        "points": [asdict(p) for p in points],
        "growth_of_bytes_received": {arm: {"from": low, "to": high, "measured": growth(points, arm, low, high)}
                                     for arm in config.arms},
        "modelled": {"label": "modelled (alpha-beta cost model), not measured", "from_world_size": model_p,
                     "bytes_received_per_rank_per_step": {m.arm: {str(p): v for p, v in m.bytes_received.items()}
                                                          for m in modelled},
                     "how": {m.arm: m.how for m in modelled},
                     "dense_fallback_from": {m.arm: m.dense_fallback_from for m in modelled}},
    }


def plot_study(study: Study, points: list[ScalePoint], modelled: list[ModelledTraffic], path: Path,
               metric: str) -> Path:
    """Two panels: the gap to dense vs p (verdict as the marker), and bytes received per rank vs
    p, log-log (measured points; the cost model's line)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from sparsecomm.lab import plots

    fig = Figure(figsize=(13.0, 5.0), layout="constrained")
    FigureCanvasAgg(fig)
    quality, traffic = fig.subplots(1, 2)
    arms = list(study.config.arms)
    styles = plots.arm_styles(arms)
    tolerance = study.config.policy.quality_tolerance
    quality.axhspan(-tolerance, tolerance, color="0.92", zorder=0)
    quality.axhline(0.0, color=styles[DENSE_ARM]["color"], linewidth=1.0, label=f"{DENSE_ARM} (baseline)")
    for arm in plots.arm_order(a for a in arms if a != DENSE_ARM):
        mine = [p for p in points if p.arm == arm and p.metric_gap is not None and math.isfinite(p.metric_gap)]
        quality.plot([p.world_size for p in mine], [p.metric_gap for p in mine], label=arm, **styles[arm])
        for p in mine:
            quality.plot(p.world_size, p.metric_gap, marker=VERDICT_MARKERS.get(p.verdict, "s"), linestyle="none",
                         color=styles[arm]["color"], markersize=8,
                         fillstyle="none" if p.verdict == "inconclusive" else "full")
    quality.set_xscale("log", base=2)
    quality.set_xticks(list(study.world_sizes), [str(p) for p in study.world_sizes])
    quality.set_xlabel("workers p")
    quality.set_ylabel(f"final {metric}: arm - dense (> 0 worse), mean over seeds")
    quality.set_title(f"quality: o equivalent, hollow s inconclusive, x worse\nshaded: tolerance +-{tolerance:g}")
    quality.legend()

    model = {m.arm: m for m in modelled}
    for arm in plots.arm_order(arms):
        mine = [p for p in points if p.arm == arm and p.bytes_received_per_step]
        derived = any(p.received_source == RECEIVED_RING for p in mine)
        traffic.plot([p.world_size for p in mine], [p.bytes_received_per_step for p in mine], marker="o",
                     linestyle="none", color=styles[arm]["color"], markersize=7,
                     fillstyle="none" if derived else "full", label=f"{arm} measured" + (" (derived)" * derived))
        line = sorted((p, v) for p, v in (model[arm].bytes_received.items() if arm in model else ()) if v)
        if line:
            traffic.plot([p for p, _ in line], [v for _, v in line], label=f"{arm} modelled", **styles[arm])
    traffic.set_xscale("log", base=2)
    traffic.set_yscale("log")
    shown = sorted({*study.world_sizes, *MODELLED_WORLD_SIZES})
    traffic.set_xticks(shown, [str(p) for p in shown])
    traffic.set_xlabel("workers p")
    traffic.set_ylabel("bytes received per rank per step")
    traffic.set_title("traffic: points measured (hollow: derived from bytes sent), lines modelled")
    traffic.legend(fontsize=8)
    fig.suptitle(f"{study.config.name}: {study.describe_batch().split(' (')[0]}")
    return plots.save_figure(fig, path, None)
