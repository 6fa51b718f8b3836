"""Reading an experiment's result files. Needs no torch: reports can be made anywhere.

Layout of a run directory written by ``sparsecomm compare``::

    RUN_DIR/experiment.json                  config snapshot, policy, environment, and
                                             "runs": {"<arm>/<seed>": "<arm>-seed<s>-<hash>"}
    RUN_DIR/runs/<arm>-seed<s>-<hash>/summary.json   one paired run (arm x seed), when finished
    RUN_DIR/runs/<arm>-seed<s>-<hash>/steps.jsonl    one JSON object per line:
        {"kind": "train", "step", "train_loss", "step_seconds", "compute_seconds",
         "compress_seconds", "comm_wait_seconds", "bytes_sent", "bytes_dense", "elapsed_seconds"}
        {"kind": "eval", "step", "val_loss", "elapsed_seconds"}

``elapsed_seconds`` counts wall clock from the run's first data touch (evaluation
included). Steps are numbered from 1 (the step just completed).

Statuses. A summary's ``status`` is ``"ok"`` for a finished run; anything else
(``"failed"``, ``"interrupted"``, ``"invalid"`` below, or a status this reader does not
know) is a run that did not finish: every report counts it as failed and shows its
status, none drops it.

Identity. A summary must be the run its directory names: its ``arm``, ``seed`` and
``config_hash`` must equal the ``<arm>``, ``<seed>`` and ``<hash>`` of the directory name,
and that name must be the one ``experiment.json`` lists for that arm and seed (the runner
derives it from the config). A summary that disagrees (copied from another experiment,
another ``--steps``, another seed) is excluded, not mixed in: it is read as a run with
status ``"invalid"`` whose error names the disagreement, so it is counted as failed and
reported. A not-ok summary may lack ``config_hash`` (nothing from it is compared); an ok
one may not.

Malformed files. A result file that cannot be read as ours (truncated or foreign JSON, a
wrong type, a directory that is not a run directory) raises :class:`ResultFileError`,
which names the file (and the line, for ``steps.jsonl``); the commands print it and exit
2. One exception: a last line of ``steps.jsonl`` that is not newline-terminated and does
not parse is a write torn by a crash; it is dropped with a :class:`ResultFileWarning`.
"""
import contextlib
import json
import math
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from sparsecomm.lab.results.layout import (
    EXPERIMENT_FILE,
    NAME_ACCEPTED,
    RUN_NAME_PATTERN,
    RUNS_DIR,
    STEPS_FILE,
    SUMMARY_FILE,
    is_safe_name,
)

INVALID = "invalid"  # status of a summary excluded because it is not the run its directory names


class ResultFileError(ValueError):
    """A result file that cannot be read as one of ours; the message names the file (and line)."""

    def __init__(self, path, message: str, line: int | None = None):
        self.path, self.line = Path(path), line
        super().__init__(f"{path}{f':{line}' if line is not None else ''}: {message}")


class ResultFileWarning(UserWarning):
    """Something in a result file was skipped (a torn last line of steps.jsonl)."""


@contextlib.contextmanager
def warnings_to_stderr(prog: str):
    """Print each :class:`ResultFileWarning` at once as ``<prog>: warning: ...`` (once per
    message: a file read twice warns once); other warnings as usual. For the commands."""
    shown: set[str] = set()
    with warnings.catch_warnings():
        previous = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if not issubclass(category, ResultFileWarning):
                return previous(message, category, filename, lineno, file, line)
            if str(message) not in shown:
                shown.add(str(message))
                print(f"{prog}: warning: {message}", file=sys.stderr, flush=True)

        warnings.simplefilter("always", ResultFileWarning)
        warnings.showwarning = show
        yield


@dataclass(frozen=True)
class Eval:
    step: int
    elapsed_seconds: float
    val_loss: float


