"""``sparsecomm compare``: run a paired experiment, then print its ledger, verdicts and plots.

    sparsecomm compare                          # the default experiment (pydoc-gpt)
    sparsecomm compare --experiment digits-quick --seeds 0 1 --steps 200
    sparsecomm compare --config my_experiment.json --out runs
    sparsecomm compare --link 1gbit             # each rank in its own network namespace, 1 Gb/s links (root)
    sparsecomm compare --task my_tasks.py:make_task --arms dense topk-dgc
    sparsecomm compare --script train.py --arms dense topk-dgc --seeds 0 1 2 --steps 200 -- --data ./data
    sparsecomm compare --arms dense topk-dgc 'topk-0.3pc=topk:density=0.003,momentum=0.9,opt.lr=0.002'

An arm is a preset name (dense, dense-bf16, powersgd, topk-ef, topk-noef, topk-dgc) or
NAME=REDUCER[:key=value,...]: reducer allreduce, fp16, bf16, powersgd or topk, any TopKState
option (powersgd: rank, start_iter, ...) and opt.lr / opt.momentum / opt.weight_decay / opt.beta2 for
the optimizer (docs/bring_your_own.md). Arguments after "--" go to the --script.

Everything is checked before the first run starts: the config (each bad value names its
field, and its file with --config), the experiment name (it names directories), that
there is an arm besides dense to compare, the world size against this machine's cores,
the link, and that --out and --plots can be written.

Exit codes: 0 the ledger, verdicts and plots were printed (whatever the verdicts; use
``sparsecomm check`` to gate on them); 2 a bad argument or config (a task whose code exits
included), a run directory refused (a link, or another user's directory, under --out), or
an unreadable result file; 4 no dense run finished, so there is nothing to compare against (the failures are
printed); 130 / 143 stopped by Ctrl-C / SIGTERM (what was kept is printed).
"""
import argparse
import dataclasses
import os
import sys
import tempfile
from pathlib import Path

from sparsecomm.lab.cluster.arguments import add_cluster_arguments, cluster_from_arguments
from sparsecomm.lab.experiment import arm_spec
from sparsecomm.lab.experiment.config import ARM_NAMES, PARALLELISM_FORM, ExperimentConfig, hsdp_shape_of
from sparsecomm.lab.experiment.config_source import add_experiment_source, experiment_from_source
from sparsecomm.lab.experiment.files import RunDirectoryError
from sparsecomm.lab.experiment.named import EXPERIMENTS
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
    p.add_argument("--arms", nargs="+", metavar="ARM",
                   help="override the arms: preset names or NAME=REDUCER[:key=value,...] (must include dense and "
                        "at least one other arm)")
    add_job_arguments(p)
    p.add_argument("--seeds", nargs="+", type=int, help="override the seeds (integers in [0, 2**32 - 1])")
    p.add_argument("--steps", type=int, help="override the steps per run (>= 1)")
    p.add_argument("--name", help=f"override the experiment name (the run directory's name): {NAME_ACCEPTED}")
    add_link_argument(p)
    add_parallelism_argument(p)
    return p


def add_job_arguments(p: argparse.ArgumentParser, *, world_size: bool = True) -> None:
    """--task / --script and what goes with your own job (shared with frontier and scale;
    ``world_size=False`` leaves out --world-size, for a command that sets it per point)."""
    p.add_argument("--task", help="your task instead of the experiment's: MODULE:FACTORY or path/to/file.py:FACTORY, "
                                  "a callable returning a sparsecomm.lab.tasks.Task")
    p.add_argument("--script", help="your training script instead of a task (it calls sparsecomm.lab.init()); "
                                    "launched under torchrun once per arm x seed; its own arguments after '--'")
    p.add_argument("--sources", nargs="+", metavar="PATH",
                   help="files or directories your task or script depends on that its imports do not show (data "
                        "files, modules imported by a computed name): their contents are part of the run hash")
    p.add_argument("--metric", help="the metric the verdicts compare (default val_loss; a --script logs it with "
                                    "run.log)")
    p.add_argument("--mode", choices=("min", "max"), help="min: lower metric is better (default); max: higher")
    p.add_argument("--tolerance", type=float,
                   help="quality tolerance in the metric's unit (the experiment's policy otherwise)")
    if world_size:
        p.add_argument("--world-size", type=int, help="override the number of ranks (>= 2)")
    p.add_argument("--launcher", choices=("torchrun", "mpiexec"),
                   help="what starts each run's ranks (default torchrun; a script under mpiexec joins with "
                        "sparsecomm.dist.init_distributed)")
    add_cluster_arguments(p)


