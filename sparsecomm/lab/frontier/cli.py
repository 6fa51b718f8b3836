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
from dataclasses import asdict
from pathlib import Path

from sparsecomm.compress.index_codecs import INDEX_CODECS
from sparsecomm.compress.value_codecs import VALUE_CODECS
from sparsecomm.hooks.state.settings import EXCHANGE_CHOICES
from sparsecomm.lab.compare import (add_job_arguments, add_link_argument, add_parallelism_argument,
                                    check_launcher_possible, check_link_possible, check_local_world_size,
                                    check_writable_directory, parse_arguments, parse_arms, with_job_overrides)
from sparsecomm.lab.experiment.config_source import add_experiment_source, experiment_from_source
from sparsecomm.lab.frontier.format import format_frontier, plot_frontier
from sparsecomm.lab.frontier.points import SPARSE_ARMS, frontier_stem, point_config, run_frontier
from sparsecomm.lab.sweep import run_and_read


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
