"""``sparsecomm compare``: run a paired experiment, then print its ledger, verdicts and plots.

    sparsecomm compare                          # the default experiment (pydoc-gpt)
    sparsecomm compare --experiment digits-quick --seeds 0 1 --steps 200
    sparsecomm compare --config my_experiment.json --out runs
    sparsecomm compare --link 1gbit             # each rank in its own network namespace, 1 Gb/s links (root)
"""
import argparse
import json
import sys
from pathlib import Path

from sparsecomm.experiment.config import ARM_NAMES, ExperimentConfig
from sparsecomm.experiment.named import DEFAULT_EXPERIMENT, EXPERIMENTS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparsecomm compare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="named experiments: " + ", ".join(EXPERIMENTS))
    add_experiment_source(p)
    p.add_argument("--out", type=Path, default=Path("runs"), help="root of run directories (default: ./runs)")
    p.add_argument("--plots", type=Path, default=Path("plots"), help="root of plot folders (default: ./plots)")
    p.add_argument("--arms", nargs="+", choices=ARM_NAMES, help="override the arms (must include dense)")
    p.add_argument("--seeds", nargs="+", type=int, help="override the seeds (integers >= 0)")
    p.add_argument("--steps", type=int, help="override the steps per run (>= 1)")
    p.add_argument("--name", help="override the experiment name (the run directory's name)")
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
    if args.config is not None:
        return ExperimentConfig.from_dict(json.loads(args.config.read_text()))
    return EXPERIMENTS[args.experiment]()


def load_config(args: argparse.Namespace) -> ExperimentConfig:
    config = experiment_from_source(args)
    return config.with_overrides(
        arms=tuple(args.arms) if args.arms else None,
        seeds=tuple(args.seeds) if args.seeds else None,
        steps=args.steps,
        name=args.name,
        link=args.link,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = load_config(args)  # every value is validated here, before any launch
        check_link_possible(config)
    except (ValueError, TypeError, OSError, json.JSONDecodeError, RuntimeError) as error:
        parser.error(str(error))
    from sparsecomm import ledger, plots, tolerance
    from sparsecomm.experiment.runner import run_experiment

    print(f"experiment {config.name}: {len(config.arms)} arms x {len(config.seeds)} seeds, "
          f"{config.world_size} ranks over {config.link}, {config.steps} steps -> {args.out / config.name}", flush=True)
    run_dir = run_experiment(config, args.out)
    print()
    print(ledger.format_ledger(ledger.build_ledger(run_dir)))
    print()
    report = tolerance.check(run_dir)
    print(tolerance.format_report(report))
    print()
    paths = plots.plot_run_dir(run_dir, args.plots / config.name, ledger.ledger_items_for_plot(run_dir))
    print("plots:", *[str(p) for p in paths], sep="\n  ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
