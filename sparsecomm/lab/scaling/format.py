"""A scaling study's report: printed, as ``scaling.md`` and ``scaling.json``, and drawn as
``scaling.png`` (the gap to dense and the bytes received per rank, against p).

Sections: per (p, arm) the measured table; each arm's scaling capture (:mod:`.capture`); the
bytes received per rank and their growth against a ring allreduce's; per link of
``--model-link``, the time to target with a modelled step (:mod:`.link_ledger`); the bytes
received at more workers (modelled: :mod:`.modelled`); notes."""
import math
from dataclasses import asdict
from pathlib import Path

from sparsecomm.lab.results.quantity import format_value
from sparsecomm.lab.results.target import DENSE_ARM
from sparsecomm.lab.results.text import fold_lines
from sparsecomm.lab.scaling.capture import captures
from sparsecomm.lab.scaling.link_ledger import MODELLED_LABEL, NOT_MODELLED
from sparsecomm.lab.scaling.modelled import MODELLED_WORLD_SIZES, ModelledTraffic, format_bytes
from sparsecomm.lab.scaling.points import RECEIVED_RING, ScalePoint, growth, ring_growth
from sparsecomm.lab.scaling.study import Study
from sparsecomm.lab.sweep import UNAVAILABLE, VERDICT_MARKERS, aligned, fmt, markdown_table


def _ratio(value) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def _other_steps(study: Study) -> int:
    """Steps of the arms other than dense (dense's x the step budget)."""
    return study.config.steps_of(next(a for a in study.config.arms if a != DENSE_ARM))


def _steps(study: Study) -> str:
    config = study.config
    if config.step_budget == 1:
        return f"{config.steps} steps"
    return (f"{config.steps} steps for dense, {_other_steps(study)} for the other arms (--step-budget "
            f"{config.step_budget:g}: verdict, gap, final metric and capture at step {config.steps}, dense's last; "
            "steps and time to target over the whole run)")


def _header(study: Study, metric: str) -> list[str]:
    config = study.config
    return [
        f"scaling study {config.name}: world sizes {', '.join(map(str, study.world_sizes))}; arms "
        f"{', '.join(config.arms)}; seeds {list(config.seeds)}; {_steps(study)}; link {config.link}",
        study.describe_batch() + "; optimizer settings the same at every p",
        f"verdict: equivalence (TOST) of the final {metric} against dense at the same p over paired seeds, "
        f"tolerance {config.policy.quality_tolerance:g} (fewer than 3 seeds: inconclusive); gap = mean(arm - dense), "
        "> 0 worse",
    ]


def _main_table(study: Study, points: list[ScalePoint], metric: str) -> list[list[str]]:
    budget = study.config.step_budget != 1
    final = f"{metric} @{study.config.steps}" if budget else f"final {metric}"
    rows = [["p", "arm", "batch/rank", "verdict", "gap", final, *([f"{metric} @end"] * budget), "sent/step",
             "recv/step", "steps [s2t]", "time [t2t]", "failed arm/dense", "exposed comm"]]
    rows += [[str(p.world_size), p.arm, str(p.batch_size), p.verdict, fmt(p.metric_gap), fmt(p.final_metric_mean),
              *([fmt(p.budget_metric_mean if p.arm != DENSE_ARM else p.final_metric_mean)] * budget),
              format_bytes(p.bytes_sent_per_step), format_bytes(p.bytes_received_per_step), fmt(p.steps_to_target),
              fmt(p.time_to_target_s, " s"),
              f"{p.failed}/{p.dense_failed}" + (f" ({p.not_ok})" if p.not_ok else ""),
              "n/a" if p.exposed_comm_fraction is None else f"{p.exposed_comm_fraction:.0%}"] for p in points]
    return rows


def _capture_table(study: Study, found) -> list[list[str]]:
    low, larger = study.world_sizes[0], study.world_sizes[1:]
    rows = [["arm", *(f"capture p={low}->{p}" for p in larger)]]
    by = {(c.arm, c.world_size): c for c in found}
    for arm in dict.fromkeys(c.arm for c in found):
        rows.append([arm, *("undefined" if by[(arm, p)].undefined else by[(arm, p)].shown() for p in larger)])
    return rows


