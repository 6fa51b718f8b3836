"""The runner's life cycle with real processes: Ctrl-C / SIGTERM / a stall / a SIGKILLed
runner stop every process of a run (torchrun's ranks run in sessions of their own) and no
stopped run is ever recorded "ok"; an interrupted run with checkpoints resumes bit for bit
with a complete steps.jsonl; two commands on one --out never mix (config hash, run lock,
different --steps); a failing rank's own exception is what the summary records.

Every test that starts processes has a hard deadline and a finaliser that SIGKILLs any
process still mentioning the test's directory, so a failure never leaves one behind.
"""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sparsecomm.lab.experiment import launch, run_records, runner
from sparsecomm.lab.experiment.named import digits_quick
from sparsecomm.lab.results import load_runs, load_steps
from lab_processes import REPO, finish, start_command, wait_for, processes_mentioning, survivors_after, sweep  # noqa: F401
from network_namespaces import emulation_unavailable, network_namespaces_lock

pytestmark = pytest.mark.timeout(240)

LONG = 100_000  # steps: a run that is still training whenever it is stopped (~5 min at full speed)


# ----- processes: tests/lab_processes.py -------------------------------------------------------


def _rows(run_dir: Path) -> list[dict]:
    """steps.jsonl's rows, read here (not by the code under test); an unfinished last line is left out."""
    try:
        text = (run_dir / "steps.jsonl").read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]


def _train_rows(run_dir: Path) -> int:
    return sum(r["kind"] == "train" for r in _rows(run_dir))


def _latest_checkpoint(run_dir: Path) -> int:
    """The step of the latest committed checkpoint (manifest written), 0 if none."""
    steps = [int(p.parent.name[5:]) for p in (run_dir / "checkpoints").glob("step-*/manifest.json")]
    return max(steps, default=0)


# A driver: run_experiment on a config read from a file, ExperimentInterrupted -> a JSON line;
# with a third argument, that command (JSON) stands in for torchrun's.
DRIVER = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from sparsecomm.lab.experiment import launch, runner
    from sparsecomm.lab.experiment.config import ExperimentConfig
    from sparsecomm.lab.experiment.runner import ExperimentInterrupted, run_experiment
    if len(sys.argv) > 3:
        launch.torchrun_command = lambda *args: json.loads(sys.argv[3])
    config = ExperimentConfig.from_dict(json.loads(Path(sys.argv[1]).read_text()))
    try:
        run_experiment(config, Path(sys.argv[2]), progress=lambda line: print(line, flush=True))
    except ExperimentInterrupted as stop:
        print("INTERRUPTED " + json.dumps({"signal": stop.signal_name, "report": stop.report}), flush=True)
        sys.exit({"SIGINT": 130, "SIGTERM": 143}[stop.signal_name])
""")


def _driver(config, root: Path, command: list[str] | None = None) -> subprocess.Popen:
    root.mkdir(parents=True, exist_ok=True)
    path = root.parent / f"{config.name}-config.json"
    path.write_text(json.dumps(config.to_dict()))
    return start_command([sys.executable, "-c", DRIVER, str(path), str(root), *([json.dumps(command)] if command else [])])


def _interruption(output: str) -> dict:
    line = next((line for line in output.splitlines() if line.startswith("INTERRUPTED ")), None)
    assert line is not None, output[-4000:]
    return json.loads(line[len("INTERRUPTED "):])


# ----- item 1: SIGTERM, Ctrl-C, a stall ------------------------------------------------------


def _check_interrupted(run_dir: Path, sig: str, report: str, label: str, kept: str) -> dict:
    """The run's record and the report after ``sig`` stopped the command that trained it."""
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["interrupted"] == sig
    assert summary["error"].startswith(f"interrupted by {sig} after step ") and summary["config_hash"] in run_dir.name
    assert f"stopped by {sig}: experiment " in report, report
    assert f"interrupted: {label} after step {summary['last_step']}" in report, report
    resume = summary["resume_from_step"]
    if resume is None:
        assert _latest_checkpoint(run_dir) == 0
        assert "it has no checkpoint to resume from: a re-run starts it over" in report, report
    else:
        assert resume == _latest_checkpoint(run_dir) and resume % 50 == 0 and 50 <= resume <= summary["last_step"]
        assert f"verified checkpoint at step {resume}: a re-run resumes it from there" in report, report
    assert kept in report, report
    assert not (run_dir / "result.json").exists()
    time.sleep(1.0)  # nothing of that launch is left to turn the record into "ok"
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    return summary


