"""The report ``sparsecomm compare`` prints once its runs are done, for a person to read:

1. the verdicts, one line per arm, then their detail (:func:`sparsecomm.lab.tolerance.format_report`);
2. the time-to-quality ledger, one row and one speedup line per arm
   (:func:`sparsecomm.lab.ledger.format_ledger`);
3. every arm's options, and how many DDP buckets (FSDP modules) a step reduced the gradient in;
4. the plots written;
5. where compression pays: each equivalent arm's modelled break-even link rate against dense
   (:func:`sparsecomm.lab.costmodel.breakeven_report.break_even_lines`).

Every line fits in :data:`sparsecomm.lab.results.text.REPORT_WIDTH` columns (:func:`sparsecomm.lab.results.text.fold`
cuts longer ones; the ledger and the verdicts use it too). With no finished dense run there is
nothing to compare against: the report says so, lists the runs that did not finish, draws what
it can and returns :data:`EXIT_NO_DENSE`.

This module joins the ledger, the verdicts and the plots; none of them imports it.
"""
from pathlib import Path

from sparsecomm.lab import ledger, plots, tolerance
from sparsecomm.lab.costmodel.breakeven_report import break_even_lines
from sparsecomm.lab.experiment.arm_spec import ArmSpec
from sparsecomm.lab.results import load_experiment, load_runs
from sparsecomm.lab.results.text import fold_lines

EXIT_NO_DENSE = 4


def report(run_dir: Path, plots_dir: Path) -> int:
    """Print the verdicts, the ledger and the plots of ``run_dir`` (plots drawn into
    ``plots_dir``); 0, or EXIT_NO_DENSE when no dense run finished."""
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
    buckets = format_buckets(runs)
    if buckets:
        print(buckets)
        print()
    _print_plots(plots.plot_run_dir(run_dir, plots_dir, ledger.ledger_items_for_plot(run_dir)))
    print()
    print("\n".join(break_even_lines(run_dir)))
    return 0


def format_arms(runs) -> str:
    """Every arm's full options, as its runs stored them (``arm_spec`` in each summary)."""
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


def format_buckets(runs) -> str:
    """How many pieces each step's gradient was reduced in (DDP buckets, or FSDP modules under
    hsdp:RxS), as the runs counted them: a default that holds in one bucket may not in many."""
    counts = {}
    for run in runs:
        found = run.extra.get("buckets_per_step")
        if isinstance(found, (int, float)) and not isinstance(found, bool):
            counts.setdefault(run.arm, set()).add(int(found))
    if not counts:
        return ""
    pieces = "FSDP modules" if any(str(run.extra.get("parallelism", "ddp")).startswith("hsdp") for run in runs) \
        else "DDP buckets"
    if len({frozenset(found) for found in counts.values()}) == 1:
        return f"each step reduced the gradient in {_count(next(iter(counts.values())))} {pieces} (every arm)"
    lines = [f"each step reduced the gradient in this many {pieces}:"]
    lines += [f"  {arm}: {_count(found)}" for arm, found in counts.items()]
    return "\n".join(fold_lines(lines))


def _count(found: set[int]) -> str:
    return str(min(found)) if len(found) == 1 else f"{min(found)} to {max(found)}"


def _print_plots(paths: list[Path]) -> None:
    print("plots:", *[str(p) for p in paths], sep="\n  ")
