#!/usr/bin/env python3
"""Stand-ins for SLURM's commands (sbatch, srun, sacct, squeue, scancel, scontrol) on one machine.

For tests of the SLURM path without a cluster: ``sbatch`` runs each array element's script
with bash in the background (at most the array's ``%N`` at once) with the environment SLURM
gives a job; the script's ``srun`` starts its tasks (nodes x tasks per node, all on this
host, "localhost") with SLURM's task variables; ``sacct`` reports each element's state from
the files below ``$STANDIN_SLURM_DIR`` (``squeue`` lists those pending or running); ``scancel``
signals an element's process group, or kills it (SIGTERM, then SIGKILL). Each command is this
file under its own name (symlinks in a directory on PATH).

Every call is logged, one line each, in ``$STANDIN_SLURM_DIR/calls.log``. ``$STANDIN_SBATCH``
makes sbatch misbehave: ``fail`` (an error on stderr, exit 1, nothing queued), ``garbage``
(exit 0 with "hello world" on stdout, nothing queued), ``slow:S`` (it writes ``sbatch.started``
and queues the jobs S seconds later, as a busy controller answers).
"""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

STATE = Path(os.environ.get("STANDIN_SLURM_DIR", "/tmp/standin-slurm"))


def _options(script: str) -> dict:
    return dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(.*))?$", script, re.M))


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def sbatch(args):
    mode = os.environ.get("STANDIN_SBATCH", "")
    if mode == "fail":
        print("sbatch: error: Batch job submission failed: Invalid account or account/partition combination specified",
              file=sys.stderr)
        sys.exit(1)
    if mode == "garbage":
        print("hello world")
        return
    if mode.startswith("slow:"):
        _write(STATE / "sbatch.started", str(os.getpid()))
        time.sleep(float(mode[len("slow:"):]))
    path = Path(args[-1])
    script = path.read_text()
    opts = _options(script)
    STATE.mkdir(parents=True, exist_ok=True)
    counter = STATE / "next_id"
    job_id = int(counter.read_text()) if counter.exists() else 1000
    _write(counter, str(job_id + 1))
    array = opts.get("array")
    if array:
        first, last, parallel = map(int, re.match(r"(\d+)-(\d+)%(\d+)", array).groups())
        elements = [f"{job_id}_{i}" for i in range(first, last + 1)]
    else:
        elements, parallel = [str(job_id)], 1
    for element in elements:
        _write(STATE / f"{element}.state", "PENDING")
    copy = STATE / f"{job_id}.sh"  # sbatch reads the script when it is called, as the real one does
    copy.write_text(script)
    subprocess.Popen([sys.executable, os.path.realpath(__file__), "_run_array", str(copy), str(job_id), str(parallel), *elements],
                     start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(f"Submitted batch job {job_id}")


def _run_array(args):
    path, job_id, parallel, *elements = args
    opts = _options(Path(path).read_text())
    running = {}
    waiting = list(elements)
    while waiting or running:
        while waiting and len(running) < int(parallel):
            element = waiting.pop(0)
            if (STATE / f"{element}.state").read_text() == "CANCELLED":
                continue
            env = {**os.environ, "SLURM_JOB_ID": element.replace("_", "9"), "SLURM_JOB_NODELIST": "localhost",
                   "SLURM_JOB_NUM_NODES": opts.get("nodes", "1"), "SLURM_NNODES": opts.get("nodes", "1"),
                   "SLURM_NTASKS_PER_NODE": opts.get("ntasks-per-node", "1"), "SLURM_RESTART_COUNT": "0"}
            if "_" in element:
                env.update(SLURM_ARRAY_JOB_ID=job_id, SLURM_ARRAY_TASK_ID=element.split("_")[1])
            process = subprocess.Popen(["bash", path], env=env, start_new_session=True,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            _write(STATE / f"{element}.pid", str(process.pid))
            _write(STATE / f"{element}.state", "RUNNING")
            running[element] = process
        for element, process in list(running.items()):
            code = process.poll()
            if code is not None:
                del running[element]
                if (STATE / f"{element}.state").read_text() != "CANCELLED":
                    _write(STATE / f"{element}.state", "COMPLETED" if code == 0 else "FAILED")
        time.sleep(0.2)


def srun(args):
    i = 0
    output = None
    while i < len(args) and args[i].startswith("-"):
        if args[i] in ("--output", "--error"):
            output = output or args[i + 1]
            i += 2
        else:
            i += 1
    command = args[i:]
    nodes, per_node = int(os.environ["SLURM_NNODES"]), int(os.environ["SLURM_NTASKS_PER_NODE"])
    tasks = []
    for procid in range(nodes * per_node):
        env = {**os.environ, "SLURM_PROCID": str(procid), "SLURM_NODEID": str(procid // per_node),
               "SLURM_LOCALID": str(procid % per_node), "SLURM_NTASKS": str(nodes * per_node),
               "SLURM_STEP_ID": "0"}
        name = output.replace("%A", os.environ.get("SLURM_ARRAY_JOB_ID", "")).replace(
            "%a", os.environ.get("SLURM_ARRAY_TASK_ID", "")).replace("%j", os.environ["SLURM_JOB_ID"]).replace(
            "%t", str(procid))
        Path(name).parent.mkdir(parents=True, exist_ok=True)
        log = open(name, "a")
        tasks.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
    forward = lambda signum, frame: [t.send_signal(signum) for t in tasks]  # noqa: E731
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2):
        signal.signal(sig, forward)
    codes = [t.wait() for t in tasks]
    sys.exit(next((c for c in codes if c), 0))


def sacct(args):
    ids = [args[i + 1] for i, a in enumerate(args) if a == "-j"]
    print("JobID|State|NodeList")
    for path in sorted(STATE.glob("*.state")):
        element = path.name[:-len(".state")]
        if element.split("_")[0] in ids:
            print(f"{element}|{path.read_text()}|localhost")


def squeue(args):
    ids = args[args.index("--jobs") + 1].split(",")
    for path in sorted(STATE.glob("*.state")):
        element = path.name[:-len(".state")]
        if (element in ids or element.split("_")[0] in ids) and path.read_text() in ("PENDING", "RUNNING"):
            print(element)


def scancel(args):
    sig = next((a.split("=", 1)[1] for a in args if a.startswith("--signal=")), None)
    target = [a for a in args if not a.startswith("-")][0]
    for path in sorted(STATE.glob("*.state")):
        element = path.name[:-len(".state")]
        if element != target and element.split("_")[0] != target:
            continue
        pid_file = STATE / f"{element}.pid"
        if sig is None and path.read_text() in ("PENDING", "RUNNING"):
            _write(path, "CANCELLED")
        if pid_file.exists():
            # A plain scancel: SIGTERM, then SIGKILL (SLURM's KillWait, here 1 s).
            for number in [getattr(signal, f"SIG{sig}")] if sig else [signal.SIGTERM, signal.SIGKILL]:
                try:
                    os.killpg(int(pid_file.read_text()), number)
                except ProcessLookupError:
                    break
                if number == signal.SIGTERM:
                    time.sleep(1.0)


def scontrol(args):
    if args[:2] == ["show", "hostnames"]:
        print("\n".join(args[2].split(",")))


if __name__ == "__main__":
    name = Path(sys.argv[0]).name
    if name == "standin.py":
        name, argv = sys.argv[1], sys.argv[2:]
    else:
        argv = sys.argv[1:]
    STATE.mkdir(parents=True, exist_ok=True)
    with open(STATE / "calls.log", "a") as log:
        log.write(" ".join([name, *argv]) + "\n")
    {"sbatch": sbatch, "srun": srun, "sacct": sacct, "squeue": squeue, "scancel": scancel, "scontrol": scontrol,
     "_run_array": _run_array}[name](argv)