def add_link_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--link", type=lambda text: text.strip().lower(),
                        help="link between the ranks: loopback (default), or emulated, e.g. 1gbit, 10gbit, 100mbit "
                             "(one network namespace per rank, tc-shaped; needs root, ip and tc)")


def add_parallelism_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parallelism", type=_parallelism,
                        help='how the model is spread over the ranks: "ddp" (default) or "hsdp:RxS" (FSDP2 hybrid '
                             "sharding, R replicas of S shards, R x S = world size; the arms act across replicas; "
                             "docs/fsdp.md)")


def _parallelism(text: str) -> str:
    """--parallelism in one of its forms (the config checks R x S against the world size)."""
    if text != "ddp" and hsdp_shape_of(text) is None:
        raise argparse.ArgumentTypeError(f"must be {PARALLELISM_FORM}, got {text!r}")
    return text


def check_link_possible(config: ExperimentConfig) -> None:
    """Not root, no tc: say so before anything runs (raises RuntimeError)."""
    from sparsecomm.links import parse_link
    from sparsecomm.links.netns import check_emulation_possible

    check_emulation_possible(parse_link(config.link))


def load_config(args: argparse.Namespace) -> ExperimentConfig:
    if args.name is not None and not is_safe_name(args.name):
        raise ValueError(f"argument --name: must be {NAME_ACCEPTED} (it names directories under --out and "
                         f"--plots), got {args.name!r}")
    config = experiment_from_source(args)
    arms, definitions = parse_arms(args.arms) if args.arms else (None, None)
    return with_job_overrides(config, args, arms=arms, definitions=definitions, name=args.name)


def with_job_overrides(config: ExperimentConfig, args: argparse.Namespace, *, arms=None, definitions=None,
                       name=None) -> ExperimentConfig:
    """``config`` with the command line's choices: arms, seeds, steps, link, parallelism, your task or
    script, metric."""
    overrides = dict(arms=arms, seeds=tuple(args.seeds) if args.seeds else None, steps=args.steps, name=name,
                     link=args.link, parallelism=getattr(args, "parallelism", None),
                     metric=getattr(args, "metric", None), mode=getattr(args, "mode", None),
                     world_size=getattr(args, "world_size", None), launcher=getattr(args, "launcher", None),
                     sources=tuple(args.sources) if getattr(args, "sources", None) else None,
                     cluster=cluster_from_arguments(args, config.cluster))
    if definitions:
        overrides["arm_definitions"] = {**config.arm_definitions, **definitions}
    if getattr(args, "task", None) is not None or getattr(args, "script", None) is not None:
        # Your task or script, in the experiment's settings (or the bring-your-own base's).
        overrides.update(task=args.task, script=args.script, script_args=tuple(getattr(args, "script_args", ())))
        return _replace(config, overrides, keep_none=("task", "script"), tolerance=getattr(args, "tolerance", None))
    return _replace(config, overrides, tolerance=getattr(args, "tolerance", None))


def _replace(config: ExperimentConfig, overrides: dict, *, keep_none=(), tolerance=None) -> ExperimentConfig:
    """``config`` with the given overrides (None: keep, except for the ``keep_none`` keys)."""
    values = {k: v for k, v in overrides.items() if v is not None or k in keep_none}
    if tolerance is not None:
        values["policy"] = dataclasses.replace(config.policy, quality_tolerance=tolerance)
    return dataclasses.replace(config, **values)


def parse_arms(items: list[str]) -> tuple[tuple[str, ...], dict]:
    """--arms: names, and definitions written NAME=REDUCER[:key=value,...]."""
    names, definitions = [], {}
    for item in items:
        name, definition = arm_spec.parse_cli_arm(item)
        names.append(name)
        if definition is not None:
            definitions[name] = definition
    return tuple(names), definitions