@dataclass(frozen=True)
class RunSummary:
    """One finished (or failed) arm x seed run."""

    arm: str
    seed: int
    status: str  # "ok"; anything else ("failed", "interrupted", "invalid", ...) did not finish
    path: Path
    config_hash: str = ""
    error: str = ""
    setup_seconds: float | None = None
    median_step_seconds: float | None = None
    median_compute_seconds: float | None = None
    median_compress_seconds: float | None = None
    median_comm_wait_seconds: float | None = None
    bytes_sent_per_step: float | None = None
    bytes_dense_per_step: float | None = None
    evals: tuple[Eval, ...] = ()
    extra: dict = field(default_factory=dict)

    @property
    def final_val_loss(self) -> float | None:
        return self.evals[-1].val_loss if self.evals else None

    def first_reaching(self, target: float, mode: str = "min") -> Eval | None:
        """The first evaluation at or below ``target`` (at or above it for ``mode="max"``;
        resolution: the eval cadence)."""
        if mode == "max":
            return next((e for e in self.evals if e.val_loss >= target), None)
        return next((e for e in self.evals if e.val_loss <= target), None)

    @property
    def finished(self) -> bool:
        """Status ok and at least one evaluation: the run's figures can be used."""
        return self.status == "ok" and bool(self.evals)

    def describe_problem(self) -> str:
        """Why this run is not used, in one line ("" for a finished run)."""
        if self.status != "ok":
            return f"{self.status}" + (f": {self.error}" if self.error else "")
        return "" if self.evals else "ok but without evaluations"


def status_counts(runs) -> dict[str, int]:
    """Per status other than "ok", how many of ``runs`` have it (ok runs without evaluations
    count as "no evaluations"), in first-seen order."""
    counts: dict[str, int] = {}
    for run in runs:
        if not run.finished:
            key = run.status if run.status != "ok" else "no evaluations"
            counts[key] = counts.get(key, 0) + 1
    return counts


def describe_counts(counts: dict[str, int]) -> str:
    """``{"failed": 2, "interrupted": 1}`` -> ``"2 failed, 1 interrupted"``."""
    return ", ".join(f"{n} {status}" for status, n in counts.items())


# ---------------------------------------------------------------------------------------------
# experiment.json


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_finite(value) -> bool:
    return _is_number(value) and math.isfinite(value)


_CONFIG_FIELDS = {  # what the readers use: key -> (check, accepted)
    "name": (is_safe_name, f"a name of {NAME_ACCEPTED}"),
    "task": (lambda v: v is None or isinstance(v, str), "a string (null for a script)"),
    "arms": (lambda v: isinstance(v, list) and all(is_safe_name(a) for a in v), "a list of arm names"),
    "seeds": (lambda v: isinstance(v, list) and all(_is_int(s) and s >= 0 for s in v), "a list of integers >= 0"),
    "steps": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "world_size": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "policy": (lambda v: isinstance(v, dict), "an object"),
}
_OPTIONAL_CONFIG_FIELDS = {
    "target_loss": (lambda v: v is None or (_is_finite(v) and v > 0), "null or a finite number > 0"),
    "link": (lambda v: isinstance(v, str), "a string"),
    "fault_rate_per_hour": (lambda v: _is_finite(v) and v >= 0, "a finite number >= 0"),
    "metric": (lambda v: isinstance(v, str) and v.isidentifier(), "a metric name"),
    "mode": (lambda v: v in ("min", "max"), '"min" or "max"'),
    "checkpoint_every": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "max_restarts": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "fault": (lambda v: v is None or (isinstance(v, dict) and isinstance(v.get("kind"), str) and _is_int(v.get("rank"))
                                      and _is_int(v.get("step"))),
              'null or {"kind": ..., "rank": ..., "step": ...}'),
}
_POLICY_FIELDS = {
    "quality_tolerance": (lambda v: _is_finite(v) and v > 0, "a finite number > 0"),
    "staleness_limit": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "redundancy_budget": (lambda v: _is_finite(v) and 0 <= v <= 1, "a fraction in [0, 1]"),
}


def _read_json(path: Path, what: str):
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise ResultFileError(path, f"not a {what}: not UTF-8 text") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        detail = "empty" if not text.strip() else f"{error.msg} at line {error.lineno} column {error.colno}"
        raise ResultFileError(path, f"not a {what}: invalid JSON ({detail}; truncated?)") from None


