"""Figures of an experiment's run directory (drawn by ``sparsecomm plot RUN_DIR [--out DIR]``,
:mod:`sparsecomm.lab.plot_command`, and by the report of ``sparsecomm compare``).

* ``time_to_loss.png``: validation loss against wall clock since the run's first data
  touch (evaluation included), one line per arm: the mean over seeds, with a shaded band
  from the best to the worst seed, and the quality target as a dashed horizontal line.
* ``loss_vs_step.png``: the same against optimizer steps, plus the seed-mean training
  loss (moving average) as a thin faint line of the arm's colour.
* ``ledger.png``: the time-to-quality ledger per arm as stacked horizontal bars (setup,
  step time x steps to target, checkpoint, recovery); what was not measured is written
  next to the bar, never drawn as zero. An arm that did not reach the target is drawn at
  its whole budget (step time x all configured steps) as a pale hatched segment labelled
  "not reached in N steps", so that it never looks like the cheapest bar.

Runs that did not finish (status other than "ok": failed, interrupted, invalid; or ok
without evaluations) are not drawn but counted: per arm in the legend ("topk-ef (2 seeds,
1 interrupted)"), and in a note under every figure of :func:`plot_run_dir` that names
each such run and its status.

Colours are Okabe-Ito (colour-blind safe), fixed per arm name; every arm also has its own
line style and every ledger segment its own hatching, so the figures survive greyscale.
Reads result files only: no torch needed.
"""
import io
import math
import sys
import textwrap
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
# The Figure API with an explicit Agg canvas is headless and, unlike matplotlib.use("Agg")
# + pyplot, neither touches the caller's backend nor keeps figures alive in pyplot's registry.
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from sparsecomm.lab.experiment.files import write_bytes_atomically
from sparsecomm.lab.results import (
    RunSummary,
    describe_counts,
    experiment_link,
    load_experiment,
    load_runs,
    load_steps,
    status_counts,
)
from sparsecomm.lab.results.layout import STEPS_FILE
from sparsecomm.lab.results.target import DENSE_ARM, Target, resolve_target

OKABE_ITO = ("#000000", "#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7")
PREFERRED_ARM_ORDER = ("dense", "dense-bf16", "powersgd", "topk-ef", "topk-noef", "topk-dgc", "sparseloco",
                       "topk-sign")
# Non-dense colours in assignment order; black is kept for dense. Yellow goes last because
# a thin yellow line is nearly invisible on white.
_ARM_COLOURS = ("#E69F00", "#56B4E9", "#009E73", "#D55E00", "#0072B2", "#CC79A7", "#F0E442")
_ARM_LINESTYLES = (
    "--", "-.", ":", (0, (3, 1, 1, 1, 1, 1)), (0, (5, 1)), (0, (1, 2, 5, 2)), (0, (8, 2, 2, 2)),
)
SEGMENTS = ("setup", "step x steps", "checkpoint", "recovery")
STEP_SEGMENT = "step x steps"
_SEGMENT_COLOURS = ("#56B4E9", "#0072B2", "#E69F00", "#D55E00", "#009E73", "#CC79A7", "#F0E442")
_SEGMENT_HATCHES = ("", "//", "..", "xx", "\\\\", "++", "oo")
# Not ledger segments: what an arm that never reached the target is drawn with (ledger_items_for_plot).
BUDGET_KEYS = ("target_reached", "budget_steps", "budget_seconds")
# Open-looking (pale, dashed outline, dense hatch) where a reached arm has its step x steps segment.
NOT_REACHED_BAR = {"facecolor": "0.93", "hatch": "////", "edgecolor": "0.35", "linestyle": "--", "linewidth": 0.8}
NOT_REACHED_GID = "not reached"
NOT_REACHED_LABEL = "not reached: step x all steps (a lower bound)"

TIME_XLABEL = "wall clock since first data touch (s), evaluation included"
_GRID_POINTS = 200
_DPI = 120


def arm_order(arms: Iterable[str]) -> list[str]:
    """Distinct arm names: the preferred order first, then other names as they first appear."""
    seen = list(dict.fromkeys(arms))
    known = [a for a in PREFERRED_ARM_ORDER if a in seen]
    return known + [a for a in seen if a not in PREFERRED_ARM_ORDER]


