"""``sparsecomm frontier``: the sparsest setting that still passes the declared tolerance.

Runs the paired experiment once per density (dense + the chosen sparse arms, same seeds
and data order), judges each sparse arm against that density's dense runs with the
equivalence test, and reports per (arm, density): the verdict, steps- and time-to-target
over the link (loopback, or ``--link 1gbit`` for an emulated one), bytes per step, and
the sparsest density whose verdict is ``equivalent``. A plot shows time-to-target against
density with the verdict as the marker::

    sparsecomm frontier --experiment digits-quick --densities 0.01 0.05 --arms topk-ef topk-dgc
    sparsecomm frontier --densities 0.001 0.003 0.01 --arms topk-ef topk-dgc --seeds 0 1 2
    sparsecomm frontier --densities 0.003 0.01 --arms topk-dgc --link 1gbit     # files named <experiment>-1gbit
    sparsecomm frontier --densities 0.01 0.03 --arms topk-dgc --selector chunk --index-codec rice \
        --value-codecs fp32 int4 int2                                              # density x value codec

With ``--value-codecs`` each density runs once per codec (one experiment each, named
``...-d<density>-<wire>``). The dense runs, which neither the density nor the wire
changes, run once per seed and are reused (copied) by the other points' experiments, also
across frontiers.

Runs that did not finish (any status other than "ok") are counted per point (``failed``,
``dense_failed``, with their statuses) and printed; a density whose dense runs all failed
has the verdict ``unavailable`` (nothing to compare against), never a guess. Exit codes:
0 the frontier was printed; 2 a bad argument or an unreadable result file; 130 / 143
stopped by Ctrl-C / SIGTERM (what was kept is printed).
"""
import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from sparsecomm.lab.experiment.compare import (
    add_experiment_source,
    add_job_arguments,
    add_link_argument, add_parallelism_argument,
    check_launcher_possible,
    check_link_possible,
    check_local_world_size,
    check_writable_directory,
    experiment_from_source,
    parse_arguments,
    parse_arms,
    with_job_overrides,
)
from sparsecomm.compress.index_codecs import INDEX_CODECS
from sparsecomm.hooks.config import EXCHANGE_CHOICES
from sparsecomm.compress.value_codecs import VALUE_CODECS
from sparsecomm.lab.experiment.config import ARM_NAMES
from sparsecomm.lab.sweep import UNAVAILABLE, VERDICT_MARKERS, aligned, run_and_read, run_point
from sparsecomm.lab.sweep import fmt as _fmt

SPARSE_ARMS = tuple(arm for arm in ARM_NAMES if arm.startswith("topk-"))


@dataclass(frozen=True)
class FrontierPoint:
    arm: str
    density: float
    verdict: str
    mean_loss_diff: float | None  # arm - dense, final validation loss, paired seeds
    steps_to_target: float | None  # median over seeds; None if not reached in some seed
    time_to_target_s: float | None
    bytes_per_step: float | None
    run_dir: str
    failed: int = 0  # this arm's runs that did not finish (any status but "ok")
    dense_failed: int = 0  # the same for dense at this density
    not_ok: str = ""  # their statuses, e.g. "arm: 1 interrupted; dense: 2 failed"
    value_codec: str | None = None  # swept with --value-codecs (None: the experiment's own)

    @property
    def label(self) -> str:
        """The arm, with the value codec when the frontier sweeps codecs."""
        return self.arm if self.value_codec is None else f"{self.arm} {self.value_codec}"


def _density_name(base: str, density: float | str) -> str:
    """The name of a frontier's experiment at ``density`` (a number, or a glob pattern)."""
    return f"{base}-frontier-d{density if isinstance(density, str) else format(density, 'g')}"


def _wire_parts(config, value_codec: str | None) -> list[str]:
    """The wire settings that are not the default, e.g. ["chunk", "rice", "int4"]."""
    parts = []
    if config.selector != "exact":
        parts.append(config.selector + ("" if config.chunk_size == 4096 else str(config.chunk_size)))
    if config.index_codec != "int32":
        parts.append(config.index_codec)
    if (value_codec or config.value_codec) is not None:
        parts.append(value_codec or config.value_codec)
    if config.exchange != "allgather":
        parts.append(config.exchange)
    return parts