def _validate_experiment(path: Path, raw) -> dict:
    def bad(message: str):
        raise ResultFileError(path, f"not a sparsecomm experiment.json: {message}")

    if not isinstance(raw, dict) or not isinstance(raw.get("config"), dict):
        bad(f'expected a JSON object with a "config" object, got {_short(raw)}')
    config = raw["config"]
    for key, (ok, accepted) in _CONFIG_FIELDS.items():
        if key not in config:
            bad(f"config has no {key!r}")
        if not ok(config[key]):
            bad(f"config.{key} must be {accepted}, got {_short(config[key])}")
    for key, (ok, accepted) in _OPTIONAL_CONFIG_FIELDS.items():
        if key in config and not ok(config[key]):
            bad(f"config.{key} must be {accepted}, got {_short(config[key])}")
    if config.get("fault") is not None and "max_restarts" not in config:
        bad("config has a fault but no 'max_restarts'")
    for key, (ok, accepted) in _POLICY_FIELDS.items():
        if key not in config["policy"] or not ok(config["policy"][key]):
            bad(f"config.policy.{key} must be {accepted}, got {_short(config['policy'].get(key))}")
    runs = raw.get("runs")
    if runs is not None:
        if not isinstance(runs, dict):
            bad(f'"runs" must be an object {{"<arm>/<seed>": "<arm>-seed<seed>-<hash>"}}, got {_short(runs)}')
        for key, name in runs.items():
            match = RUN_NAME_PATTERN.fullmatch(name) if isinstance(name, str) else None
            if match is None or key != f"{match['arm']}/{int(match['seed'])}":
                bad(f'"runs" maps {key!r} to {_short(name)}, not to a run directory "<arm>-seed<seed>-<hash>" '
                    "of that arm and seed")
    return raw


def load_experiment(run_dir: str | Path) -> dict:
    """The ``experiment.json`` snapshot (config, policy, environment), checked to be ours."""
    path = Path(run_dir) / EXPERIMENT_FILE
    if not path.is_file():
        hint = ""
        if (Path(run_dir) / SUMMARY_FILE).is_file():
            hint = " (this looks like one run's directory: give the experiment directory two levels up)"
        raise FileNotFoundError(f"{run_dir} is not an experiment run directory: {path} is missing{hint}")
    return _validate_experiment(path, _read_json(path, "sparsecomm experiment.json"))


def experiment_link(experiment: dict) -> str:
    """The link the experiment's ranks were joined by (``loopback`` when none was emulated)."""
    return str(experiment["config"].get("link", "loopback"))


def arms_configured_first(configured, runs) -> list[str]:
    """The configured arms in their order, then any other arm found among ``runs``, sorted."""
    order = list(configured)
    return order + sorted({r.arm for r in runs} - set(order))


# ---------------------------------------------------------------------------------------------
# summary.json


_SUMMARY_NUMBERS = ("setup_seconds", "median_step_seconds", "median_compute_seconds", "median_compress_seconds",
                    "median_comm_wait_seconds", "bytes_sent_per_step", "bytes_dense_per_step")


def _parse_summary(path: Path, raw) -> dict:
    """The RunSummary fields of a summary.json (types checked; raises ResultFileError)."""
    def bad(message: str):
        raise ResultFileError(path, f"not a sparsecomm summary.json: {message}")

    if not isinstance(raw, dict):
        bad(f"expected a JSON object, got {_short(raw)}")
    for key, ok, accepted in (("arm", is_safe_name, "an arm name"), ("seed", lambda v: _is_int(v) and v >= 0,
                                                                       "an integer >= 0"),
                              ("status", lambda v: isinstance(v, str) and v != "", "a non-empty string")):
        if key not in raw:
            bad(f"no {key!r}")
        if not ok(raw[key]):
            bad(f"{key} must be {accepted}, got {_short(raw[key])}")
    raw = dict(raw)
    for key in ("config_hash", "error"):
        if raw.get(key) is None:
            raw.pop(key, None)
        elif not isinstance(raw[key], str):
            bad(f"{key} must be a string, got {_short(raw[key])}")
    for key in _SUMMARY_NUMBERS:
        if key in raw and raw[key] is not None and not _is_number(raw[key]):
            bad(f"{key} must be a number or null, got {_short(raw[key])}")
    evals = raw.pop("evals", None) or []
    if not isinstance(evals, list):
        bad(f"evals must be a list of [step, elapsed_seconds, val_loss], got {_short(evals)}")
    for index, e in enumerate(evals):
        if not (isinstance(e, list) and len(e) == 3 and _is_int(e[0]) and _is_number(e[1]) and _is_number(e[2])):
            bad(f"evals[{index}] must be [step (integer), elapsed_seconds, val_loss], got {_short(e)}")
    known = {f for f in RunSummary.__dataclass_fields__ if f not in ("path", "evals", "extra")}
    fields = {k: raw.pop(k) for k in list(raw) if k in known}
    fields["evals"] = tuple(Eval(int(s), float(t), float(v)) for s, t, v in evals)
    fields["extra"] = raw
    return fields


def load_summary(path: Path) -> RunSummary:
    """One ``summary.json`` as it is (identity not checked: see :func:`load_runs`)."""
    path = Path(path)
    return RunSummary(path=path.parent, **_parse_summary(path, _read_json(path, "sparsecomm summary.json")))