def local_world_size_limit() -> int:
    """The most ranks a run started on this machine may have: LOCAL_RANKS_PER_CORE per core (at least 2)."""
    return max(2, LOCAL_RANKS_PER_CORE * (os.cpu_count() or 1))


def check_local_world_size(config: ExperimentConfig) -> None:
    """Every rank runs on this machine (unless on SLURM): refuse more than LOCAL_RANKS_PER_CORE per core."""
    if config.cluster is not None and config.cluster.get("kind") == "slurm":
        return
    cores = os.cpu_count() or 1
    limit = local_world_size_limit()
    if config.world_size > limit:
        raise ValueError(f"world_size must be <= {limit} for a run on this machine ({LOCAL_RANKS_PER_CORE} ranks "
                         f"per CPU core x {cores} cores; every rank is started here), got {config.world_size}")


def check_launcher_possible(config: ExperimentConfig) -> None:
    """launcher mpiexec without mpiexec or mpi4py, or a SLURM cluster without its commands:
    say so before anything runs (RuntimeError)."""
    if config.cluster is not None and config.cluster.get("kind") == "slurm":
        from sparsecomm.lab.cluster.executors import check_slurm_available

        check_slurm_available()
    if config.launcher != "mpiexec":
        return
    import importlib.util

    from sparsecomm.lab.experiment.launch import find_mpiexec

    if find_mpiexec() is None or importlib.util.find_spec("mpi4py") is None:
        raise RuntimeError("launcher mpiexec needs an mpiexec (beside the Python interpreter or on PATH) and mpi4py: "
                           "pip install 'sparsecomm[mpi]'")


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


def parse_arguments(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Everything after the first "--" is the --script's own arguments."""
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if script_args and args.script is None:
        parser.error(f"arguments after '--' ({' '.join(script_args)}) go to a --script, but no --script was given")
    args.script_args = script_args
    return args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_arguments(parser, argv)
    try:
        config = load_config(args)  # every value is validated here, before any launch
        check_has_compared_arm(config, args)
        check_local_world_size(config)
        check_link_possible(config)
        check_launcher_possible(config)
        check_writable_directory(args.out / config.name, "--out")
        check_writable_directory(args.plots / config.name, "--plots")
        from sparsecomm.lab.run_where import run_experiment
        from sparsecomm.lab.experiment.runner import ExperimentInterrupted, check_run_directories

        check_run_directories(config, args.out)
    except (ValueError, TypeError, OSError, RuntimeError) as error:
        parser.error(str(error))

    print(f"experiment {config.name}: {len(config.arms)} arms x {len(config.seeds)} seeds, "
          f"{config.world_size} ranks over {config.link}, {config.steps} steps -> {args.out / config.name}", flush=True)
    from sparsecomm.lab.cluster.sbatch import SubmissionError

    try:
        run_dir = run_experiment(config, args.out)
    except ExperimentInterrupted as error:
        return stop_on_interrupt(error)
    except (RunDirectoryError, SubmissionError) as error:  # planted while the experiment ran; sbatch's refusal
        print(f"sparsecomm compare: error: {error}", file=sys.stderr)
        return 2
    from sparsecomm.lab.results import ResultFileError, warnings_to_stderr

    try:
        with warnings_to_stderr("sparsecomm compare"):
            return report(run_dir, args.plots / config.name)
    except (ResultFileError, FileNotFoundError) as error:
        print(f"sparsecomm compare: error: {error}", file=sys.stderr)
        return 2


def report(run_dir: Path, plots_dir: Path) -> int:
    """Print the verdicts and the ledger, draw the plots; EXIT_NO_DENSE when no dense run
    finished (:func:`sparsecomm.lab.report.report`)."""
    # Imported once the runs are done: the report pulls in matplotlib and scipy, which
    # checking the arguments and launching the runs do not need.
    from sparsecomm.lab.report import report as print_report

    return print_report(run_dir, plots_dir)


if __name__ == "__main__":
    sys.exit(main())
