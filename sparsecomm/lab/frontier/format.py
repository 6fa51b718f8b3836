"""The frontier for a person: a table of the points with the sparsest equivalent density per
arm, and a plot of time to target against density with the verdict as the marker."""
from pathlib import Path

from sparsecomm.lab.frontier.points import FrontierPoint, sparsest_equivalent
from sparsecomm.lab.sweep import UNAVAILABLE, VERDICT_MARKERS, aligned, fmt


def format_frontier(points: list[FrontierPoint], tolerance: float | None) -> str:
    header = ["arm", "density", "verdict", "loss diff", "steps [s2t]", "time [t2t]", "sent/step",
              "failed runs arm/dense"]
    rows = [header] + [[p.label, f"{p.density:g}", p.verdict, fmt(p.mean_loss_diff), fmt(p.steps_to_target),
                        fmt(p.time_to_target_s, " s"), fmt(p.bytes_per_step, " B"),
                        f"{p.failed}/{p.dense_failed}" + (f" ({p.not_ok})" if p.not_ok else "")] for p in points]
    lines = aligned(rows)
    lines.append("")
    lines.append(f"tolerance: {fmt(tolerance)} in final val loss; targets derived per density from its dense runs; "
                 "steps/time: median over seeds (n/a: not reached in some seed)")
    failed = sum(p.failed for p in points) + sum({p.run_dir: p.dense_failed for p in points}.values())
    lines.append(f"failed runs (any status but ok, or missing; not compared): {failed}"
                 + ("; unavailable: no dense run finished at that density" if any(p.verdict == UNAVAILABLE
                                                                                  for p in points) else ""))
    for arm, point in sparsest_equivalent(points).items():
        lines.append(f"sparsest equivalent {arm}: " + ("none of the densities tried" if point is None else
                                                        f"density {point.density:g} ({point.verdict})"))
    return "\n".join(lines)


def plot_frontier(points: list[FrontierPoint], path: Path) -> Path:
    """Time-to-target vs density (log x), one line per arm, the verdict as the marker.

    Settings that did not reach the target sit on a "not reached" row above the others,
    so every density tried stays visible.
    """
    from sparsecomm.lab import plots

    fig, ax = plots.new_axes()
    arms = {p.label for p in points}
    styles = plots.arm_styles(arms)
    reached_times = [p.time_to_target_s for p in points if p.time_to_target_s is not None]
    ceiling = 1.2 * max(reached_times) if reached_times else 1.0
    for arm in plots.arm_order(arms):
        # An unavailable point has no verdict to mark; the printed table lists it.
        mine = sorted((p for p in points if p.label == arm and p.verdict != UNAVAILABLE), key=lambda p: p.density)
        reached = [p for p in mine if p.time_to_target_s is not None]
        ax.plot([p.density for p in reached], [p.time_to_target_s for p in reached], label=arm, **styles[arm])
        for p in mine:
            y = ceiling if p.time_to_target_s is None else p.time_to_target_s
            ax.plot(p.density, y, marker=VERDICT_MARKERS.get(p.verdict, "s"), color=styles[arm]["color"],
                    markersize=8, fillstyle="none" if p.verdict == "inconclusive" else "full", linestyle="none")
    ax.axhline(ceiling, color="0.6", linewidth=0.8, linestyle=":")
    ax.annotate("not reached", xy=(0.0, ceiling), xycoords=ax.get_yaxis_transform(), xytext=(4, 4),
                textcoords="offset points", fontsize=8, color="0.35")
    ax.set_xscale("log")
    ax.set_ylim(0, ceiling * 1.1)
    ax.set_xlabel("density (fraction of each bucket sent)")
    ax.set_ylabel("time to target [s] (median over seeds)")
    failed = sum(p.failed for p in points) + sum({p.run_dir: p.dense_failed for p in points}.values())
    ax.set_title("density frontier: o equivalent, hollow s inconclusive, x worse"
                 + (f"\n{failed} failed run(s) not compared (see the printed table)" if failed else ""))
    ax.legend()
    return plots.save_figure(fig, path, None)
