"""``sparsecomm compare``: run a paired experiment, then print its ledger, verdicts and plots.

    sparsecomm compare                          # the default experiment (pydoc-gpt)
    sparsecomm compare --experiment digits-quick --seeds 0 1 --steps 200
    sparsecomm compare --config my_experiment.json --out runs
    sparsecomm compare --link 1gbit             # each rank in its own network namespace, 1 Gb/s links (root)

Everything is checked before the first run starts: the config (each bad value names its
field, and its file with --config), the experiment name (it names directories), that
there is an arm besides dense to compare, the world size against this machine's cores,
the link, and that --out and --plots can be written.

Exit codes: 0 the ledger, verdicts and plots were printed (whatever the verdicts; use
``sparsecomm check`` to gate on them); 2 a bad argument or config, or an unreadable result
file; 4 no dense run finished, so there is nothing to compare against (the failures are
printed); 130 / 143 stopped by Ctrl-C / SIGTERM (what was kept is printed).
"""
import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from sparsecomm.lab.experiment.config import ARM_NAMES, ExperimentConfig
from sparsecomm.lab.experiment.named import DEFAULT_EXPERIMENT, EXPERIMENTS
from sparsecomm.lab.results import NAME_ACCEPTED, is_safe_name

LOCAL_RANKS_PER_CORE = 4
"""compare starts every rank on this machine: at most this many ranks per CPU core."""
EXIT_NO_DENSE = 4
EXIT_SIGNAL = {"SIGINT": 130, "SIGTERM": 143}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparsecomm compare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="named experiments: " + ", ".join(EXPERIMENTS))
    add_experiment_source(p)
    p.add_argument("--out", type=Path, default=Path("runs"), help="root of run directories (default: ./runs)")
    p.add_argument("--plots", type=Path, default=Path("plots"), help="root of plot folders (default: ./plots)")
    p.add_argument("--arms", nargs="+", choices=ARM_NAMES,
                   help="override the arms (must include dense and at least one other arm)")
    p.add_argument("--seeds", nargs="+", type=int, help="override the seeds (integers in [0, 2**32 - 1])")
    p.add_argument("--steps", type=int, help="override the steps per run (>= 1)")
    p.add_argument("--name", help=f"override the experiment name (the run directory's name): {NAME_ACCEPTED}")
    add_link_argument(p)
    return p


def add_experiment_source(parser: argparse.ArgumentParser) -> None:
    """--experiment NAME | --config FILE (shared by the commands that run experiments)."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--experiment", choices=sorted(EXPERIMENTS), default=DEFAULT_EXPERIMENT,
                        help=f"named experiment (default: {DEFAULT_EXPERIMENT})")
    source.add_argument("--config", type=Path, help="JSON file with ExperimentConfig fields")


def add_link_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--link", type=lambda text: text.strip().lower(),
                        help="link between the ranks: loopback (default), or emulated, e.g. 1gbit, 10gbit, 100mbit "
                             "(one network namespace per rank, tc-shaped; needs root, ip and tc)")


def check_link_possible(config: ExperimentConfig) -> None:
    """Not root, no tc: say so before anything runs (raises RuntimeError)."""
    from sparsecomm.links import parse_link
    from sparsecomm.links.netns import check_emulation_possible

    check_emulation_possible(parse_link(config.link))


def experiment_from_source(args: argparse.Namespace) -> ExperimentConfig:
    """The named experiment, or the --config file's; a bad file raises ValueError naming it and the field."""
    if args.config is None:
        return EXPERIMENTS[args.experiment]()
    path = args.config
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise ValueError(f"argument --config: {path}: not a JSON text file (not UTF-8)") from None
    except OSError as error:
        raise ValueError(f"argument --config: {path}: {error.strerror or error}") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"argument --config: {path}: not valid JSON ({error.msg} at line {error.lineno} column "
                         f"{error.colno}{'; truncated?' if error.pos >= len(text.rstrip()) else ''})") from None
    try:
        return ExperimentConfig.from_dict(raw)
    except (ValueError, TypeError) as error:
        raise ValueError(f"argument --config: {path}: {error}") from None


def load_config(args: argparse.Namespace) -> ExperimentConfig:
    if args.name is not None and not is_safe_name(args.name):
        raise ValueError(f"argument --name: must be {NAME_ACCEPTED} (it names directories under --out and "
                         f"--plots), got {args.name!r}")
    config = experiment_from_source(args)
    return config.with_overrides(
        arms=tuple(args.arms) if args.arms else None,
        seeds=tuple(args.seeds) if args.seeds else None,
        steps=args.steps,
        name=args.name,
        link=args.link,
    )


