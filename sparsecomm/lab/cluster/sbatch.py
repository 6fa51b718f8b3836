"""One call of ``sbatch``: the job id it gives a script, or a :class:`SubmissionError` that
says what it printed and how it exited.

sbatch runs in a session of its own, so a Ctrl-C at the terminal reaches the command only:
the command waits for sbatch's answer and then cancels what it queued, where sbatch killed
halfway could have queued a job whose id no one learns.
"""
import re
import signal
import subprocess
from pathlib import Path

SUBMITTED = re.compile(r"^Submitted batch job (\d+)", re.M)
"""What sbatch prints on stdout once it queued a script (``--parsable`` is not used: the
line also names the cluster where there are several)."""
SHOWN_CHARS = 2000
"""How much of what sbatch printed an error quotes."""


class SubmissionError(RuntimeError):
    """sbatch failed or printed no job id: nothing this command knows of was queued."""


def submit(script: Path) -> str:
    """Queue ``script`` with sbatch; its job id."""
    try:
        done = subprocess.run(["sbatch", str(script)], capture_output=True, text=True, errors="replace",
                              start_new_session=True)
    except OSError as error:
        raise SubmissionError(f"sbatch could not be started: {error}") from None
    if done.returncode < 0:
        how = f"was killed by {_signal_name(-done.returncode)}"
    elif done.returncode > 0:
        how = f"failed with exit code {done.returncode}"
    else:
        match = SUBMITTED.search(done.stdout)
        if match is not None:
            return match.group(1)
        how = "exited with 0 but printed no job id (if it queued one, find it with squeue --me and scancel it)"
    raise SubmissionError(f"sbatch {how}; it printed: {_printed(done)}")


def _printed(done: subprocess.CompletedProcess) -> str:
    streams = [f"{name}: {text.strip()!r}" for name, text in (("stdout", done.stdout), ("stderr", done.stderr))
               if text.strip()]
    return "; ".join(streams)[:SHOWN_CHARS] if streams else "nothing"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
