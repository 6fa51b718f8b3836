"""``sparsecomm check``: is each sparse arm's final validation loss equivalent to dense?"""
import argparse
import math
import sys
from pathlib import Path

from sparsecomm.lab.results import ResultFileError, warnings_to_stderr
from sparsecomm.lab.tolerance.format import format_report
from sparsecomm.lab.tolerance.verdicts import NoFinishedDense, check


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sparsecomm check",
        description="Is each arm's final validation loss equivalent to dense's (paired TOST over seeds)?",
        epilog="exit codes: 0 all equivalent or better, 1 some arm worse, 2 usage error, 3 inconclusive",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by `sparsecomm compare`")
    p.add_argument("--tolerance", type=float, default=None,
                   help="equivalence bound delta (default: the policy's quality_tolerance); "
                        "a fraction with --relative")
    p.add_argument("--relative", action="store_true",
                   help="compare (arm - dense) / dense instead of arm - dense")
    p.add_argument("--alpha", type=float, default=0.05, help="level of each one-sided test (default 0.05)")
    p.add_argument("--baseline", default="dense", metavar="ARM",
                   help="the arm every other is judged against (default: dense), e.g. a dense arm under another "
                        "optimizer; steps to target stay against dense's target")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.tolerance is not None and not (math.isfinite(args.tolerance) and args.tolerance > 0):
        parser.error(f"--tolerance must be a finite number > 0, got {args.tolerance}")
    if not (0 < args.alpha < 0.5):
        parser.error(f"--alpha must be in (0, 0.5), got {args.alpha}")
    if not Path(args.run_dir).is_dir():
        print(f"sparsecomm check: error: {args.run_dir} is not a directory", file=sys.stderr)
        return 2
    try:
        with warnings_to_stderr("sparsecomm check"):
            report = check(args.run_dir, tolerance=args.tolerance, relative=args.relative, alpha=args.alpha,
                           baseline=args.baseline)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        # OSError covers a missing experiment.json; ResultFileError (a ValueError) names the bad file.
        detail = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc)
        prefix = "" if isinstance(exc, (ResultFileError, NoFinishedDense)) else f"{args.run_dir}: "
        print(f"sparsecomm check: error: {prefix}{detail}", file=sys.stderr)
        for line in getattr(exc, "not_compared", ()):
            print(f"  {line}", file=sys.stderr)
        return 2
    print(format_report(report))
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