STAND_IN_LAUNCHER = """
import subprocess, sys, time
# As torchrun starts its ranks: a 'rank' in a session of its own; both run until killed.
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", {mark!r}], start_new_session=True)
time.sleep(300)
"""


def test_sigterm_to_the_command_alone_kills_its_run_and_records_it_interrupted(sweep):
    """SIGTERM (to the command alone, as `timeout` sends it) while a run trains: every
    process of the launch dies, the run is recorded "interrupted" (counted as not ok) and
    stays so, and run_experiment raises ExperimentInterrupted with a report naming the run,
    that it has no checkpoint, and the run not started yet. A stand-in for torchrun here
    (what is checked is the runner's side; real torchrun ranks, and Ctrl-C through the real
    command: the resume test below)."""
    root = sweep / "runs"
    mark = f"{sweep}/stand-in-rank"  # in the rank's command line: found here, not by the runner
    config = digits_quick().with_overrides(name="stop", arms=("dense", "topk-ef"), seeds=(0,))
    run_dir = runner.run_directory(config, root, "dense", 0)
    proc = _driver(config, root, [sys.executable, "-c", STAND_IN_LAUNCHER.format(mark=mark)])
    wait_for(lambda: any("-c import time; time.sleep(300)" in line for _, line in processes_mentioning(mark)),
              60, "the stand-in rank", proc)
    os.kill(proc.pid, signal.SIGTERM)
    output = finish(proc, 60)
    assert proc.returncode == 143 and "Traceback" not in output, output[-4000:]
    assert survivors_after(str(sweep), 2.0) == []
    stop = _interruption(output)
    assert stop["signal"] == "SIGTERM"
    _check_interrupted(run_dir, "SIGTERM", stop["report"], "dense seed 0",
                       "kept: 0 finished run(s)\nnot run: topk-ef seed 0")
    (run,) = load_runs(root / "stop")
    assert run.status == "interrupted" and not run.finished


def _namespaces_of(pid: int) -> list[str]:
    from sparsecomm.links import netns

    return [n for n in netns.namespaces() if n.startswith(f"{netns.NAMESPACE_PREFIX}{pid}-")]


@pytest.mark.skipif(emulation_unavailable() is not None,
                    reason="link emulation unavailable (needs root, ip, tc, network namespaces)")
def test_ctrl_c_kills_the_ranks_of_an_emulated_link_and_removes_its_namespaces(sweep):
    """Over an emulated link the runner starts each rank itself (ip netns exec, no torchrun):
    Ctrl-C kills both and the network goes."""
    root = sweep / "runs"
    config = digits_quick().with_overrides(name="link", arms=("dense",), seeds=(0,), steps=LONG, eval_every=1000,
                                           link="100mbit")
    run_dir = runner.run_directory(config, root, "dense", 0)
    with network_namespaces_lock():
        proc = _driver(config, root)
        wait_for(lambda: _train_rows(run_dir) >= 10, 120, "10 training steps", proc)
        assert len(_namespaces_of(proc.pid)) == 3 and len(processes_mentioning(str(run_dir))) >= 2
        os.killpg(proc.pid, signal.SIGINT)
        output = finish(proc, 60)
    assert proc.returncode == 130 and "Traceback" not in output, output[-3000:]
    assert survivors_after(str(sweep), 2.0) == [] and _namespaces_of(proc.pid) == []
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["resume_from_step"] is None
    assert "it has no checkpoint to resume from: a re-run starts it over" in _interruption(output)["report"]


def _fake_tree(monkeypatch, child_code: str):
    """Stands in for torchrun: a launcher that starts one 'rank' in a session of its own (as
    torchrun does) and sleeps; the rank runs ``child_code`` with OUT set to the run directory."""

    def command(config, arm, seed, out_dir, nodes=None):
        child = f"OUT = {str(out_dir)!r}\n" + textwrap.dedent(child_code)
        launcher = ("import subprocess, sys, time\n"
                    f"subprocess.Popen([sys.executable, '-c', {child!r}], start_new_session=True)\n"
                    "time.sleep(120)\n")
        return [sys.executable, "-c", launcher]

    monkeypatch.setattr(launch, "torchrun_command", command)