def arm_styles(arms: Iterable[str]) -> dict[str, dict]:
    """``{arm: {"color", "linestyle"}}`` for ``Axes.plot(**style)``.

    Known arms keep the same colour and style in every figure and experiment whatever the
    other arms are; unknown names take the slots after the known ones.
    """
    styles = {}
    ordered = arm_order(arms)
    # Other names take the slots the known arms of this figure leave free (then wrap).
    taken = {PREFERRED_ARM_ORDER.index(a) - 1 for a in ordered if a in PREFERRED_ARM_ORDER and a != DENSE_ARM}
    free = [s for s in range(len(_ARM_COLOURS)) if s not in taken] or list(range(len(_ARM_COLOURS)))
    others = 0
    for arm in ordered:
        if arm == DENSE_ARM:
            styles[arm] = {"color": OKABE_ITO[0], "linestyle": "-"}
            continue
        if arm in PREFERRED_ARM_ORDER:
            slot = PREFERRED_ARM_ORDER.index(arm) - 1
        else:
            slot = free[others % len(free)]
            others += 1
        styles[arm] = {"color": _ARM_COLOURS[slot % len(_ARM_COLOURS)],
                       "linestyle": _ARM_LINESTYLES[slot % len(_ARM_LINESTYLES)]}
    return styles


def _mean_band(curves: Sequence[tuple[Sequence[float], Sequence[float]]], grid) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean, min and max over ``curves`` (each ``(xs, ys)``), linearly interpolated onto ``grid``."""
    if not curves:
        raise ValueError("no curves to average")
    grid = np.asarray(grid, dtype=float)
    values = []
    for xs, ys in curves:
        xs, ys = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
        order = np.argsort(xs, kind="stable")
        values.append(np.interp(grid, xs[order], ys[order]))
    stacked = np.vstack(values)
    return stacked.mean(axis=0), stacked.min(axis=0), stacked.max(axis=0)


def _common_grid(curves: Sequence[tuple[Sequence[float], Sequence[float]]], points: int = _GRID_POINTS) -> np.ndarray:
    """Where every curve has data: from the latest first x to the earliest last x.

    Starts at 0 when every seed evaluates at time 0; never extrapolates a seed past its
    own ends, which would invent losses it never measured.
    """
    start = max(min(xs) for xs, _ in curves)
    end = min(max(xs) for xs, _ in curves)
    if end <= start:
        return np.array([float(end)])
    return np.linspace(float(start), float(end), points)


def _moving_average(values: Sequence[float], window: int) -> np.ndarray:
    """Trailing simple moving average; ``len(values) - window + 1`` points."""
    values = np.asarray(values, dtype=float)
    window = max(1, min(int(window), len(values)))
    return np.convolve(values, np.ones(window) / window, mode="valid")


def _by_arm(runs: list[RunSummary]) -> dict[str, dict]:
    """Per arm, in plotting order: the plottable runs and the counts of the others."""
    groups = {arm: {"ok": [], "not_ok": {}} for arm in arm_order(r.arm for r in runs)}
    for arm, group in groups.items():
        mine = [r for r in runs if r.arm == arm]
        group["ok"] = [r for r in mine if r.finished]
        group["not_ok"] = status_counts(mine)  # {"failed": 1, "interrupted": 2, "no evaluations": 1}
    return groups


def _arm_label(arm: str, group: dict) -> str:
    n_ok = len(group["ok"])
    notes = [f"{n_ok} seed{'s' if n_ok != 1 else ''}"] if n_ok else []
    notes += [f"{n} {status}" for status, n in group["not_ok"].items()]
    return f"{arm} ({', '.join(notes)})"


def not_drawn_note(runs: list[RunSummary], max_listed: int = 6) -> str:
    """The note under a figure naming the runs that did not finish ("" when every run did)."""
    bad = [r for r in runs if not r.finished]
    if not bad:
        return ""
    listed = [f"{r.arm} seed {r.seed} {r.status if r.status != 'ok' else 'without evaluations'}"
              for r in bad[:max_listed]]
    more = f", and {len(bad) - max_listed} more" if len(bad) > max_listed else ""
    return (f"not drawn, counted as failed: {len(bad)} of {len(runs)} runs "
            f"({describe_counts(status_counts(bad))}): {', '.join(listed)}{more}")


def _draw_note(fig: Figure, note: str) -> None:
    if note:
        # Above the title: the ledger's legend takes the bottom edge.
        fig.text(0.01, 1.0, textwrap.fill(note, 150), ha="left", va="bottom", fontsize=7, color="0.25")


def new_axes(figsize=(8.0, 5.0)):
    """A figure of the lab's (no pyplot state; drawn by the Agg canvas) and its one axes."""
    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def save_figure(fig: Figure, path, on_figure: Callable[[Figure], None] | None = None) -> Path:
    """Write ``fig`` to ``path`` as a PNG (``on_figure`` sees it first); returns the path."""
    if on_figure is not None:
        on_figure(fig)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=_DPI, bbox_inches="tight")
    # A temporary name, then a rename: a link planted at ``path`` is replaced, never written through.
    write_bytes_atomically(path, image.getvalue())
    return path