def _growth_table(study: Study, points: list[ScalePoint], modelled: list[ModelledTraffic]) -> list[list[str]]:
    sizes = study.world_sizes
    low, high = sizes[0], sizes[-1]
    model = {m.arm: m for m in modelled}
    rows = [["arm", *(f"recv/step p={p}" for p in sizes),
             *(cell for p in sizes[1:] for cell in (f"growth p={low}->{p}", f"/ ring {ring_growth(low, p):.2f}x")),
             f"growth p={low}->{high} (modelled)"]]
    for arm in study.config.arms:
        at = {p.world_size: p.bytes_received_per_step for p in points if p.arm == arm}
        m = model.get(arm)
        modelled_growth = (m.bytes_received[high] / m.bytes_received[low]
                           if m is not None and m.bytes_received.get(low) and m.bytes_received.get(high) is not None
                           else None)
        grown = [growth(points, arm, low, p) for p in sizes[1:]]
        rows.append([arm, *(format_bytes(at.get(p)) for p in sizes),
                     *(cell for g, p in zip(grown, sizes[1:])
                       for cell in (_ratio(g), "n/a" if g is None else f"{g / ring_growth(low, p):.2f}")),
                     _ratio(modelled_growth)])
    return rows


def _link_table(ledger) -> list[list[str]]:
    rows = [["p", "arm", "steps [s2t] (measured)", "step (modelled)", "comm (modelled)", "time [t2t] (modelled)",
             "vs dense (modelled)", "model"]]
    rows += [[str(q.world_size), q.arm, fmt(q.steps_to_target), q.step.shown,
              "n/a" if q.comm_s is None else format_value(q.comm_s, "s"), q.time_to_target.shown, _ratio(q.speedup),
              q.mode] for q in ledger.points]
    return rows


def _sections(study: Study, points, modelled, metric: str, link_ledgers) -> list[tuple[str, list[list[str]]]]:
    """(title, rows) of every table after the main one, in the order printed."""
    low = study.world_sizes[0]
    at = f" at step {study.config.steps}" if study.config.step_budget != 1 else ""
    sections = [
        (f"scaling capture: the share of dense's gain in final {metric}{at} from p={low} to p that each arm keeps "
         "(mean over paired seeds [90% CI]; 1 all of it, 0 none, < 0 it loses quality as p grows)",
         _capture_table(study, captures(points, study.world_sizes, study.config.arms, study.config.mode))),
        (f"bytes received per rank per step, and their growth from p={low} against a ring allreduce's (dense's own, "
         "2(p-1)/p; / ring: 1 grows like dense)", _growth_table(study, points, modelled)),
    ]
    sections += [(f"does it pay at p workers on {ledger.link}? time to target, MODELLED: compute measured at "
                  f"p={ledger.low}, communication by the alpha-beta model on {ledger.link}",
                  _link_table(ledger)) for ledger in link_ledgers]
    sections.append(("modelled bytes received per rank per step at more workers",
                     [["arm (modelled)", *(f"p={p}" for p in MODELLED_WORLD_SIZES)]]
                     + [[m.arm, *(format_bytes(m.bytes_received.get(p)) for p in MODELLED_WORLD_SIZES)]
                        for m in modelled]))
    return sections


def _notes(study: Study, points: list[ScalePoint], modelled: list[ModelledTraffic], model_p: int | None,
           link_ledgers) -> list[str]:
    lines = ["bytes per rank per step (rank 0): sent = mean over the steps after warm-up (every arm's hook "
             "metered); received:"]
    sources = {}
    for p in points:
        if p.received_source:
            sources.setdefault(p.arm, p.received_source)
    lines += [f"  {arm}: {source}" for arm, source in sources.items()]
    lines.append("steps/time to target: median over seeds (n/a: not reached in some seed), against a target derived "
                 "at each p from that p's dense runs (median final + tolerance)")
    if study.config.step_budget != 1:
        lines.append(f"step budget: the arms but dense train {_other_steps(study)} steps, dense {study.config.steps}; "
                     f"every run is evaluated at step {study.config.steps}, where it is judged (the lab's lr is "
                     f"constant, so a longer run's first {study.config.steps} steps are the shorter run's); '@end': "
                     "the metric at the arm's own last step")
    undefined = [c for c in captures(points, study.world_sizes, study.config.arms, study.config.mode) if c.undefined]
    if undefined:
        lines.append("capture undefined (dense has no gain to share, or it is within noise):")
        lines += [f"  {c.arm} p={c.low}->{c.world_size}: {c.undefined}" for c in undefined]
    failed = sum(p.failed for p in points if p.arm != DENSE_ARM) + sum(
        {p.run_dir: p.dense_failed for p in points}.values())
    lines.append(f"failed runs (any status but ok, or missing; not compared): {failed}"
                 + ("; unavailable: no dense run finished at that p" if any(p.verdict == UNAVAILABLE for p in points)
                    else ""))
    for ledger in link_ledgers:
        lines.append(f"time to target on {ledger.link}: {MODELLED_LABEL}:")
        lines += [f"  {line}" for line in ledger.assumptions]
        remarks = {}  # the model's notes on an arm, and why it has none, once with every p they apply to
        for q in ledger.points:
            if q.note:
                remarks.setdefault((q.arm, q.mode == NOT_MODELLED, q.note), []).append(str(q.world_size))
        lines += [f"  {arm}{' not modelled' * missing} at p={', '.join(sizes)}: {note}"
                  for (arm, missing, note), sizes in remarks.items()]
    if not link_ledgers:
        lines.append("time to target on a link (modelled): give --model-link RATE, e.g. --model-link 100mbit 1gbit")
    if model_p is None:
        lines.append("modelled: not available (no world size with a finished dense run to start from)")
    else:
        lines.append(f"modelled (alpha-beta cost model, sparsecomm.lab.costmodel; never measured): bytes received per "
                     f"rank per step from the bytes per step measured at p={model_p}, per-rank traffic as at that p:")
        lines += [f"  {m.arm}: {m.how}" for m in modelled]
    return lines