def test_a_stalled_run_is_killed_whole_and_never_turns_ok(sweep, monkeypatch):
    """The watchdog kills a run that makes no progress: the launcher and the rank in its own
    session. Today's rank survived and later wrote an "ok" summary over the "stalled" one."""
    config = digits_quick().with_overrides(name="stall", arms=("dense",), seeds=(0,), stall_timeout_s=1.5)
    expected = config.run_hash("dense", 0)
    _fake_tree(monkeypatch, f"""
        import json, os, time
        time.sleep(4)  # hung past the stall timeout, then 'finishes'
        for name in ("summary.json", "result.json"):
            with open(os.path.join(OUT, name), "w") as f:
                json.dump({{"arm": "dense", "seed": 0, "status": "ok", "config_hash": {expected!r},
                           "launch_id": os.environ.get("SPARSECOMM_LAUNCH"), "evals": [[1, 0.1, 0.5]]}}, f)
    """)
    started = time.monotonic()
    run_dir = runner.run_experiment(config, sweep, progress=lambda line: None)
    assert time.monotonic() - started < 30
    out_dir = runner.run_directory(config, sweep, "dense", 0)
    assert survivors_after(str(out_dir), 1.0) == []
    time.sleep(4.0)  # past the moment the hung rank would have written its summary
    (run,) = load_runs(run_dir)
    assert run.status == "failed" and run.error.startswith("stalled: no step completed for 1.5 s")
    assert not (out_dir / "result.json").exists()


# ----- processes that hide: a session of their own, an empty environment, no parent ----------

HIDING_LAUNCHER = """
import subprocess, sys, time
# What a script may do: start a process in a session of its own with a cleared environment
# (no mark of the run), then leave it behind (its parent exits or is killed).
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", {mark!r}], env={{}}, start_new_session=True,
                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
{then}
"""
RUNNER_WITH_COMMAND = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from sparsecomm.lab.experiment import launch, runner
    from sparsecomm.lab.experiment.config import ExperimentConfig
    launch.torchrun_command = lambda *args: json.loads(sys.argv[3])
    config = ExperimentConfig.from_dict(json.loads(sys.argv[1]))
    runner.run_experiment(config, Path(sys.argv[2]), progress=lambda line: print(line, flush=True))
