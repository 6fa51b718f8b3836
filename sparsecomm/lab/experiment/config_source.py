"""Where an experiment's config comes from: ``--experiment NAME``, ``--config FILE``, or, for a
``--task`` or ``--script`` given alone, the bring-your-own base (:mod:`.named`). Shared by every
command that runs experiments (``compare``, ``run``, ``frontier``, ``scale``).
"""
import argparse
import json
from pathlib import Path

from sparsecomm.lab.experiment.config import ExperimentConfig
from sparsecomm.lab.experiment.named import DEFAULT_EXPERIMENT, EXPERIMENTS, bring_your_own


def add_experiment_source(parser: argparse.ArgumentParser) -> None:
    """--experiment NAME | --config FILE (shared by the commands that run experiments)."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--experiment", choices=sorted(EXPERIMENTS),
                        help=f"named experiment (default: {DEFAULT_EXPERIMENT}; with --task or --script alone: 2 arms "
                             "x 3 seeds x 200 steps, no checkpoints or faults)")
    source.add_argument("--config", type=Path, help="JSON file with ExperimentConfig fields")


def experiment_from_source(args: argparse.Namespace) -> ExperimentConfig:
    """The named experiment, or the --config file's, or for a --task / --script given alone
    the bring-your-own base; a bad file raises ValueError naming it and the field."""
    task, script = getattr(args, "task", None), getattr(args, "script", None)
    if task is not None and script is not None:
        raise ValueError("arguments --task and --script: give one of them (a task or a script), not both")
    if args.config is None and args.experiment is None and (task or script):
        return bring_your_own(task or script, script=script is not None)
    if args.config is None:
        return EXPERIMENTS[args.experiment or DEFAULT_EXPERIMENT]()
    path = args.config
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise ValueError(f"argument --config: {path}: not a JSON text file (not UTF-8)") from None
    except OSError as error:
        raise ValueError(f"argument --config: {path}: {error.strerror or error}") from None
    try:
        raw = json.loads(text, object_pairs_hook=_refuse_duplicate_keys)
    except json.JSONDecodeError as error:
        raise ValueError(f"argument --config: {path}: not valid JSON ({error.msg} at line {error.lineno} column "
                         f"{error.colno}{'; truncated?' if error.pos >= len(text.rstrip()) else ''})") from None
    except ValueError as error:  # a key given twice
        raise ValueError(f"argument --config: {path}: {error}") from None
    try:
        return ExperimentConfig.from_dict(raw)
    except (ValueError, TypeError) as error:
        raise ValueError(f"argument --config: {path}: {error}") from None


def _refuse_duplicate_keys(pairs: list) -> dict:
    """A JSON object whose key appears twice: refused (json would keep the last one silently)."""
    keys = [key for key, _ in pairs]
    twice = sorted({key for key in keys if keys.count(key) > 1})
    if twice:
        raise ValueError(f"key {twice[0]!r} appears twice in one JSON object; give each setting once")
    return dict(pairs)
