"""``sparsecomm project``: the command line of the cost model."""
import argparse
import json
import math
import sys
from pathlib import Path

from sparsecomm.lab.costmodel.format import format_projection, format_validation, projection_json, validation_json
from sparsecomm.lab.costmodel.inputs import read_run
from sparsecomm.lab.costmodel.run_projection import project
from sparsecomm.lab.costmodel.scenario import DEFAULT_ALPHA_S, MAX_ALPHA_US, MAX_WORKERS, PROJECTED_EXCHANGES, make_scenario
from sparsecomm.lab.costmodel.validation import validate
from sparsecomm.links.spec import parse_link


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sparsecomm project",
        description="Project a run's per-arm step and time-to-target to more workers and another link "
                    "(alpha-beta cost model; every output figure is modelled).",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by `sparsecomm compare`")
    p.add_argument("--workers", type=int, default=None, help=f"number of workers p, in [2, {MAX_WORKERS}]")
    p.add_argument("--link", default=None, help="link per worker, e.g. 1gbit, 100gbit, 10gbit@50us (not loopback)")
    p.add_argument("--alpha-us", type=float, default=None,
                   help=f"latency per message in us, in [0, {MAX_ALPHA_US:.0f}] (default: the link's latency, "
                        f"else {DEFAULT_ALPHA_S * 1e6:g} us, a typical TCP ethernet message)")
    p.add_argument("--density", type=float, nargs="+", default=(),
                   help="densities in (0, 1] at which to tabulate the top-k arms")
    p.add_argument("--overlap", action="store_true",
                   help="let all but the last bucket's communication hide behind compute (default: exposed)")
    p.add_argument("--unpack-rate", type=float, default=None,
                   help="scatter-adds per second for the unpack, > 0 (default: measured from hook_stats)")
    p.add_argument("--exchange", choices=PROJECTED_EXCHANGES, default="allgather",
                   help="how the top-k arms' payloads travel in the projection: allgather (default), owner "
                        "(exchange='owner': flat in the number of workers), auto (the cheaper of the two)")
    p.add_argument("--against", metavar="OTHER_RUN_DIR", default=None,
                   help="validate: predict OTHER_RUN_DIR's per-arm step (its link and world size) from RUN_DIR")
    p.add_argument("--alpha-from-run", action="store_true",
                   help="with --against: take alpha from RUN_DIR (its smallest top-k arm's comm wait per message: "
                        "this machine's fixed cost per collective) instead of --alpha-us or the default")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.alpha_us is not None and not (math.isfinite(args.alpha_us) and 0 <= args.alpha_us <= MAX_ALPHA_US):
        parser.error(f"--alpha-us must be a number in [0, {MAX_ALPHA_US:.0f}] (microseconds), got {args.alpha_us}")
    if args.unpack_rate is not None and not (math.isfinite(args.unpack_rate) and args.unpack_rate > 0):
        parser.error(f"--unpack-rate must be a finite number > 0 (adds per second), got {args.unpack_rate}")
    bad = [d for d in args.density if not (math.isfinite(d) and 0 < d <= 1)]
    if bad:
        parser.error(f"--density values must be in (0, 1], got {bad[0]}")
    if args.alpha_from_run and (args.against is None or args.alpha_us is not None):
        parser.error("--alpha-from-run is for --against OTHER_RUN_DIR, and replaces --alpha-us (give one of them)")
    if args.against is not None:
        if args.workers is not None or args.link is not None or args.density:
            parser.error("--against takes the world size and link from OTHER_RUN_DIR; "
                         "do not give --workers, --link or --density with it")
    else:
        if args.workers is None or args.link is None:
            parser.error("--workers and --link are required (or give --against OTHER_RUN_DIR)")
        if not 2 <= args.workers <= MAX_WORKERS:
            parser.error(f"--workers must be an integer in [2, {MAX_WORKERS}], got {args.workers}")
        try:
            link = parse_link(args.link)
        except ValueError as error:
            parser.error(f"--link: {error}")
        if not link.emulated:
            parser.error("--link loopback has no known rate, so nothing can be projected onto it; "
                         "give a rate such as 1gbit, 10gbit, 100gbit or 10gbit@50us")
    for path in (args.run_dir, args.against):
        if path is not None and not Path(path).is_dir():
            print(f"sparsecomm project: error: {path} is not a directory", file=sys.stderr)
            return 2
    try:
        if args.against is not None:
            v = validate(args.run_dir, args.against, alpha_us=args.alpha_us, overlap=args.overlap,
                         unpack_adds_per_s=args.unpack_rate, alpha_from_run=args.alpha_from_run)
            print(json.dumps(validation_json(v), indent=1) if args.json else format_validation(v))
        else:
            scenario = make_scenario(args.workers, link, alpha_us=args.alpha_us, overlap=args.overlap,
                                     unpack_adds_per_s=args.unpack_rate, exchange=args.exchange)
            projection = project(read_run(args.run_dir), scenario, tuple(args.density))
            print(json.dumps(projection_json(projection), indent=1) if args.json else format_projection(projection))
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as exc:
        detail = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc)
        print(f"sparsecomm project: error: {detail}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