""")


@pytest.mark.parametrize("how", ["launch-ends", "run-killed-as-stalled", "runner-sigkilled"])
def test_a_process_that_hid_from_the_run_ends_with_it(sweep, monkeypatch, how):
    mark = f"{sweep}/hidden-process"  # in its command line: found here (and by the sweep fixture), not by the runner
    then = "sys.exit(1)" if how == "launch-ends" else "time.sleep(120)"
    launcher = [sys.executable, "-c", HIDING_LAUNCHER.format(mark=mark, then=then)]
    config = digits_quick().with_overrides(name="hide", arms=("dense",), seeds=(0,), stall_timeout_s=1.5)
    if how == "runner-sigkilled":
        driver = start_command([sys.executable, "-c", RUNNER_WITH_COMMAND, json.dumps(config.to_dict()), str(sweep / "out"),
                         json.dumps(launcher)])
        wait_for(lambda: any("-c import time; time.sleep(300)" in line for _, line in processes_mentioning(mark)),
                  60, "hidden process", driver)  # the hidden process itself, not its launcher
        os.kill(driver.pid, signal.SIGKILL)
        finish(driver, 30)
    else:
        monkeypatch.setattr(launch, "torchrun_command", lambda *args: launcher)
        runner.run_experiment(config, sweep / "out", progress=lambda line: None)
    assert survivors_after(mark, 10.0) == []


# ----- item 2 and G2: resume after an interruption ------------------------------------------

RESUME = digits_quick().with_overrides(name="resume", arms=("topk-ef", "dense"), seeds=(0,), steps=400,
                                       eval_every=50, checkpoint_every=50)


def _finished_dense(root: Path) -> None:
    """A finished dense run in place (only the top-k run matters here; dense is skipped)."""
    out_dir = runner.run_directory(RESUME, root, "dense", 0)
    out_dir.mkdir(parents=True)
    (out_dir / "summary.json").write_text(json.dumps({
        "arm": "dense", "seed": 0, "status": "ok", "config_hash": RESUME.run_hash("dense", 0),
        "evals": [[400, 1.0, 0.1]], "median_step_seconds": 0.002}))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted")
    _finished_dense(root)
    experiment_dir = runner.run_experiment(RESUME, root, progress=lambda line: None)
    run = {r.arm: r for r in load_runs(experiment_dir)}["topk-ef"]
    assert run.status == "ok", run.error
    return run


def _check_rows_after_a_kill(run_dir: Path, at_least: int) -> list[dict]:
    """G2: whatever a kill left parses, holds every step up to the last one, no more."""
    assert (run_dir / "steps.jsonl").read_bytes().endswith(b"\n")
    rows = _rows(run_dir)
    train = [r["step"] for r in rows if r["kind"] == "train"]
    assert train == list(range(1, len(train) + 1)) and at_least <= len(train) < RESUME.steps, train[-3:]
    return rows


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_run_stopped_by_ctrl_c_then_by_sigkill_resumes_each_time_bit_for_bit(sweep, uninterrupted):
    """One top-k run, stopped twice and resumed twice (each launch is seconds of start-up).

    First Ctrl-C to the process group of the real command (`sparsecomm compare --config`,
    as a terminal sends it) after the run's step-100 checkpoint: every torchrun rank dies,
    the run is recorded "interrupted" (counted as not ok) and stays so, and the command
    prints a report naming the run and its checkpoint and exits 130. A re-run resumes from
    that checkpoint and is SIGKILLed, the runner alone, two checkpoints later: nothing of
    it can clean up, so the ranks must die with it, and steps.jsonl must still parse (a
    torn last line is added to be sure it is dropped). Its latest checkpoint is then
    corrupted (a flipped byte in a rank file): the last re-run falls back to the one before
    it (written by the resumed launch), says so in the summary, and ends equal to the
    uninterrupted run at every step; steps.jsonl holds exactly the rows up to each resume
    point followed by the recomputed ones."""
    root = sweep / "runs"
    reference = uninterrupted
    run_dir = runner.run_directory(RESUME, root, "topk-ef", 0)
    _finished_dense(root)

    config_file = sweep / "resume.json"
    config_file.write_text(json.dumps(RESUME.to_dict()))
    proc = start_command([sys.executable, "-m", "sparsecomm", "compare", "--config", str(config_file), "--out", str(root),
                   "--plots", str(sweep / "plots")])
    wait_for(lambda: _latest_checkpoint(run_dir) >= 100, 120, "checkpoint at step 100", proc)
    wait_for(lambda: len(processes_mentioning(str(run_dir))) >= 3, 10, "torchrun and two ranks", proc)
    os.killpg(proc.pid, signal.SIGINT)
    output = finish(proc, 60)
    assert proc.returncode == 130 and "Traceback" not in output, output[-4000:]
    assert survivors_after(str(sweep), 5.0) == [], output[-3000:]
    summary = _check_interrupted(run_dir, "SIGINT", output, "topk-ef seed 0", "kept: 1 finished run(s): dense seed 0")
    first = summary["resume_from_step"]
    assert first >= 100 and "not run:" not in output, output[-3000:]
    runs = {r.arm: r for r in load_runs(root / "resume")}
    assert runs["topk-ef"].status == "interrupted" and not runs["topk-ef"].finished and runs["dense"].finished
    kept_first = [r for r in _check_rows_after_a_kill(run_dir, first) if r["step"] <= first]

    proc = _driver(RESUME, root)
    wait_for(lambda: _latest_checkpoint(run_dir) >= first + 2 * RESUME.checkpoint_every, 120,
              f"checkpoint at step {first + 2 * RESUME.checkpoint_every}", proc)
    os.kill(proc.pid, signal.SIGKILL)
    output = finish(proc, 60)
    assert survivors_after(str(sweep), 5.0) == [], output[-3000:]
    assert proc.returncode == -signal.SIGKILL and not (run_dir / "summary.json").exists()
    assert f"[1/2] topk-ef seed 0: resuming from its checkpoint at step {first}" in output, output[-3000:]
    rows = _check_rows_after_a_kill(run_dir, first + 2 * RESUME.checkpoint_every)
    assert rows[: len(kept_first)] == kept_first  # the record up to the checkpoint is kept as it was
    resume = _latest_checkpoint(run_dir)
    shard = run_dir / "checkpoints" / f"step-{resume:08d}" / "rank1.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    restored = resume - RESUME.checkpoint_every
    kept = [r for r in rows if r["step"] <= restored]
    with open(run_dir / "steps.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 99999, "train_lo')  # a torn write

    lines = []
    experiment_dir = runner.run_experiment(RESUME, root, progress=lines.append)
    assert f"[1/2] topk-ef seed 0: resuming from its checkpoint at step {resume}" in lines, lines
    assert "[2/2] dense seed 0: finished earlier, skipped" in " ".join(lines), lines
    run = {r.arm: r for r in load_runs(experiment_dir)}["topk-ef"]
    assert run.status == "ok", run.error
    assert run.extra["resumed_from_steps"] == [first, restored] and run.extra["restarts"] == 0
    fallbacks = run.extra["checkpoint_fallbacks"]
    assert [f["restored"] for f in fallbacks] == [restored] and list(fallbacks[0]["skipped"]) == [str(resume)]
    rows = load_steps(run.path)
    assert rows[: len(kept)] == kept and rows[: len(kept_first)] == kept_first
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(1, RESUME.steps + 1))
    assert [r["train_loss"] for r in rows if r["kind"] == "train"] == \
        [r["train_loss"] for r in load_steps(reference.path) if r["kind"] == "train"]
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [e.step for e in reference.evals]
    assert run.final_val_loss == reference.final_val_loss
    assert [e.val_loss for e in run.evals] == [e.val_loss for e in reference.evals]
    # the clock goes on from the checkpoint: the time between the launches is not the run's
    assert run.extra["total_seconds"] < 3 * reference.extra["total_seconds"] + 5


def test_steps_log_drops_a_torn_last_line_and_a_resume_point_needs_every_step(tmp_path):
    from sparsecomm.lab.experiment.steps_log import read_steps, rows_up_to

    rows = [{"kind": "train", "step": s, "train_loss": 1.0 / s} for s in range(1, 31)]
    rows.insert(20, {"kind": "eval", "step": 20, "val_loss": 0.5, "elapsed_seconds": 1.0})
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "steps.jsonl").write_text(text + '{"kind": "train", "st')
    assert read_steps(tmp_path) == rows
    assert rows_up_to(rows, 20) == rows[:21] and rows_up_to(rows, 31) is None
    assert rows_up_to([r for r in rows if r["step"] != 7], 20) is None  # a gap
    assert rows_up_to(rows[:5] + rows[4:], 20) is None  # a repeated step
    run_records.mend_steps(tmp_path)
    assert (tmp_path / "steps.jsonl").read_text() == text
    (tmp_path / "steps.jsonl").write_text(text + '{"kind": "nonsense"\n' + text)
    with pytest.raises(ValueError, match="steps.jsonl:32: not a steps.jsonl line"):
        read_steps(tmp_path)  # damage in the middle is not a torn write


def test_checkpoints_without_the_steps_before_them_are_set_aside_not_resumed(tmp_path, monkeypatch):
    """A run directory whose steps.jsonl was lost (what today's runner did at every launch)
    cannot be resumed without a gap: its checkpoints are moved aside, the run starts over."""
    config = digits_quick().with_overrides(arms=("dense",), seeds=(0,), checkpoint_every=10)
    out_dir = runner.run_directory(config, tmp_path, "dense", 0)
    step_dir = out_dir / "checkpoints" / "step-00000020"
    step_dir.mkdir(parents=True)
    (step_dir / "manifest.json").write_text(json.dumps({"config_hash": config.run_hash("dense", 0), "step": 20}))
    (out_dir / "steps.jsonl").write_text("".join(json.dumps({"kind": "train", "step": s}) + "\n" for s in (1, 2)))
    monkeypatch.setattr(launch, "torchrun_command", lambda *args: [sys.executable, "-c", "import sys; sys.exit(1)"])
    lines = []
    runner.run_experiment(config, tmp_path, progress=lines.append)
    assert any("does not hold every step up to its checkpoint at step 20: set aside in discarded-" in line
               for line in lines), lines
    (aside,) = out_dir.glob("discarded-*")
    assert (aside / "checkpoints" / "step-00000020" / "manifest.json").exists() and (aside / "steps.jsonl").exists()
    assert not (out_dir / "checkpoints").exists()


# ----- item 3: two commands on one --out ------------------------------------------------------


def test_a_summary_of_another_config_is_not_finished_and_is_kept_aside(tmp_path, monkeypatch):
    config = digits_quick().with_overrides(arms=("dense",), seeds=(0,), steps=20)
    out_dir = runner.run_directory(config, tmp_path, "dense", 0)
    out_dir.mkdir(parents=True)
    foreign = {"arm": "dense", "seed": 0, "status": "ok", "config_hash": "0123456789ab", "evals": [[40, 1.0, 0.3]]}
    (out_dir / "summary.json").write_text(json.dumps(foreign))
    assert not runner.finished_ok(out_dir) and not runner.finished_ok(out_dir, config.run_hash("dense", 0))
    monkeypatch.setattr(launch, "torchrun_command", lambda *args: [sys.executable, "-c", "import sys; sys.exit(2)"])
    lines = []
    runner.run_experiment(config, tmp_path, progress=lines.append)
    assert any("records config hash 0123456789ab, not this run's" in line and "set aside in foreign-" in line
               for line in lines), lines
    (aside,) = out_dir.glob("foreign-*")
    assert json.loads((aside / "summary.json").read_text()) == foreign
    assert json.loads((out_dir / "summary.json").read_text())["status"] == "failed"


def test_a_run_another_process_holds_is_skipped_then_waited_for_and_its_lock_dies_with_it(sweep, monkeypatch):
    """A process holds the run's lock, finishes the run and is SIGKILLed (its lock goes with
    it: never stale). This command skips the run, comes back to it, waits, and finds it
    finished by the other process: it never launches it."""
    config = digits_quick().with_overrides(arms=("dense",), seeds=(0,), steps=20)
    out_dir = runner.run_directory(config, sweep, "dense", 0)
    out_dir.mkdir(parents=True)
    summary = {"arm": "dense", "seed": 0, "status": "ok", "config_hash": config.run_hash("dense", 0),
               "evals": [[20, 1.0, 0.3]], "median_step_seconds": 0.001}
    holder = start_command([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, json, os, time
        fd = os.open({str(out_dir / "run.lock")!r}, os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, str(os.getpid()).encode())
        print("locked", flush=True)
        time.sleep(2)
        with open({str(out_dir / "summary.json")!r}, "w") as f:
            json.dump({summary!r}, f)
        print("finished", flush=True)
        time.sleep(120)
    """)])
    assert holder.stdout.readline().strip() == "locked"

    def kill_holder_when_finished():
        assert holder.stdout.readline().strip() == "finished"
        holder.kill()

    import threading

    killer = threading.Thread(target=kill_holder_when_finished, daemon=True)
    killer.start()
    monkeypatch.setattr(launch, "torchrun_command",
                        lambda *args: [sys.executable, "-c", "import sys; sys.exit('launched')"])
    lines = []
    runner.run_experiment(config, sweep, progress=lines.append)
    killer.join(10)
    finish(holder, 10)
    assert lines == [
        f"[1/1] dense seed 0: another process (pid {holder.pid}) is running it; skipped for now, back to it at the end",
        f"[1/1] dense seed 0: waiting for another process (pid {holder.pid}), which is running it",
        f"[1/1] dense seed 0: finished by another process, skipped ({out_dir.name})",
    ]
    assert not (out_dir / "launch.log").exists()


