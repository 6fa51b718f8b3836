"""The command line's cluster arguments (``compare``, ``frontier``, ``scale``), merged into
the config's ``cluster`` field (:mod:`sparsecomm.lab.experiment.cluster_settings`)."""
import argparse

from sparsecomm.lab.experiment.cluster_settings import KINDS, MAX_TIME_MIN, slurm_option_problem

FIELDS = {"parallel": "parallel", "nodes": "nodes", "tasks_per_node": "tasks_per_node",
          "gpus_per_node": "gpus_per_node", "partition": "partition", "time": "time_min"}
"""argparse destination -> ClusterSettings field."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def _time_limit(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_TIME_MIN:
        raise argparse.ArgumentTypeError(f"must be an integer from 1 to {MAX_TIME_MIN} (minutes: at most 365 days), "
                                         f"got {text!r}")
    return value


def _slurm_option(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"must be KEY=VALUE (an sbatch option without its dashes, e.g. "
                                         f"account=ml or exclusive=true), got {text!r}")
    return key.strip(), True if value.strip().lower() == "true" else value.strip()


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("cluster (runs as jobs; docs/cluster.md)")
    group.add_argument("--cluster", choices=KINDS,
                       help="run each (arm, seed) as a job: 'local' (processes on this machine, through submitit) or "
                            "'slurm' (one SLURM job array); default: one after another in this command")
    group.add_argument("--parallel", type=_positive_int, metavar="N",
                       help="at most N runs at once (local: each on its share of the cores; default 1; "
                            "slurm: the array's throttle, default all)")
    group.add_argument("--nodes", type=_positive_int, metavar="N", help="SLURM nodes per run (default 1)")
    group.add_argument("--tasks-per-node", type=_positive_int, metavar="N",
                       help="ranks per node (default world size / nodes)")
    group.add_argument("--gpus-per-node", type=_positive_int, metavar="N",
                       help="GPUs per node to request (SLURM); one rank per GPU")
    group.add_argument("--partition", help="SLURM partition")
    group.add_argument("--time", type=_time_limit, metavar="MINUTES",
                       help="a job's time limit; a run that reaches it is requeued and resumes from its checkpoint "
                            "(default 60 on SLURM, a week locally)")
    group.add_argument("--slurm", type=_slurm_option, action="append", metavar="KEY=VALUE",
                       help="another sbatch option, e.g. --slurm account=ml --slurm qos=high (repeatable)")


def cluster_from_arguments(args: argparse.Namespace, configured: dict | None) -> dict | None:
    """The config's ``cluster`` with the command line's choices; ValueError naming the
    argument when one is given without a cluster to apply it to."""
    kind = getattr(args, "cluster", None)
    given = {field: getattr(args, dest) for dest, field in FIELDS.items() if getattr(args, dest, None) is not None}
    slurm = dict(getattr(args, "slurm", None) or [])
    if kind is None and configured is None:
        named = [f"--{dest.replace('_', '-')}" for dest, field in FIELDS.items() if field in given]
        named += ["--slurm"] * bool(slurm)
        if named:
            raise ValueError(f"argument {named[0]}: needs --cluster local or --cluster slurm (or a cluster in the config)")
        return None
    base = dict(configured or {})
    if kind is not None and base.get("kind") != kind:
        base = {"kind": kind}  # another kind: the config's settings were for its own
    base.update(given)
    if slurm:
        base["slurm"] = {**base.get("slurm", {}), **slurm}
    for key, value in slurm.items():
        problem = slurm_option_problem(key, value, "--nodes, --tasks-per-node, --gpus-per-node, --partition, --time")
        if problem is not None:
            raise ValueError(f"argument --slurm: {problem}")
    return base