def _experiment_name(config, density: float, value_codec: str | None) -> str:
    """``<base>-frontier-d<density>``, then the wire where it is not the default (so frontiers
    over different wires keep apart), e.g. ``...-d0.01-chunk-rice-int4``."""
    return "-".join([_density_name(config.name, density), *_wire_parts(config, value_codec)])


def frontier_stem(config, value_codecs) -> str:
    """Name of the frontier's summary and plot folder: ``<base>[-<wire>][-codecs]-frontier``."""
    parts = _wire_parts(config, value_codecs[0] if len(value_codecs) == 1 else None)
    return "-".join([config.name, *parts, *(["codecs"] if len(value_codecs) > 1 else []), "frontier"])


def point_config(config, density: float, arms, value_codec: str | None):
    """The experiment behind the points of one (density, value codec)."""
    overrides = {"value_codec": value_codec} if value_codec is not None else {}
    return config.with_overrides(arms=("dense", *arms), density=density,
                                 name=_experiment_name(config, density, value_codec), **overrides)


def _reuse_dense_runs(target, base_name: str, out_root: Path) -> None:
    """Copy finished dense runs from sibling frontier experiments (other densities and
    wires) into ``target`` when they are the same runs: the same run hash, which neither
    the density nor the wire settings enter for dense."""
    import shutil

    from sparsecomm.lab.experiment.files import private_directory
    from sparsecomm.lab.experiment.runner import finished_ok, run_directory

    for seed in target.seeds:
        expected = target.run_hash("dense", seed)
        wanted = run_directory(target, out_root, "dense", seed)
        if wanted.exists():
            continue
        for done in sorted(out_root.glob(f"{_density_name(base_name, '*')}/runs/{wanted.name}")):
            if finished_ok(done, expected):
                private_directory(wanted.parent, out_root)  # never through a planted link
                shutil.copytree(done, wanted)
                break


def run_frontier(config, densities, arms, out_root: Path, value_codecs=(None,)) -> list[FrontierPoint]:
    """One paired experiment per density (and value codec); returns a point per (arm, density, codec)."""
    points = []
    for density, value_codec in [(d, c) for d in densities for c in value_codecs]:
        per_density = point_config(config, density, arms, value_codec)
        _reuse_dense_runs(per_density, config.name, out_root)
        codec_text = "" if value_codec is None else f", value codec {value_codec}"
        print(f"frontier: density {density:g}{codec_text}: {len(per_density.arms)} arms x {len(per_density.seeds)} "
              "seeds", flush=True)
        outcome = run_point(per_density, out_root)
        if not outcome.available:
            points += [FrontierPoint(arm, density, UNAVAILABLE, None, None, None, None, str(outcome.run_dir),
                                     **outcome.failures(arm), value_codec=value_codec) for arm in arms]
            continue
        for result in outcome.report.arms:
            entry = outcome.ledger.arm(result.arm)
            points.append(FrontierPoint(
                arm=result.arm,
                density=density,
                verdict=result.equivalence.verdict,
                mean_loss_diff=result.equivalence.mean_diff,
                steps_to_target=entry.steps_to_target.value,
                time_to_target_s=entry.time_to_target.value,
                bytes_per_step=entry.bytes_per_step.value,
                run_dir=str(outcome.run_dir),
                **outcome.failures(result.arm),
                value_codec=value_codec,
            ))
    return points


def sparsest_equivalent(points: list[FrontierPoint]) -> dict[str, FrontierPoint | None]:
    """Per arm (and value codec), the lowest density whose verdict is equivalent (or better)."""
    best: dict[str, FrontierPoint | None] = {}
    for point in points:
        best.setdefault(point.label, None)
        if point.verdict in ("equivalent", "better"):
            if best[point.label] is None or point.density < best[point.label].density:
                best[point.label] = point
    return best