def _compare(root: Path, plots: Path, *extra: str) -> subprocess.Popen:
    return start_command([sys.executable, "-m", "sparsecomm", "compare", "--experiment", "digits-quick", "--arms", "dense",
                   "topk-ef", "--seeds", "0", "--out", str(root), "--plots", str(plots), *extra])


def _flock_holders(path: Path) -> int:
    """How many flock()s are held on the file ``path`` (/proc/locks; read here, not by the runner)."""
    st = os.stat(path)
    file_id = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    with open("/proc/locks") as f:
        return sum(line.split()[1] == "FLOCK" and line.split()[5] == file_id for line in f)


@pytest.mark.slow
def test_commands_on_one_out_train_each_run_once_and_never_mix(sweep):
    """Three commands into one --out at once. Two identical `sparsecomm compare` commands
    (30 steps of dense and topk-ef) train each run once between them (one skips what the
    other trains, then finds it finished) and both print the full report. A third command
    of the same experiment with 40 steps (run_experiment in a process of its own, dense
    only), started once the first wrote experiment.json, waits for both (they would rewrite
    each other's experiment.json) and then trains its own run: every run directory holds
    the run its name's hash says. Today the 20-step runs of such a pair read the 40-step
    command's experiment.json and wrote 40-step results under 20-step names."""
    root = sweep / "runs"
    first = _compare(root, sweep / "plots1", "--steps", "30")
    second = _compare(root, sweep / "plots2", "--steps", "30")
    wait_for(lambda: (root / "digits-quick" / "experiment.json").exists(), 60, "the first experiment.json", first)
    configs = [digits_quick().with_overrides(arms=("dense", "topk-ef"), seeds=(0,), steps=30),
               digits_quick().with_overrides(arms=("dense",), seeds=(0,), steps=40)]
    assert json.loads((root / "digits-quick" / "experiment.json").read_text())["config"] == configs[0].to_dict()
    # Both hold the experiment for their config (a shared lock each) before the third starts.
    (config_lock,) = (root / "digits-quick" / ".locks").glob("config-*.lock")
    wait_for(lambda: _flock_holders(config_lock) == 2, 60, "both commands holding the experiment", second)
    third = _driver(configs[1], root)
    outputs = [finish(first, 200), finish(second, 200), finish(third, 200)]
    assert [first.returncode, second.returncode, third.returncode] == [0, 0, 0], outputs
    both = "\n".join(outputs[:2])
    for arm in ("dense", "topk-ef"):
        trained = [line for line in both.splitlines() if f"] {arm} seed 0: final val loss" in line]
        skipped = [line for line in both.splitlines() if f"] {arm} seed 0: finished" in line and "skipped" in line]
        assert len(trained) == 1 and len(skipped) == 1, both
    for out in outputs[:2]:
        assert "policy: quality tolerance 0.05" in out  # both printed the full report
    for config in configs:
        for arm in config.arms:
            out_dir = runner.run_directory(config, root, arm, 0)
            summary = json.loads((out_dir / "summary.json").read_text())
            assert summary["status"] == "ok" and summary["config_hash"] == config.run_hash(arm, 0), out_dir
            assert [r["step"] for r in load_steps(out_dir) if r["kind"] == "train"] == list(range(1, config.steps + 1))
            assert summary["evals"][-1][0] == config.steps
    assert "with a different configuration" in outputs[2] and "waiting until it ends" in outputs[2], outputs[2]
    assert "] dense seed 0: final val loss" in outputs[2], outputs[2]  # its own run, trained
    assert json.loads((root / "digits-quick" / "experiment.json").read_text())["config"]["steps"] == 40
    assert [(r.arm, r.status, r.evals[-1].step) for r in load_runs(root / "digits-quick")] == [("dense", "ok", 40)]