def _identity_problem(summary: RunSummary, arm: str, seed: int, config_hash: str) -> str:
    problems = []
    if summary.arm != arm:
        problems.append(f"arm {summary.arm!r}, not {arm!r}")
    if summary.seed != seed:
        problems.append(f"seed {summary.seed}, not {seed}")
    if summary.config_hash != config_hash and (summary.config_hash or summary.status == "ok"):
        problems.append(f"config_hash {summary.config_hash or 'none'!r}, not {config_hash!r}")
    return "; ".join(problems)


def _checked_summary(path: Path, arm: str, seed: int, config_hash: str) -> RunSummary:
    """The summary at ``path``, or an "invalid" run of (arm, seed) when it is another run's."""
    summary = load_summary(path)
    problem = _identity_problem(summary, arm, seed, config_hash)
    if not problem:
        return summary
    return RunSummary(arm=arm, seed=seed, status=INVALID, path=path.parent, config_hash=config_hash,
                      error=f"{path} is not this run's summary: it records {problem} (the directory name and "
                            "experiment.json); excluded")


def load_runs(run_dir: str | Path) -> list[RunSummary]:
    """The experiment's runs that have a summary, sorted by (arm, seed); failed runs included.

    Only the runs the current ``experiment.json`` lists count: runs of an earlier config
    stay on disk but are not mixed into this report. A summary that is not the run its
    directory names is returned as status "invalid" (see the module docstring).
    """
    run_dir = Path(run_dir)
    listed = load_experiment(run_dir).get("runs")
    if listed is None:  # before experiment.json listed its runs: every run directory there
        names = sorted(p.parent.name for p in run_dir.glob(f"{RUNS_DIR}/*/{SUMMARY_FILE}"))
        for name in names:
            if RUN_NAME_PATTERN.fullmatch(name) is None:
                raise ResultFileError(run_dir / RUNS_DIR / name, "not a run directory: the name is not "
                                      "<arm>-seed<seed>-<hash>")
        seen: dict[tuple[str, int], str] = {}
        for name in names:
            match = RUN_NAME_PATTERN.fullmatch(name)
            key = (match["arm"], int(match["seed"]))
            if key in seen:
                raise ResultFileError(run_dir / EXPERIMENT_FILE, f"lists no runs, and {seen[key]} and {name} are "
                                      f"both {key[0]} seed {key[1]}: which one belongs to this experiment is unknown")
            seen[key] = name
    else:
        names = list(listed.values())
    runs = []
    for name in names:
        path = run_dir / RUNS_DIR / name / SUMMARY_FILE
        if path.is_file():
            match = RUN_NAME_PATTERN.fullmatch(name)
            runs.append(_checked_summary(path, match["arm"], int(match["seed"]), match["hash"]))
    return sorted(runs, key=lambda r: (r.arm, r.seed))


# ---------------------------------------------------------------------------------------------
# steps.jsonl


def load_steps(run_path: str | Path) -> list[dict]:
    """The rows of a run's ``steps.jsonl``, each checked to be an object with a ``kind`` and,
    for train and eval rows, an integer ``step``.

    A malformed line raises :class:`ResultFileError` naming the file and line, except a
    torn last line (not newline-terminated, not parseable: a crash mid-write), which is
    dropped with a :class:`ResultFileWarning`.
    """
    path = Path(run_path) / STEPS_FILE
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        text = path.read_bytes().decode("utf-8", errors="replace")
    lines = text.split("\n")
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        last_unterminated = number == len(lines)  # text after the last newline
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            if last_unterminated:
                warnings.warn(f"{path}:{number}: torn last line dropped (not newline-terminated and not valid JSON: "
                              "the writer stopped mid-line)", ResultFileWarning, stacklevel=2)
                continue
            raise ResultFileError(path, f"not a steps.jsonl line: invalid JSON ({error.msg} at column {error.colno})",
                                  number) from None
        if "\ufffd" in line and not last_unterminated:
            raise ResultFileError(path, "not a steps.jsonl line: not UTF-8 text", number)
        if not isinstance(row, dict) or not isinstance(row.get("kind"), str):
            raise ResultFileError(path, f'not a steps.jsonl row: expected an object with a "kind", got {_short(row)}',
                                  number)
        if row["kind"] in ("train", "eval") and not _is_int(row.get("step")):
            raise ResultFileError(path, f"{row['kind']} row: step must be an integer, got {_short(row.get('step'))}",
                                  number)
        rows.append(row)
    return rows
