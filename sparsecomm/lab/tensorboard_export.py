"""``sparsecomm tensorboard DIR [--out OUT]``: the curves a run recorded, as TensorBoard event files.

``DIR`` is an experiment directory (``experiment.json``: every run it lists) or one run's
directory (``runs/<arm>-seed<s>-<hash>``). Each run's ``steps.jsonl`` becomes the event files
of ``OUT/<arm>/seed<s>/``, so that ``tensorboard --logdir OUT`` shows every arm and seed side by
side (a run still training is exported up to its last recorded step). ``OUT`` defaults to
``DIR/tensorboard``: the command writes nowhere else. Running it again replaces the event
files it wrote before (``*.sparsecomm``), and only those.

Tags, per recorded step (rank 0's row: the loss is the mean over ranks, the bytes rank 0's):

- ``train/loss``; ``val/<metric>`` at each evaluation (``val/val_loss``, or the metric a
  script's ``run.log`` reported);
- ``traffic/bytes_sent_per_step``, ``traffic/bytes_dense_per_step``, ``traffic/compression`` (sent /
  dense);
- ``time/step_seconds``, ``time/compute_seconds``, ``time/compress_seconds``,
  ``time/comm_wait_seconds``.

The events' wall time is the run's elapsed seconds (TensorBoard's "Relative" axis is then the
run's own clock, evaluation included).
"""
import argparse
import sys
from pathlib import Path

from sparsecomm.lab.results import RUN_NAME_PATTERN, load_experiment, load_steps, warnings_to_stderr
from sparsecomm.lab.results.layout import EXPERIMENT_FILE, RUNS_DIR, STEPS_FILE
from sparsecomm.metrics.optional_packages import summary_writer_class

PROG = "sparsecomm tensorboard"
DEFAULT_OUT = "tensorboard"  # under DIR
SUFFIX = ".sparsecomm"  # the event files this command writes end so: a new export replaces them, nothing else
TRAIN_TAGS = {"step_seconds": "time/step_seconds", "compute_seconds": "time/compute_seconds",
              "compress_seconds": "time/compress_seconds", "comm_wait_seconds": "time/comm_wait_seconds",
              "bytes_sent": "traffic/bytes_sent_per_step", "bytes_dense": "traffic/bytes_dense_per_step"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Write a run's recorded curves (train and val loss, bytes per step, step times) as "
                               "TensorBoard event files, one run per arm and seed: tensorboard --logdir OUT.")
    parser.add_argument("dir", metavar="DIR", type=Path,
                        help="an experiment directory (with experiment.json) or one run directory in its runs/")
    parser.add_argument("--out", metavar="OUT", type=Path, default=None,
                        help=f"where to write OUT/<arm>/seed<s>/ (default: DIR/{DEFAULT_OUT})")
    args = parser.parse_args(argv)
    try:
        writer_class = summary_writer_class(PROG)
        with warnings_to_stderr(PROG):
            runs = runs_to_export(args.dir)
            curves = {(arm, seed): load_steps(path) for arm, seed, path in runs}  # every file read before any write
        out = args.out if args.out is not None else args.dir / DEFAULT_OUT
        for (arm, seed), rows in curves.items():
            print(write_events(writer_class, out / arm / f"seed{seed}", rows))
    except (ImportError, OSError, ValueError) as error:  # ResultFileError is a ValueError
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    print(f"tensorboard --logdir {out}")
    return 0


def runs_to_export(directory: Path) -> list[tuple[str, int, Path]]:
    """(arm, seed, run directory) of every run under ``directory`` with a steps.jsonl;
    ValueError/FileNotFoundError naming DIR when it is neither kind of directory or holds none."""
    if not directory.is_dir():
        raise FileNotFoundError(f"DIR {directory} does not exist (or is not a directory)")
    match = RUN_NAME_PATTERN.fullmatch(directory.resolve().name)
    if (directory / EXPERIMENT_FILE).is_file():
        listed = load_experiment(directory).get("runs")
        names = sorted(listed.values()) if listed is not None else sorted(
            p.name for p in (directory / RUNS_DIR).glob("*") if RUN_NAME_PATTERN.fullmatch(p.name))
        runs = [(RUN_NAME_PATTERN.fullmatch(name), directory / RUNS_DIR / name) for name in names]
    elif match is not None and (directory / STEPS_FILE).is_file():
        runs = [(match, directory)]
    else:
        raise ValueError(f"DIR {directory} is neither an experiment directory (no {EXPERIMENT_FILE}) nor a run "
                         f"directory (<arm>-seed<s>-<hash> with a {STEPS_FILE})")
    found = [(m["arm"], int(m["seed"]), path) for m, path in runs if (path / STEPS_FILE).is_file()]
    if not found:
        raise ValueError(f"DIR {directory}: no run has recorded a step yet (no {RUNS_DIR}/*/{STEPS_FILE})")
    return found


def write_events(writer_class, log_dir: Path, rows: list[dict]) -> Path:
    """``rows`` (one run's steps.jsonl) as a new event file in ``log_dir``, in place of the
    ones an earlier export wrote there; returns ``log_dir``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    for previous in log_dir.glob(f"events.out.tfevents.*{SUFFIX}"):
        previous.unlink()
    writer = writer_class(log_dir=str(log_dir), filename_suffix=SUFFIX)
    try:
        for row in rows:
            step, seconds = row.get("step"), row.get("elapsed_seconds")
            if row.get("kind") == "train":
                scalars = {tag: row.get(name) for name, tag in TRAIN_TAGS.items()}
                scalars["train/loss"] = row.get("train_loss")
                if row.get("bytes_sent") is not None and row.get("bytes_dense"):
                    scalars["traffic/compression"] = row["bytes_sent"] / row["bytes_dense"]
            elif row.get("kind") == "eval":
                scalars = {f"val/{row.get('metric', 'val_loss')}": row.get("val_loss")}
            else:
                continue
            for tag, value in scalars.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    writer.add_scalar(tag, value, global_step=step, walltime=seconds)
    finally:
        writer.close()
    return log_dir


if __name__ == "__main__":
    sys.exit(main())