# ----- item 4: the failing rank's own error ---------------------------------------------------


def test_a_rank_that_raises_is_recorded_with_its_own_exception(tmp_path, monkeypatch):
    """Rank 1 raises inside its third optimizer step (injected through sitecustomize, only in
    rank 1's process): the summary names rank 1, the exception type and its message,
    not torchrun's ChildFailedError; the launch log's tail is kept beside it."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(textwrap.dedent("""
        import os
        if os.environ.get("RANK") == "1" and os.environ.get("SPARSECOMM_TEST_FAILING_RANK") == "1":
            import torch
            calls = []
            step = torch.optim.SGD.step
            def failing_step(self, *args, **kwargs):
                calls.append(1)
                if len(calls) == 3:
                    raise ZeroDivisionError("rank 1 cannot step: injected by the test")
                return step(self, *args, **kwargs)
            torch.optim.SGD.step = failing_step
    """))
    monkeypatch.setenv("SPARSECOMM_TEST_FAILING_RANK", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(inject), os.environ.get("PYTHONPATH")) if p))
    config = digits_quick().with_overrides(arms=("dense",), seeds=(0,), steps=20)
    (run,) = load_runs(runner.run_experiment(config, tmp_path / "runs", progress=lambda line: None))
    assert run.status == "failed"
    assert run.error == "rank 1: ZeroDivisionError: rank 1 cannot step: injected by the test", run.error
    assert "ChildFailedError" not in run.error
    rank_error = run.extra["rank_error"]
    assert rank_error["rank"] == 1 and rank_error["type"] == "ZeroDivisionError"
    assert any("in failing_step" in frame for frame in rank_error["frames"])
    assert any("worker.py" in frame and "in train_run" in frame for frame in rank_error["frames"])
    assert run.extra["launch_log_tail"].startswith("exit code 1: ")
    assert processes_mentioning(str(tmp_path)) == []
