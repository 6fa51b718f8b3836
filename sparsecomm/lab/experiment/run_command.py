"""``sparsecomm run``: one paired run (arm x seed) as one rank of a job another launcher started.

``sparsecomm compare`` launches its own ranks (torchrun, or one process per namespace on
an emulated link). When the job is started by MPI or SLURM instead, every process runs
this command; rank, world size and rendezvous come from the launcher
(:mod:`sparsecomm.dist`)::

    mpiexec -n 2 python -m sparsecomm run --experiment digits-quick --arm topk-ef --seed 0
    mpiexec -n 2 python -m sparsecomm run --experiment digits-quick --arm dense --seed 0
    sparsecomm ledger runs/digits-quick          # reads both, like after sparsecomm compare
    srun -n 4 python -m sparsecomm run --config exp.json --arm topk-dgc --seed 1

The run directory is the one ``sparsecomm compare`` would use (a finished run is not
redone), so the ledger, the tolerance check and the plots read it unchanged. The world
size is the number of processes started. Fault injection and restarts need torchrun's
agent, so they are off here. ``setup`` in the ledger starts when this process starts
(the launcher's own start-up is not counted).

Like ``sparsecomm compare``, rank 0 locks the run directory for the run's duration
(another process training it stops this job: every rank exits 1 with the reason), skips
a run finished with the same config hash, resumes from the run's latest checkpoint, and
records a failing rank's own error in ``error-rank<r>.json``.
"""
import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from sparsecomm.lab.experiment.config import ARM_NAMES
from sparsecomm.lab.experiment.config_source import add_experiment_source, experiment_from_source
from sparsecomm.lab.experiment.files import RunDirectoryError, private_directory
from sparsecomm.lab.experiment.named import EXPERIMENTS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparsecomm run", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="named experiments: " + ", ".join(EXPERIMENTS))
    add_experiment_source(p)
    p.add_argument("--arm", required=True,
                   help=f"the arm to run: a preset ({', '.join(ARM_NAMES)}) or one the --config defines")
    p.add_argument("--seed", required=True, type=int, help="the seed (an integer >= 0)")
    p.add_argument("--steps", type=int, help="override the steps per run (>= 1)")
    p.add_argument("--out", type=Path, default=Path("runs"), help="root of run directories (default: ./runs)")
    return p


def main(argv: list[str] | None = None) -> int:
    started = time.time()
    parser = build_parser()
    args = parser.parse_args(argv)
    from sparsecomm.dist import discover

    try:
        if args.seed < 0:
            raise ValueError(f"--seed must be an integer >= 0, got {args.seed}")
        config = experiment_from_source(args)
        if args.arm not in (*ARM_NAMES, *config.arm_definitions):
            raise ValueError(f"argument --arm: {args.arm!r} is neither a preset ({', '.join(ARM_NAMES)}) nor an arm "
                             f"the experiment defines ({', '.join(config.arm_definitions) or 'none'})")
        info = discover()
        if info.world_size < 2:
            raise ValueError(f"sparsecomm run needs >= 2 processes (found {info.world_size}, launcher "
                             f"{info.launcher}): start it with e.g. mpiexec -n 2")
        # The run is the one compare would make for this arm and seed; world size from the launcher.
        seeds = config.seeds if args.seed in config.seeds else (*config.seeds, args.seed)
        arms = config.arms if args.arm in config.arms else (*config.arms, args.arm)
        config = replace(config, world_size=info.world_size, max_restarts=0, fault=None, seeds=seeds, arms=arms)
        config = config.with_overrides(steps=args.steps)
        if config.script is not None:
            raise ValueError("the experiment is a --script: launch the script itself (it calls "
                             "sparsecomm.lab.init()) through sparsecomm compare, not sparsecomm run")
        if config.link != "loopback":
            raise ValueError(f"the experiment's link is {config.link!r}: emulated links are built by sparsecomm "
                             "compare, not under an external launcher; set link to 'loopback'")
    except (ValueError, TypeError, OSError, json.JSONDecodeError) as error:
        parser.error(str(error))
    # Imported once the arguments are good: training needs torch.
    from sparsecomm.lab.experiment.run_locks import RunLock, hold_experiment
    from sparsecomm.lab.experiment.run_records import (
        finished_ok,
        keep_summary_aside,
        prepare_run_directory,
        read_summary,
        run_directory,
    )
    from sparsecomm.lab.experiment.runner import check_run_directories, write_snapshot
    from sparsecomm.lab.experiment.worker import run_rank

    out_dir = run_directory(config, args.out, args.arm, args.seed)
    expected = config.run_hash(args.arm, args.seed)
    if finished_ok(out_dir, expected):
        if info.rank == 0:
            print(f"{args.arm} seed {args.seed}: finished earlier, skipped ({out_dir})")
        return 0
    try:
        check_run_directories(config, args.out)
        private_directory(out_dir, args.out)
    except RunDirectoryError as error:
        parser.error(str(error))
    lock = RunLock(out_dir)

    def claim() -> tuple[int, str] | None:
        """Rank 0, once every rank has joined: the run directory is ours for the run, or why not."""
        if not hold_experiment(config, args.out, wait=False):
            return 1, (f"sparsecomm run: error: another process is running experiment {config.name} with a different "
                       f"configuration in {args.out / config.name}; wait for it to finish")
        if not lock.acquire():
            return 1, (f"sparsecomm run: error: another process (pid {lock.holder()}) is running {args.arm} seed "
                       f"{args.seed} in {out_dir}")
        if finished_ok(out_dir, expected):  # finished while we were starting
            return 0, f"{args.arm} seed {args.seed}: finished by another process meanwhile, skipped ({out_dir})"
        summary = read_summary(out_dir)
        if summary is not None:  # not this run's, or not finished: kept beside the new one
            keep_summary_aside(out_dir, "foreign" if summary.get("status") == "ok" else "failed")
        resume, notes = prepare_run_directory(out_dir, expected)
        write_snapshot(config, args.out)
        for note in notes:
            print(f"{args.arm} seed {args.seed}: {note}")
        print(f"sparsecomm run: {args.arm} seed {args.seed}, {info.world_size} ranks ({info.launcher}) -> {out_dir}"
              + (f" (resuming from step {resume})" if resume else ""), flush=True)
        return None

    run_rank(config, args.arm, args.seed, out_dir, started, announce=True, claim=claim)  # exits the process when done
    return 0


if __name__ == "__main__":
    sys.exit(main())
