"""``sparsecomm plot RUN_DIR [--out DIR]``: the figures of a run directory, drawn again.

Writes ``time_to_loss.png``, ``loss_vs_step.png`` and ``ledger.png``
(:func:`sparsecomm.lab.plots.plot_run_dir`) into ``DIR``, by default
``plots/<experiment name>`` under the current directory. The ledger's items come from
:func:`sparsecomm.lab.ledger.ledger_items_for_plot`: the plots themselves never read the
ledger, so that neither module imports the other. When the ledger cannot be built (no
finished dense run and no declared target) its figure is skipped, saying why.
"""
import argparse
import sys
from pathlib import Path

from sparsecomm.lab.ledger import ledger_items_for_plot
from sparsecomm.lab.plots import plot_run_dir
from sparsecomm.lab.results import ResultFileError, load_experiment, load_runs, load_steps, warnings_to_stderr
from sparsecomm.lab.results.layout import STEPS_FILE

DEFAULT_PLOTS_ROOT = Path("plots")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="sparsecomm plot",
        description="Plot an experiment run directory: time to loss, loss vs step, and the ledger.")
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="run directory written by sparsecomm compare")
    parser.add_argument("--out", metavar="DIR", type=Path, default=None,
                        help=f"where to write the PNGs (default: {DEFAULT_PLOTS_ROOT}/<experiment name>)")
    args = parser.parse_args(argv)
    if not args.run_dir.is_dir():
        print(f"sparsecomm plot: run directory {args.run_dir} does not exist", file=sys.stderr)
        return 2
    try:
        with warnings_to_stderr("sparsecomm plot"):
            for path in _plot(args.run_dir, args.out):
                print(path)
    except (OSError, ResultFileError) as e:  # no experiment.json, a bad result file, an unwritable --out
        print(f"sparsecomm plot: error: {e}", file=sys.stderr)
        return 2
    return 0


def _plot(run_dir: Path, out_dir: Path | None) -> list[Path]:
    experiment = load_experiment(run_dir)
    for run in load_runs(run_dir):  # a bad result file stops here, before any figure is written
        if run.finished and (Path(run.path) / STEPS_FILE).is_file():
            load_steps(run.path)
    if out_dir is None:
        out_dir = DEFAULT_PLOTS_ROOT / experiment["config"]["name"]
    try:
        ledger_items = ledger_items_for_plot(run_dir)
    except ResultFileError:
        raise
    except ValueError as e:  # e.g. no finished dense run to derive the target from
        print(f"sparsecomm plot: ledger plot skipped: {e}", file=sys.stderr)
        ledger_items = None
    return plot_run_dir(run_dir, out_dir, ledger_items)


if __name__ == "__main__":
    sys.exit(main())
