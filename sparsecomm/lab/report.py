"""The report ``sparsecomm compare`` prints once its runs are done, for a person to read:

1. the verdicts, one line per arm, then their detail (:func:`sparsecomm.lab.tolerance.format_report`);
2. the time-to-quality ledger, one row and one speedup line per arm
   (:func:`sparsecomm.lab.ledger.format_ledger`);
3. the plots written.

Every line fits in :data:`REPORT_WIDTH` columns: :func:`fold` cuts longer ones, and the
ledger and the verdicts use it too. With no finished dense run there is nothing to compare
against: the report says so, lists the runs that did not finish, draws what it can and
returns :data:`EXIT_NO_DENSE`.
"""
from pathlib import Path

REPORT_WIDTH = 100
CONTINUATION = "      "  # indents the continuation lines of a folded line
EXIT_NO_DENSE = 4


def fold(line: str, width: int = REPORT_WIDTH, indent: str = CONTINUATION) -> list[str]:
    """``line`` cut into lines of at most ``width`` columns, after a semicolon or comma when
    one is in the second half of the line, else at a space; continuations start with ``indent``."""
    lines = []
    while len(line) > width:
        cut = _break_point(line, width, len(indent))
        lines.append(line[:cut].rstrip())
        line = indent + line[cut:].lstrip()
    return lines + [line]


def _break_point(line: str, width: int, indent: int) -> int:
    """Where to cut ``line`` so that the part before it, right-stripped, fits in ``width``."""
    window = line[: width + 1]  # a separator's space may sit just past the last column
    for separator in ("; ", ", "):
        at = window.rfind(separator)
        if at > width // 2:
            return at + len(separator)
    at = window.rfind(" ")
    # A space inside the indent would cut nothing off: the line would never get shorter.
    return at + 1 if at > indent else width


def fold_lines(lines: list[str], width: int = REPORT_WIDTH) -> list[str]:
    """Every line of ``lines`` folded (:func:`fold`); blank lines stay."""
    return [part for line in lines for part in fold(line, width)]


def report(run_dir: Path, plots_dir: Path) -> int:
    """Print the verdicts, the ledger and the plots of ``run_dir`` (plots drawn into
    ``plots_dir``); 0, or EXIT_NO_DENSE when no dense run finished."""
    # Imported here: plots pulls in matplotlib, and ledger and tolerance import fold from here.
    from sparsecomm.lab import ledger, plots, tolerance
    from sparsecomm.lab.results import load_experiment, load_runs

    runs = load_runs(run_dir)
    missing = ledger.missing_runs(load_experiment(run_dir), runs)
    no_dense = ledger.no_finished_dense(runs, missing)
    print()
    if no_dense is not None:
        print(f"verdicts: not available: {no_dense}")
        print(f"ledger: not available: {no_dense}")
        print("\n".join(fold_lines(ledger.format_not_ok(runs, missing).splitlines())))
        _print_plots(plots.plot_run_dir(run_dir, plots_dir))
        return EXIT_NO_DENSE
    print(tolerance.format_report(tolerance.check(run_dir)))
    print()
    # The verdicts' detail printed the policy and the target already.
    print(ledger.format_ledger(ledger.build_ledger(run_dir), context=False))
    print()
    arms = format_arms(runs)
    if arms:
        print(arms)
        print()
    _print_plots(plots.plot_run_dir(run_dir, plots_dir, ledger.ledger_items_for_plot(run_dir)))
    return 0


def format_arms(runs) -> str:
    """Every arm's full options, as its runs stored them (``arm_spec`` in each summary)."""
    from sparsecomm.lab.experiment.arm_spec import ArmSpec

    specs = {}
    for run in runs:
        stored = run.extra.get("arm_spec")
        if isinstance(stored, dict) and run.arm not in specs:
            try:
                specs[run.arm] = ArmSpec(**stored).describe()
            except (TypeError, KeyError, ValueError):  # a summary from another release: say nothing wrong
                continue
    if not specs:
        return ""
    width = max(map(len, specs))
    lines = ["arms (every option, as stored with their runs):"]
    lines += [f"  {arm:<{width}}  {description}" for arm, description in specs.items()]
    return "\n".join(fold_lines(lines))


def _print_plots(paths: list[Path]) -> None:
    print("plots:", *[str(p) for p in paths], sep="\n  ")