def _draw_target(ax, target: Target | None) -> None:
    if target is None:
        return
    ax.axhline(target.val_loss, color="0.35", linewidth=1.0, linestyle=(0, (6, 4)), zorder=1)
    # Left end: loss curves are still high there, so the label rarely sits on a line.
    ax.annotate(f"target {target.val_loss:.4f}", xy=(0.0, target.val_loss), xycoords=ax.get_yaxis_transform(),
                xytext=(4, 3), textcoords="offset points", ha="left", va="bottom", fontsize=8, color="0.25")


def _draw_mean_band(ax, x, mean, lo, hi, style: dict, label: str) -> None:
    marker = "o" if len(x) == 1 else None
    ax.fill_between(x, lo, hi, color=style["color"], alpha=0.18, linewidth=0)
    ax.plot(x, mean, linewidth=1.8, marker=marker, label=label, **style)


def _finish_legend(ax, groups: dict, styles: dict, drawn: set[str], extra_handles: list) -> None:
    handles, _ = ax.get_legend_handles_labels()
    for arm, group in groups.items():
        if arm not in drawn:  # no line to point at: an "x" marks the arm in the legend only
            handles.append(Line2D([], [], color=styles[arm]["color"], linestyle="none", marker="x",
                                  label=_arm_label(arm, group)))
    if drawn:
        handles += extra_handles
    if handles:
        ax.legend(handles=handles, fontsize=8, loc="upper right")


def plot_time_to_loss(runs: list[RunSummary], target: Target | None, path, *, link: str | None = None,
                      note: str = "", on_figure: Callable[[Figure], None] | None = None) -> Path:
    """Validation loss against wall clock: per arm the seed mean and the min-max band.

    ``link``: the link the runs were measured over, named in the title (wall clock
    depends on it). ``on_figure`` (tests) is called with the finished figure before it is saved.
    """
    groups = _by_arm(runs)
    styles = arm_styles(groups)
    fig, ax = new_axes()
    drawn = set()
    for arm, group in groups.items():
        if not group["ok"]:
            continue
        curves = [([e.elapsed_seconds for e in r.evals], [e.val_loss for e in r.evals]) for r in group["ok"]]
        grid = _common_grid(curves)
        _draw_mean_band(ax, grid, *_mean_band(curves, grid), styles[arm], _arm_label(arm, group))
        drawn.add(arm)
    _draw_target(ax, target)
    ax.set_title("time to loss" + (f", ranks linked by {link}" if link else ""))
    ax.set_xlabel(TIME_XLABEL)
    ax.set_ylabel(_metric_axis_label(target))
    ax.grid(True, alpha=0.3)
    band = Patch(facecolor="0.5", alpha=0.3, label="shaded: min to max over seeds")
    _finish_legend(ax, groups, styles, drawn, [band])
    _draw_note(fig, note)
    return save_figure(fig, path, on_figure)


def _metric_axis_label(target: Target | None) -> str:
    """The y axis of the metric: "validation loss" for the built-in metric, else its name."""
    return "validation loss" if target is None or target.metric == "val_loss" else target.metric