def check_local_world_size(config: ExperimentConfig) -> None:
    """Every rank runs on this machine: refuse more than LOCAL_RANKS_PER_CORE per core."""
    cores = os.cpu_count() or 1
    limit = max(2, LOCAL_RANKS_PER_CORE * cores)
    if config.world_size > limit:
        raise ValueError(f"world_size must be <= {limit} for a run on this machine ({LOCAL_RANKS_PER_CORE} ranks "
                         f"per CPU core x {cores} cores; every rank is started here), got {config.world_size}")


def check_writable_directory(path: Path, argument: str) -> None:
    """``path`` is, or can be created as, a directory this process can write (nothing is left behind)."""
    path = Path(path)
    existing = path
    while not existing.exists():
        if existing.is_symlink():
            raise ValueError(f"argument {argument}: {path} cannot be created: {existing} is a dangling symlink")
        existing = existing.parent
    if not existing.is_dir():
        where = "is not a directory" if existing == path else f"cannot be created: {existing} is not a directory"
        raise ValueError(f"argument {argument}: {path} {where}")
    try:
        with tempfile.TemporaryFile(dir=existing, prefix=".sparsecomm-write-check-"):
            pass
    except OSError as error:
        raise ValueError(f"argument {argument}: {path} is not writable ({existing}: "
                         f"{error.strerror or error})") from None


def check_has_compared_arm(config: ExperimentConfig, args: argparse.Namespace) -> None:
    if any(arm != "dense" for arm in config.arms):
        return
    where = ("argument --arms" if args.arms else f"arms in {args.config}" if args.config is not None
             else f"arms of experiment {args.experiment}")
    raise ValueError(f"{where}: needs at least one arm besides 'dense' to compare against it (from "
                     f"{', '.join(a for a in ARM_NAMES if a != 'dense')}), got {list(config.arms)}; "
                     "for dense runs alone use `sparsecomm run`")


def stop_on_interrupt(error) -> int:
    """An ExperimentInterrupted: its report on stderr, the signal's exit code (130 SIGINT, 143 SIGTERM)."""
    print(error.report, file=sys.stderr, flush=True)
    return EXIT_SIGNAL.get(error.signal_name, 130)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = load_config(args)  # every value is validated here, before any launch
        check_has_compared_arm(config, args)
        check_local_world_size(config)
        check_link_possible(config)
        check_writable_directory(args.out / config.name, "--out")
        check_writable_directory(args.plots / config.name, "--plots")
    except (ValueError, TypeError, OSError, RuntimeError) as error:
        parser.error(str(error))
    from sparsecomm.lab.experiment.runner import ExperimentInterrupted, run_experiment

    print(f"experiment {config.name}: {len(config.arms)} arms x {len(config.seeds)} seeds, "
          f"{config.world_size} ranks over {config.link}, {config.steps} steps -> {args.out / config.name}", flush=True)
    try:
        run_dir = run_experiment(config, args.out)
    except ExperimentInterrupted as error:
        return stop_on_interrupt(error)
    from sparsecomm.lab.results import ResultFileError, warnings_to_stderr

    try:
        with warnings_to_stderr("sparsecomm compare"):
            return report(run_dir, args.plots / config.name)
    except (ResultFileError, FileNotFoundError) as error:
        print(f"sparsecomm compare: error: {error}", file=sys.stderr)
        return 2


def report(run_dir: Path, plots_dir: Path) -> int:
    """Print the ledger and the verdicts, draw the plots; EXIT_NO_DENSE when no dense run finished."""
    from sparsecomm.lab import ledger, plots, tolerance
    from sparsecomm.lab.results import load_experiment, load_runs

    runs = load_runs(run_dir)
    missing = ledger.missing_runs(load_experiment(run_dir), runs)
    no_dense = ledger.no_finished_dense(runs, missing)
    print()
    if no_dense is not None:
        print(f"ledger: not available: {no_dense}")
        print(f"verdicts: not available: {no_dense}")
        print(ledger.format_not_ok(runs, missing))
        paths = plots.plot_run_dir(run_dir, plots_dir)
        print("plots:", *[str(p) for p in paths], sep="\n  ")
        return EXIT_NO_DENSE
    print(ledger.format_ledger(ledger.build_ledger(run_dir)))
    print()
    print(tolerance.format_report(tolerance.check(run_dir)))
    print()
    paths = plots.plot_run_dir(run_dir, plots_dir, ledger.ledger_items_for_plot(run_dir))
    print("plots:", *[str(p) for p in paths], sep="\n  ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
