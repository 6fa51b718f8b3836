"""``sparsecomm ledger RUN_DIR``: print the time-to-quality ledger of a run directory (exit 0;
2 for an unreadable run directory, or no finished dense run)."""
import argparse
import sys
from pathlib import Path

from sparsecomm.lab.ledger.format import format_ledger, format_not_ok
from sparsecomm.lab.ledger.items import build_ledger, missing_runs
from sparsecomm.lab.results import ResultFileError, load_experiment, load_runs, warnings_to_stderr


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sparsecomm ledger", description="Print the time-to-quality ledger of a run directory.")
    parser.add_argument("run_dir", type=Path, help="experiment directory written by sparsecomm compare")
    args = parser.parse_args(argv)
    try:
        with warnings_to_stderr("sparsecomm ledger"):
            print(format_ledger(build_ledger(args.run_dir)))
    except (OSError, ValueError) as error:  # FileNotFoundError: no experiment.json; ResultFileError names the file
        print(f"sparsecomm ledger: error: {error}", file=sys.stderr)
        if isinstance(error, ValueError) and not isinstance(error, ResultFileError):
            try:  # say which runs failed, when the directory itself is readable
                runs = load_runs(args.run_dir)
                text = format_not_ok(runs, missing_runs(load_experiment(args.run_dir), runs))
            except (OSError, ValueError):
                text = ""
            if text:
                print(text, file=sys.stderr)
        return 2
    return 0
