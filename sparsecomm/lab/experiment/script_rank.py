"""One rank of a script run: your script as ``__main__``, and a record of how it ended.

The runner starts ``python -m sparsecomm.lab.experiment.script_rank SCRIPT ARGS...`` in
every rank (under torchrun or mpiexec) rather than the script itself. The script runs as
under ``python SCRIPT ARGS...`` (``__name__ == "__main__"``, ``sys.argv``, its directory
first on ``sys.path``), and however it ends, the run's record says what it did:

- it returns, or calls ``sys.exit()`` / ``sys.exit(0)``: a run it did not finish is
  finished (:meth:`sparsecomm.lab.experiment.script_run.Run.finish`; it needs no process group, so
  a script may have destroyed it), unless the run lacks what a finished run needs: then
  the rank records what the script did and what is missing ("the script returned after
  sparsecomm.lab.init() and 0 optimizer steps, but run.apply(...) was never called");
- it never called ``sparsecomm.lab.init()``: the rank says so;
- it calls ``sys.exit`` with a message or another code, or raises (KeyboardInterrupt
  included): the rank records that, where, and how far the run had come.

A rank that records a failure exits non-zero (``sys.exit``'s own code when it is an
integer, else 1), and the runner reports the run as failed in the rank's words
(``error-rank<r>.json``) rather than the launcher's.
"""
import os
import runpy
import sys
import traceback
from pathlib import Path

from sparsecomm.lab.experiment import script_run
from sparsecomm.lab.experiment.process_tree import RUN_DIR_ENV, die_with_parent
from sparsecomm.lab.experiment.rank_errors import write_rank_error

USAGE = "usage: python -m sparsecomm.lab.experiment.script_rank SCRIPT [ARGS...]"


def _where(error: BaseException, script: Path) -> str:
    """The script's line that raised ``error`` ("train.py:40"), and the innermost frame when
    that is elsewhere ("train.py:12, in argparse.py:2650")."""
    frames = traceback.extract_tb(error.__traceback__)
    mine = [frame for frame in frames if Path(frame.filename).resolve() == script]
    innermost = frames[-1] if frames else None
    if not mine:
        return f"{Path(innermost.filename).name}:{innermost.lineno}" if innermost is not None else "an unknown line"
    here = f"{script.name}:{mine[-1].lineno}"
    return here if innermost is mine[-1] else f"{here}, in {Path(innermost.filename).name}:{innermost.lineno}"


def _progress(run) -> str:
    if run is None:
        return "before calling sparsecomm.lab.init()"
    if not run.applied:
        return "after sparsecomm.lab.init(), before run.apply(...)"
    return f"after {run.steps_taken} optimizer step(s)"


def _fail(error: BaseException, message: str, code: int = 1) -> int:
    """Record the rank's failure in the script's words, say it on stderr, return the exit code."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    write_rank_error(Path(run_dir) if run_dir else None, error, message=message)
    print(f"sparsecomm.lab: {message}", file=sys.stderr, flush=True)
    return code


def conclude(script: Path, ended: BaseException | None) -> int:
    """The exit code of a rank whose script ended with ``ended`` (None: it returned), after
    finishing or recording the run."""
    run = script_run.active_run()
    if isinstance(ended, SystemExit) and ended.code not in (None, 0):
        code = ended.code if isinstance(ended.code, int) else 1
        if not isinstance(ended.code, int):
            print(ended.code, file=sys.stderr)  # as Python prints sys.exit's message
        return _fail(ended, f"the script called sys.exit({ended.code!r}) at {_where(ended, script)}, "
                            f"{_progress(run)}", code)
    if isinstance(ended, KeyboardInterrupt):
        traceback.print_exception(ended)
        return _fail(ended, f"the script raised KeyboardInterrupt at {_where(ended, script)}, {_progress(run)}")
    if ended is not None and not isinstance(ended, SystemExit):
        traceback.print_exception(ended)
        return _fail(ended, str(ended))  # its own type and message: what the script raised
    how = "returned" if ended is None else f"called sys.exit({ended.code!r}) at {_where(ended, script)}"
    if run is None:
        return _fail(RuntimeError(), f"the script {how} without calling sparsecomm.lab.init(): nothing connected it to "
                                     "the run (its arm, seed and run directory); call run = sparsecomm.lab.init() "
                                     "once the process group is up (docs/bring_your_own.md)")
    if run.finished:
        return 0
    missing = run.missing()
    if missing is not None:
        return _fail(RuntimeError(), f"the script {how} after sparsecomm.lab.init() and {run.steps_taken} optimizer "
                                     f"step(s), but {missing}")
    try:
        run.finish()  # the script forgot it: its end is the run's end
    except Exception as error:  # noqa: BLE001 - recorded as the run's error
        traceback.print_exception(error)
        return _fail(error, f"finishing the run after the script {how}: {error}")
    return 0


def main() -> int:
    if len(sys.argv) < 2:
        print(USAGE, file=sys.stderr)
        return 2
    die_with_parent()
    script = Path(sys.argv[1]).resolve()
    sys.argv = sys.argv[1:]
    sys.path[0] = str(script.parent)  # as `python SCRIPT` has it
    ended = None
    try:
        runpy.run_path(str(script), run_name="__main__")
    except BaseException as error:  # noqa: BLE001 - how the script ended is what this records
        ended = error
    return conclude(script, ended)


if __name__ == "__main__":
    sys.exit(main())
