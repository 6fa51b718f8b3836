"""Where an experiment's files are: every name of its directory and of its run directories,
written once here for the runner that writes them and the readers that read them.

Layout under ``--out`` (default ``runs``)::

    <experiment>/experiment.json                 the config snapshot; "runs" names each run directory
    <experiment>/history/experiment-<stamp>.json a snapshot of an earlier config
    <experiment>/.locks/                         who runs the experiment with which config
    <experiment>/jobs/                           the files of its runs' jobs (--cluster)
    <experiment>/runs/<arm>-seed<s>-<hash>/      one run (arm x seed), named by its config hash:
        summary.json      its record once it ended ("ok", or "failed"/"interrupted" with the error)
        result.json       what its ranks wrote, before the runner promotes it to summary.json
        steps.jsonl       one line per training step and evaluation
        run-config.json   the config its ranks read
        launch.log        what its launch printed (launch-node<n>.log: another node's)
        error-rank<r>.json  a rank's own error
        fault.json        the fault injector's record
        checkpoints/      its checkpoints
        run.lock          held while a process trains it
        <status>-<stamp>.json, <reason>-<stamp>/   an earlier attempt's record or files, kept aside

Names of experiments and arms become directory names, so they are restricted to
:data:`NAME_ACCEPTED` (:func:`is_safe_name`).
"""
import re

EXPERIMENT_FILE = "experiment.json"
HISTORY_DIR = "history"
LOCKS_DIR = ".locks"
JOBS_DIR = "jobs"
"""In the experiment directory: the files of its runs' jobs (:mod:`sparsecomm.lab.cluster`),
among them the pickles each job unpickles. Checked as the run directories are, but links in
it are not refused: submitit may leave links to its own files there."""
RUNS_DIR = "runs"

SUMMARY_FILE = "summary.json"
RESULT_FILE = "result.json"
"""Where a rank started by the runner writes its summary; the runner promotes it to summary.json."""
STEPS_FILE = "steps.jsonl"
RUN_CONFIG = "run-config.json"
"""In the run directory: the config the run's ranks read (never the shared experiment.json,
which another command may rewrite while this one trains)."""
LAUNCH_LOG = "launch.log"
FAULT_FILE = "fault.json"
CHECKPOINTS_DIR = "checkpoints"
RUN_LOCK = "run.lock"
"""In the run directory: flock'ed by the process that trains the run; holds its pid."""
RANK_ERROR_GLOB = "error-rank*.json"

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+@-]{0,127}")
NAME_ACCEPTED = "1 to 128 characters from A-Z a-z 0-9 . _ + @ -, starting with a letter or digit"
RUN_NAME_PATTERN = re.compile(r"(?P<arm>[A-Za-z0-9][A-Za-z0-9._+@-]*?)-seed(?P<seed>[0-9]+)-(?P<hash>[0-9a-f]+)")


def is_safe_name(name) -> bool:
    """Whether ``name`` can name a directory: no separator, no NUL, not ``.`` or ``..``."""
    return isinstance(name, str) and NAME_PATTERN.fullmatch(name) is not None


def run_name(arm: str, seed: int, config_hash: str) -> str:
    """The run directory's name (:data:`RUN_NAME_PATTERN` reads it back)."""
    return f"{arm}-seed{seed}-{config_hash}"


def rank_error_file(rank: int) -> str:
    return f"error-rank{rank}.json"


def node_launch_log(node: int) -> str:
    """What the launch of a node other than the first printed (a run on several nodes)."""
    return f"launch-node{node}.log"