def _train_curve(runs: list[RunSummary]) -> tuple[np.ndarray, np.ndarray] | None:
    """Seed-mean training loss over the steps every seed logged, or None without logs."""
    per_seed = []
    for run in runs:
        if not (Path(run.path) / STEPS_FILE).is_file():
            continue
        rows = load_steps(run.path)
        # A step logged twice (resumed run) keeps its last value.
        losses = {int(r["step"]): float(r["train_loss"]) for r in rows
                  if r.get("kind") == "train" and r.get("train_loss") is not None}
        if losses:
            per_seed.append(losses)
    if not per_seed:
        return None
    steps = sorted(set.intersection(*(set(s) for s in per_seed)))
    if not steps:
        return None
    return np.array(steps, dtype=float), np.array([np.mean([s[k] for s in per_seed]) for k in steps])


def plot_loss_vs_step(runs: list[RunSummary], target: Target | None, path, *, note: str = "",
                      on_figure: Callable[[Figure], None] | None = None) -> Path:
    """Validation loss against step (seed mean and min-max band) plus the smoothed train loss."""
    groups = _by_arm(runs)
    styles = arm_styles(groups)
    fig, ax = new_axes()
    drawn = set()
    any_train = False
    for arm, group in groups.items():
        if not group["ok"]:
            continue
        evals = [{e.step: e.val_loss for e in r.evals} for r in group["ok"]]
        steps = sorted(set.intersection(*(set(e) for e in evals)))
        # The training loss shares the axis only with a loss (not with, say, an accuracy).
        train = _train_curve(group["ok"]) if _metric_axis_label(target) == "validation loss" else None
        if train is not None:
            train_steps, train_loss = train
            window = max(1, len(train_steps) // 50)
            ax.plot(train_steps[window - 1:], _moving_average(train_loss, window), color=styles[arm]["color"],
                    linewidth=0.8, alpha=0.35, zorder=1)
            any_train = True
        if not steps:
            continue
        curves = [(steps, [e[s] for s in steps]) for e in evals]
        _draw_mean_band(ax, steps, *_mean_band(curves, steps), styles[arm], _arm_label(arm, group))
        drawn.add(arm)
    _draw_target(ax, target)
    ax.set_title("loss vs step" if _metric_axis_label(target) == "validation loss" else
                 f"{_metric_axis_label(target)} vs step")
    ax.set_xlabel("step")
    ax.set_ylabel("loss" if _metric_axis_label(target) == "validation loss" else _metric_axis_label(target))
    ax.grid(True, alpha=0.3)
    extra = [Patch(facecolor="0.5", alpha=0.3, label="shaded: min to max over seeds")]
    if any_train:
        extra.append(Line2D([], [], color="0.3", linewidth=0.8, alpha=0.5, label="faint: train loss, seed mean, moving avg"))
    _finish_legend(ax, groups, styles, drawn, extra)
    _draw_note(fig, note)
    return save_figure(fig, path, on_figure)


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _segments(items: dict[str, dict]) -> list[str]:
    extra = dict.fromkeys(k for values in items.values() for k in values if k not in SEGMENTS + BUDGET_KEYS)
    return list(SEGMENTS) + list(extra)


def _not_reached_seconds(values: dict) -> float | None:
    """The seconds an arm that never reached the target spent on steps (its whole budget), or
    None: it reached the target, or its budget is not known."""
    if values.get("target_reached") is False and not _missing(values.get("budget_seconds")):
        return values["budget_seconds"]
    return None


def ledger_annotation(values: dict[str, float | int | bool | None]) -> str:
    """What is written next to one arm's ledger bar about missing segments ("" if none).

    ``target_reached`` None means no finished run. A missing "step x steps" means the target
    was not reached: "not reached in N steps" when ``budget_steps`` is known. Any other missing
    segment (None, NaN or absent key) was not measured.
    """
    if "target_reached" in values and values["target_reached"] is None:
        return "no finished run"
    notes = []
    if _missing(values.get(STEP_SEGMENT)):
        budget = values.get("budget_steps")
        notes.append(f"not reached in {budget} steps" if budget else "target not reached")
    unmeasured = [s for s in _segments({"": values}) if s != STEP_SEGMENT and _missing(values.get(s))]
    if unmeasured:
        notes.append(f"{', '.join(unmeasured)}: not measured")
    return "; ".join(notes)


LEDGER_TITLE = "time-to-quality ledger (median over seeds)"


def plot_ledger_items(items: dict[str, dict[str, float | int | bool | None]], path, *,
                      title: str = LEDGER_TITLE, note: str = "",
                      on_figure: Callable[[Figure], None] | None = None) -> Path:
    """Stacked horizontal bars of seconds per ledger segment, one bar per arm.

    ``items[arm]``: seconds per segment (None: not measured), and optionally the keys of
    :data:`BUDGET_KEYS` (see :func:`sparsecomm.lab.ledger.ledger_items_for_plot`). An arm
    that did not reach the target has no "step x steps"; with ``target_reached`` False and a
    ``budget_seconds`` it is drawn at its whole budget, hatched, so that it never looks cheap.
    """
    arms = arm_order(items)
    segments = _segments(items)
    fig, ax = new_axes(figsize=(8.0, 1.6 + 0.55 * max(1, len(arms))))
    totals = {arm: _draw_bar(ax, index, items[arm], segments) for index, arm in enumerate(arms)}
    widest = max(totals.values(), default=0.0)
    for arm_index, arm in enumerate(arms):
        annotation = ledger_annotation(items[arm])
        # The sum is only the ledger total when nothing is missing.
        text = annotation if annotation else f"{totals[arm]:.1f} s"
        ax.annotate(text, xy=(totals[arm], arm_index), xytext=(4, 0), textcoords="offset points",
                    ha="left", va="center", fontsize=7 if annotation else 8, color="0.15")
    ax.set_yticks(range(len(arms)), arms)
    ax.set_ylim(max(1, len(arms)) - 0.5, -0.5)  # first arm on top
    ax.set_xlim(0, widest * 1.15 if widest > 0 else 1.0)
    ax.set_xlabel("seconds")
    ax.set_title(title)
    ax.grid(True, axis="x", alpha=0.3)
    if not arms:
        ax.text(0.5, 0.5, "no ledger items", transform=ax.transAxes, ha="center", va="center")
    handles = [Patch(facecolor=_SEGMENT_COLOURS[i % len(_SEGMENT_COLOURS)], hatch=_SEGMENT_HATCHES[i % len(_SEGMENT_HATCHES)],
                     edgecolor="0.15", linewidth=0.6, label=segment) for i, segment in enumerate(segments)]
    if any(_not_reached_seconds(values) is not None for values in items.values()):
        handles.append(Patch(**NOT_REACHED_BAR, label=NOT_REACHED_LABEL))
    fig.legend(handles=handles, fontsize=8, loc="outside lower center", ncol=min(4, len(handles)), frameon=False)
    _draw_note(fig, note)
    return save_figure(fig, path, on_figure)


def _draw_bar(ax, arm_index: int, values: dict, segments: list[str]) -> float:
    """One arm's stacked bar; returns where it ends (seconds)."""
    left = 0.0
    for seg_index, segment in enumerate(segments):
        value = values.get(segment)
        not_reached = _not_reached_seconds(values) if segment == STEP_SEGMENT else None
        if not_reached is not None:
            ax.barh(arm_index, not_reached, left=left, height=0.6, gid=NOT_REACHED_GID, **NOT_REACHED_BAR)
            left += not_reached
        elif not _missing(value):
            ax.barh(arm_index, value, left=left, height=0.6, color=_SEGMENT_COLOURS[seg_index % len(_SEGMENT_COLOURS)],
                    hatch=_SEGMENT_HATCHES[seg_index % len(_SEGMENT_HATCHES)], edgecolor="0.15", linewidth=0.6)
            left += value
    return left


def plot_run_dir(run_dir, out_dir, ledger_items: dict | None = None) -> list[Path]:
    """Write ``time_to_loss.png``, ``loss_vs_step.png`` (and ``ledger.png``) into ``out_dir``."""
    experiment = load_experiment(run_dir)
    runs = load_runs(run_dir)
    try:
        target = resolve_target(experiment, runs)
    except ValueError as e:
        print(f"sparsecomm plot: no target line: {e}", file=sys.stderr)
        target = None
    out_dir = Path(out_dir)
    link = experiment_link(experiment)
    note = not_drawn_note(runs)
    paths = [plot_time_to_loss(runs, target, out_dir / "time_to_loss.png", link=link, note=note),
             plot_loss_vs_step(runs, target, out_dir / "loss_vs_step.png", note=note)]
    if ledger_items is not None:
        paths.append(plot_ledger_items(ledger_items, out_dir / "ledger.png",
                                       title=f"{LEDGER_TITLE}, ranks linked by {link}", note=note))
    return paths