def format_frontier(points: list[FrontierPoint], tolerance: float | None) -> str:
    header = ["arm", "density", "verdict", "loss diff", "steps [s2t]", "time [t2t]", "sent/step",
              "failed runs arm/dense"]
    rows = [header] + [[p.label, f"{p.density:g}", p.verdict, _fmt(p.mean_loss_diff), _fmt(p.steps_to_target),
                        _fmt(p.time_to_target_s, " s"), _fmt(p.bytes_per_step, " B"),
                        f"{p.failed}/{p.dense_failed}" + (f" ({p.not_ok})" if p.not_ok else "")] for p in points]
    lines = aligned(rows)
    lines.append("")
    lines.append(f"tolerance: {_fmt(tolerance)} in final val loss; targets derived per density from its dense runs; "
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

    fig, ax = plots._new_axes()
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
    return plots._save(fig, path, None)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparsecomm frontier", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_experiment_source(p)
    add_job_arguments(p)
    p.add_argument("--densities", nargs="+", type=float, required=True, help="densities to try, each in (0, 1]")
    p.add_argument("--arms", nargs="+", default=["topk-ef", "topk-dgc"], metavar="ARM",
                   help=f"sparse techniques to sweep (default: topk-ef topk-dgc): presets {SPARSE_ARMS}, arms the "
                        "--config defines, or NAME=topk:key=value,... (without density: the sweep sets it)")
    p.add_argument("--seeds", nargs="+", type=int, help="override the seeds (integers in [0, 2**32 - 1])")
    p.add_argument("--steps", type=int, help="override the steps per run (>= 1)")
    p.add_argument("--selector", choices=("exact", "chunk"), help="how the top-k arms select (docs/wire.md)")
    p.add_argument("--chunk-size", type=int, help="chunk length of --selector chunk (2..65536, default 4096)")
    p.add_argument("--index-codec", choices=INDEX_CODECS, help="how the top-k arms write indices (default int32)")
    p.add_argument("--value-codecs", nargs="+", choices=VALUE_CODECS,
                   help="sweep these value codecs too (each works with either --selector; docs/wire.md)")
    p.add_argument("--exchange", choices=EXCHANGE_CHOICES,
                   help="how the top-k arms' payloads travel (default allgather; docs/exchange.md)")
    add_link_argument(p)
    add_parallelism_argument(p)
    p.add_argument("--out", type=Path, default=Path("runs"), help="root of run directories (default: ./runs)")
    p.add_argument("--plots", type=Path, default=Path("plots"), help="root of plot folders (default: ./plots)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_arguments(parser, argv)
    if len(set(args.densities)) != len(args.densities):
        parser.error(f"--densities must be distinct, got {args.densities}")
    if args.value_codecs and len(set(args.value_codecs)) != len(args.value_codecs):
        parser.error(f"--value-codecs must be distinct, got {args.value_codecs}")
    value_codecs = tuple(args.value_codecs) if args.value_codecs else (None,)
    try:  # validate every per-density configuration before the first launch
        arms, definitions = parse_arms(args.arms)
        if "dense" in arms:
            raise ValueError("argument --arms: the sparse techniques to sweep; dense is always run (once, reused at every density)")
        base = with_job_overrides(experiment_from_source(args), args, definitions=definitions)
        config = base.with_overrides(selector=args.selector, chunk_size=args.chunk_size,
                                     index_codec=args.index_codec, exchange=args.exchange)
        if config.link != "loopback":  # its own frontier files beside the loopback one
            config = config.with_overrides(name=f"{config.name}-{config.link}")
        check_local_world_size(config)
        check_link_possible(config)
        check_launcher_possible(config)
        for density in args.densities:
            for value_codec in value_codecs:
                point_config(config, density, arms, value_codec)
        check_writable_directory(args.out, "--out")
        check_writable_directory(args.plots / frontier_stem(config, value_codecs), "--plots")
    except (ValueError, TypeError, RuntimeError, OSError) as error:
        parser.error(str(error))
    points, code = run_and_read("sparsecomm frontier",
                                lambda: run_frontier(config, sorted(args.densities), arms, args.out, value_codecs))
    if code is not None:
        return code
    print()
    print(format_frontier(points, config.policy.quality_tolerance))
    summary = args.out / f"{frontier_stem(config, value_codecs)}.json"
    summary.parent.mkdir(parents=True, exist_ok=True)
    summary.write_text(json.dumps([asdict(p) for p in points], indent=1))
    figure = plot_frontier(points, args.plots / frontier_stem(config, value_codecs) / "frontier.png")
    print(f"\nwrote {summary}\nplot: {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