def format_study(study: Study, points, modelled, model_p, metric: str, link_ledgers=()) -> str:
    """The report as printed; ``link_ledgers``: :class:`~.link_ledger.LinkLedger` per --model-link."""
    lines = [*fold_lines(_header(study, metric)), "", *aligned(_main_table(study, points, metric))]
    for title, rows in _sections(study, points, modelled, metric, link_ledgers):
        lines += ["", *fold_lines([f"{title}:"]), *aligned(rows)]
    lines += ["", *fold_lines(_notes(study, points, modelled, model_p, link_ledgers))]
    return "\n".join(lines)


def markdown_study(study: Study, points, modelled, model_p, metric: str, link_ledgers=()) -> str:
    lines = [f"# Scaling study: {study.config.name}", "", *(f"- {line}" for line in _header(study, metric)), "",
             "## Per world size and arm (measured)", "", *markdown_table(_main_table(study, points, metric))]
    for title, rows in _sections(study, points, modelled, metric, link_ledgers):
        lines += ["", f"## {title[0].upper()}{title[1:]}", "", *markdown_table(rows)]
    lines += ["", "## Notes", "",
              *(line.replace("  ", "  - ", 1) if line.startswith("  ") else f"- {line}"
                for line in _notes(study, points, modelled, model_p, link_ledgers)), "", "![scaling](scaling.png)", ""]
    return "\n".join(lines)


def study_json(study: Study, points, modelled, model_p, metric: str, link_ledgers=()) -> dict:
    config = study.config
    sizes = study.world_sizes
    low, high = sizes[0], sizes[-1]
    found = captures(points, sizes, config.arms, config.mode)
    return {
        "study": {"experiment": config.name, "world_sizes": list(sizes), "batch": study.batch,
                  "batch_per_rank": {str(p): study.batch_size(p) for p in sizes},
                  "global_batch": {str(p): study.batch_size(p) * p for p in sizes},
                  "experiments": {str(p): study.point_config(p).name for p in sizes},
                  "arms": list(config.arms), "seeds": list(config.seeds), "steps": config.steps,
                  "step_budget": config.step_budget, "steps_other_arms": _other_steps(study), "link": config.link,
                  "metric": metric, "mode": config.mode, "tolerance": config.policy.quality_tolerance},
        "points": [asdict(p) for p in points],
        "capture": {arm: {str(c.world_size): {
            "from": c.low, "mean": c.mean, "ci_low": c.ci_low, "ci_high": c.ci_high, "ci": c.ci,
            "seeds": list(c.seeds), "per_seed": {str(s): v for s, v in c.per_seed.items()},
            "dense_gain": {str(s): v for s, v in c.dense_gain.items()},
            "arm_gain": {str(s): v for s, v in c.arm_gain.items()}, "undefined": c.undefined or None}
            for c in found if c.arm == arm} for arm in dict.fromkeys(c.arm for c in found)},
        "growth_of_bytes_received": {arm: {
            "from": low, "to": high, "measured": growth(points, arm, low, high),
            "by_world_size": {str(p): {"measured": (g := growth(points, arm, low, p)), "ring": ring_growth(low, p),
                                       "over_ring": None if g is None else g / ring_growth(low, p)}
                              for p in sizes[1:]}} for arm in config.arms},
        "modelled_time_to_target": {ledger.link: {
            "label": MODELLED_LABEL, "compute_from_world_size": ledger.low, "assumptions": list(ledger.assumptions),
            "points": [q.to_json() for q in ledger.points]} for ledger in link_ledgers},
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
