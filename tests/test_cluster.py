"""Runs as jobs (sparsecomm.lab.cluster): the same results as one by one, locally in parallel
and through SLURM (stand-in commands on PATH: tests/slurm_standin), the sbatch script of a
2-node run against its golden file, Ctrl-C that cancels every job and leaves nothing running,
and a re-run that resumes the interrupted runs to the uninterrupted runs' results.

Every experiment is the digits task (2 ranks, a few dozen steps); the one-by-one runner's
results are the oracle, computed once per module.
"""
import itertools
import json
import re
import os
import signal
import sys
import threading
from pathlib import Path

import pytest

from lab_processes import REPO, finish, processes_mentioning, start_command, survivors_after, sweep, wait_for  # noqa: F401
from sparsecomm.lab.cluster.arguments import cluster_from_arguments
from sparsecomm.lab.cluster.executors import sbatch_script
from sparsecomm.lab.experiment.cluster_settings import ClusterSettings
from sparsecomm.lab.cluster.submit import core_slots
from sparsecomm.lab import compare
from sparsecomm.lab.experiment.named import digits_quick

pytestmark = pytest.mark.timeout(300)

JOB_IDS = itertools.count(1000, 100)
GOLDEN = Path(__file__).parent / "golden" / "sbatch-2-nodes.txt"
STANDIN = Path(__file__).parent / "slurm_standin" / "standin.py"
ARGS = ["--experiment", "digits-quick", "--arms", "dense", "topk-dgc", "--seeds", "0", "--steps", "25"]


def final_losses(root: Path, name: str = "digits-quick") -> dict:
    """Run directory name -> (status, final val loss), read from each summary.json."""
    out = {}
    for run in sorted((root / name / "runs").iterdir()):
        summary = json.loads((run / "summary.json").read_text())
        out[run.name] = (summary["status"], summary["evals"][-1][-1] if summary.get("evals") else None)
    return out


def run_compare(root: Path, *extra: str) -> int:
    return compare.main([*ARGS, "--out", str(root / "runs"), "--plots", str(root / "plots"), *extra])


@pytest.fixture(scope="module")
def one_by_one(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("one-by-one")
    assert run_compare(root) == 0
    return final_losses(root / "runs")


# ----- settings and arguments ----------------------------------------------------------------


@pytest.mark.parametrize("raw, named", [
    ({"kind": "pbs"}, "cluster.kind"),
    ({"kind": "local", "parallel": 0}, "cluster.parallel"),
    ({"kind": "local", "nodes": 2}, "cluster.nodes"),
    ({"kind": "local", "partition": "gpu"}, "cluster.partition"),
    ({"kind": "slurm", "slurm": {"array": "0-3"}}, "cluster.slurm"),
    ({"kind": "slurm", "tasks_per_node": 2, "gpus_per_node": 4}, "cluster.tasks_per_node"),
    ({"kind": "slurm", "time_min": 0}, "cluster.time_min"),
    ({"kind": "slurm", "time_min": 365 * 24 * 60 + 1}, "cluster.time_min must be an integer from 1 to 525600"),
    ({"kind": "slurm", "queue": "x"}, "unknown cluster keys ['queue']"),
    # A newline in a free-form option would start a line of the sbatch script of its own.
    ({"kind": "slurm", "slurm": {"qos": "high\ntouch X #"}}, "cluster.slurm: the value of qos must be"),
    ({"kind": "slurm", "slurm": {"qos": "high\r"}}, "cluster.slurm: the value of qos must be"),
    ({"kind": "slurm", "slurm": {"qos\n#SBATCH --time=99999": "x"}}, "cluster.slurm: 'qos\\n#SBATCH --time=99999' is not"),
    ({"kind": "slurm", "slurm": {"comment": ""}}, "cluster.slurm: the value of comment must be"),
    ({"kind": "slurm", "partition": "gpu\n#SBATCH --time=99999"}, "cluster.partition"),
    # sbatch takes the beginning of an option for the option: sig is --signal.
    ({"kind": "slurm", "slurm": {"sig": "USR1@1"}}, "cluster.slurm: sig begins signal, which sparsecomm sets itself"),
    ({"kind": "slurm", "slurm": {"ntasks": 4}}, "cluster.slurm: ntasks is set by sparsecomm itself"),
])
def test_bad_cluster_settings_are_refused_by_name(raw, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        ClusterSettings.from_dict(raw)


def test_free_form_sbatch_options_each_make_one_directive():
    slurm = {"account": "ml", "exclusive": True, "cpus_per_gpu": 4, "constraint": "a100&nvlink", "comment": "two words"}
    script = sbatch_script(ClusterSettings(kind="slurm", slurm=slurm), Path("/EXPERIMENT"), "x", world_size=2, runs=2)
    directives = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert len(directives) == len(slurm) + 10  # array, cpus-per-task, job-name, nodes, ntasks-per-node, open-mode,
    #                                            output, signal, time, wckey
    assert "#SBATCH --signal=USR2@120" in directives and "#SBATCH --time=60" in directives
    assert "#SBATCH --comment='two words'" in directives  # quoted as sbatch reads its script


def test_the_experiment_checks_its_cluster_against_world_size_and_link():
    base = digits_quick()
    with pytest.raises(ValueError, match=r"world_size \(2\) must equal nodes \(2\) x ranks per node \(4"):
        base.with_overrides(cluster={"kind": "slurm", "nodes": 2, "gpus_per_node": 4})
    with pytest.raises(ValueError, match="link must be 'loopback' with a cluster"):
        base.with_overrides(cluster={"kind": "local"}, link="1gbit")
    config = base.with_overrides(cluster={"kind": "slurm", "nodes": 2, "tasks_per_node": 1})
    assert config.run_hash("dense", 0) == base.run_hash("dense", 0)  # where a run trains is not what it is


def test_cluster_arguments_need_a_cluster_and_keep_sparsecomms_own_options(capsys):
    with pytest.raises(SystemExit):
        compare.main([*ARGS, "--parallel", "2"])
    assert "argument --parallel: needs --cluster" in capsys.readouterr().err
    parser = compare.build_parser()
    args = parser.parse_args([*ARGS, "--cluster", "slurm", "--slurm", "time=10"])
    with pytest.raises(ValueError, match="argument --slurm: time is set by sparsecomm itself"):
        cluster_from_arguments(args, None)
    args = parser.parse_args([*ARGS, "--cluster", "slurm", "--nodes", "2", "--slurm", "account=ml",
                              "--slurm", "exclusive=true"])
    assert cluster_from_arguments(args, {"kind": "local", "parallel": 3}) == {
        "kind": "slurm", "nodes": 2, "slurm": {"account": "ml", "exclusive": True}}


@pytest.mark.parametrize("argv, message", [
    (["--slurm", "qos=high\ntouch X #"], "argument --slurm: the value of qos must be"),
    (["--slurm", "sig=USR1@1"], "argument --slurm: sig begins signal"),
    (["--time", "525601"], "argument --time: must be an integer from 1 to 525600 (minutes: at most 365 days)"),
])
def test_unsafe_slurm_arguments_are_refused_before_anything_runs(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        compare.main([*ARGS, "--out", str(tmp_path / "runs"), "--plots", str(tmp_path / "plots"), "--cluster", "slurm",
                      *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
    args = compare.build_parser().parse_args([*ARGS, "--cluster", "slurm", "--time", "525600"])
    assert cluster_from_arguments(args, None)["time_min"] == 365 * 24 * 60  # the bound itself is accepted


def test_slurm_without_its_commands_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
    from sparsecomm.lab import frontier

    monkeypatch.setenv("PATH", str(tmp_path))  # none of SLURM's commands
    out = ["--out", str(tmp_path / "runs"), "--plots", str(tmp_path / "plots"), "--cluster", "slurm"]
    for main, argv in ((compare.main, ARGS), (frontier.main, ["--experiment", "digits-quick", "--densities", "0.01",
                                                              "--arms", "topk-ef"])):
        with pytest.raises(SystemExit):
            main([*argv, *out])
        assert "cluster kind 'slurm': no sbatch, scancel, squeue, sacct, srun, scontrol on PATH" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("missing", ["scancel", "squeue", "sacct", "scontrol"])
def test_slurm_without_one_of_its_commands_is_refused_by_name(tmp_path, monkeypatch, capsys, missing):
    # sbatch and srun alone would submit, and a Ctrl-C would then fail to cancel (no scancel).
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in {"sbatch", "srun", "sacct", "squeue", "scancel", "scontrol"} - {missing}:
        (bin_dir / name).symlink_to(STANDIN)
    monkeypatch.setenv("PATH", str(bin_dir))
    with pytest.raises(SystemExit):
        run_compare(tmp_path, "--cluster", "slurm")
    assert f"cluster kind 'slurm': no {missing} on PATH" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_cores_are_divided_between_parallel_runs():
    assert core_slots(2, [0, 1, 2, 3, 4]) == [[0, 2, 4], [1, 3]]
    assert core_slots(3, [0, 1]) == [[0], [1], [0]]


def test_the_sbatch_script_of_a_2_node_run_matches_its_golden_file():
    settings = ClusterSettings(kind="slurm", nodes=2, gpus_per_node=4, partition="gpu", time_min=120, parallel=2,
                               slurm={"account": "ml", "exclusive": True})
    script = sbatch_script(settings, Path("/EXPERIMENT"), "pydoc-gpt", world_size=8, runs=6)
    assert script.replace(sys.executable, "PYTHON") == GOLDEN.read_text()


# ----- runs as jobs ---------------------------------------------------------------------------


def test_local_jobs_two_at_once_give_the_one_by_one_results_to_every_digit(tmp_path, one_by_one, sweep):
    assert run_compare(tmp_path, "--cluster", "local", "--parallel", "2") == 0
    assert final_losses(tmp_path / "runs") == one_by_one
    assert all(status == "ok" for status, _ in one_by_one.values())
    assert (tmp_path / "runs" / "digits-quick" / "jobs").is_dir()  # submitit's files, beside the runs
    assert survivors_after(str(tmp_path), 5.0) == []


@pytest.fixture
def slurm_on_path(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("sbatch", "srun", "sacct", "squeue", "scancel", "scontrol"):
        (bin_dir / name).symlink_to(STANDIN)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("STANDIN_SLURM_DIR", str(tmp_path / "slurm"))
    (tmp_path / "slurm").mkdir()
    # Job ids unique in this process, as a real cluster's are (submitit caches finished jobs' states by id).
    (tmp_path / "slurm" / "next_id").write_text(str(next(JOB_IDS)))
    return tmp_path / "slurm"


def test_a_slurm_job_array_gives_the_one_by_one_results(tmp_path, one_by_one, slurm_on_path, sweep, capsys):
    assert run_compare(tmp_path, "--cluster", "slurm", "--parallel", "2", "--partition", "debug") == 0
    assert final_losses(tmp_path / "runs") == one_by_one
    assert re.search(r"submitted SLURM job \d+ \(2 elements\)", capsys.readouterr().out)
    script = next((tmp_path / "runs" / "digits-quick" / "jobs").rglob("*_submission.sh")).read_text()
    assert "#SBATCH --array=0-1%2" in script and "#SBATCH --partition=debug" in script
    # Each element's script ends just after its job wrote its result.
    wait_for(lambda: sorted(p.read_text() for p in slurm_on_path.glob("*.state")) == ["COMPLETED"] * 2, 20,
             "both array elements COMPLETED")


@pytest.mark.parametrize("mode, printed", [
    ("fail", "sbatch failed with exit code 1; it printed: stderr: 'sbatch: error: Batch job submission failed: "
             "Invalid account"),
    ("garbage", "sbatch exited with 0 but printed no job id (if it queued one, find it with squeue --me and scancel "
                "it); it printed: stdout: 'hello world'"),
])
def test_a_failing_sbatch_is_an_error_that_says_what_it_printed_and_leaves_no_job_files(
        tmp_path, slurm_on_path, monkeypatch, capsys, mode, printed):
    monkeypatch.setenv("STANDIN_SBATCH", mode)
    assert run_compare(tmp_path, "--cluster", "slurm") == 2
    assert f"sparsecomm compare: error: {printed}" in capsys.readouterr().err
    jobs = tmp_path / "runs" / "digits-quick" / "jobs"
    assert jobs.is_dir() and list(jobs.iterdir()) == []  # no pickle, no script: nothing will read them
    assert (slurm_on_path / "calls.log").read_text().count("sbatch ") == 1


def test_sigterm_while_sbatch_is_slow_cancels_the_jobs_it_queued(tmp_path, slurm_on_path, monkeypatch, capsys, sweep):
    # SIGTERM to the command alone while sbatch has not answered yet: the command waits for the
    # job id, then cancels every element of the array; none runs on.
    from sparsecomm.lab.cluster import submit

    monkeypatch.setenv("STANDIN_SBATCH", "slow:2")
    monkeypatch.setattr(submit, "CANCEL_GRACE_S", 2.0)  # the elements that had not started yet are killed sooner
    first_id = int((slurm_on_path / "next_id").read_text())

    def terminate_once_sbatch_runs():
        wait_for(lambda: (slurm_on_path / "sbatch.started").exists(), 60, "sbatch started")
        os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=terminate_once_sbatch_runs, daemon=True)
    sender.start()
    assert run_compare(tmp_path, "--cluster", "slurm") == 143
    sender.join()
    err = capsys.readouterr().err
    assert "stopped by SIGTERM" in err and "its 2 running job(s) were cancelled" in err, err
    calls = (slurm_on_path / "calls.log").read_text().splitlines()
    assert f"scancel --signal=INT --full {first_id}_0" in calls and f"scancel --signal=INT --full {first_id}_1" in calls
    wait_for(lambda: all(p.read_text() not in ("PENDING", "RUNNING") for p in slurm_on_path.glob("*.state")), 20,
             "every element ended")
    assert survivors_after(str(tmp_path), 10.0) == []


def test_a_planted_jobs_folder_is_refused_before_any_job_is_submitted(tmp_path, capsys):
    # jobs/ receives the pickles each job unpickles: a link there would let its owner run code as the user.
    victim = tmp_path / "victim"
    victim.mkdir()
    jobs = tmp_path / "runs" / "digits-quick" / "jobs"
    jobs.parent.mkdir(parents=True)
    jobs.symlink_to(victim, target_is_directory=True)
    with pytest.raises(SystemExit) as exit_info:
        run_compare(tmp_path, "--cluster", "local")
    assert exit_info.value.code == 2
    assert f"{jobs} is a symbolic link (to {victim}): refused" in capsys.readouterr().err
    assert list(victim.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory of another user needs root")
def test_a_jobs_folder_of_another_user_is_refused(tmp_path, capsys):
    jobs = tmp_path / "runs" / "digits-quick" / "jobs"
    jobs.mkdir(parents=True)
    os.chown(jobs, 65534, 65534)  # nobody: could swap the pickles in it
    with pytest.raises(SystemExit):
        run_compare(tmp_path, "--cluster", "local")
    assert f"{jobs} belongs to another user (uid 65534, not 0)" in capsys.readouterr().err
    assert list(jobs.iterdir()) == []


SLEEPER = """
import os, signal, time
from pathlib import Path


def wait_for_sigterm(marker):
    def on_term(signum, frame):
        Path(marker).write_text("SIGTERM")
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    Path(marker + ".started").write_text(str(os.getpid()))
    time.sleep(600)
"""
SUBMITTER = """
import sys, time
from pathlib import Path

import sleeper
from sparsecomm.lab.cluster.executors import make_executor
from sparsecomm.lab.experiment.cluster_settings import ClusterSettings

executor = make_executor(ClusterSettings(kind="local"), Path(sys.argv[1]), "orphan", world_size=1, runs=1)
executor.submit(sleeper.wait_for_sigterm, sys.argv[2])
time.sleep(600)
"""


def test_a_local_job_is_cancelled_when_its_command_is_killed(tmp_path, sweep):
    # SIGKILL cannot be caught: the job's controller gets SIGTERM (the cancel it forwards to its job) from the kernel.
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    marker = tmp_path / "got"
    proc = start_command([sys.executable, "-c", SUBMITTER, str(tmp_path / "experiment"), str(marker)],
                         env={**os.environ, "PYTHONPATH": str(tmp_path)})
    wait_for(lambda: Path(f"{marker}.started").exists(), 60, "the job started", proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    wait_for(marker.exists, 10, "the job got SIGTERM")
    assert marker.read_text() == "SIGTERM"
    assert survivors_after(str(tmp_path), 10.0) == []  # its controller ended with it


@pytest.mark.slow  # ~50 s: the rendezvous of two torchruns; scripts/run_slow_tests.sh
def test_a_run_on_two_nodes_joins_its_torchruns_and_gives_the_one_by_one_results(tmp_path, one_by_one,
                                                                                    slurm_on_path, sweep):
    # Two stand-in "nodes" on this host: one torchrun each (1 rank), met by a c10d rendezvous.
    assert run_compare(tmp_path, "--cluster", "slurm", "--nodes", "2", "--tasks-per-node", "1") == 0
    assert final_losses(tmp_path / "runs") == one_by_one
    runs = tmp_path / "runs" / "digits-quick" / "runs"
    assert all((run / "launch-node1.log").is_file() for run in runs.iterdir())  # node 1 started its own torchrun


@pytest.mark.parametrize("accounting", [pytest.param(True, marks=pytest.mark.slow), False],
                         ids=["sacct", "no-accounting-storage"])
def test_a_slurm_job_that_fails_before_training_records_its_own_error(tmp_path, slurm_on_path, sweep, monkeypatch,
                                                                     accounting):
    # The job's Python cannot import the package: the run's directory says so, with the job's log.
    # Without accounting storage sacct knows no job: that the job left squeue tells it ended.
    if not accounting:
        sacct = tmp_path / "bin" / "sacct"
        sacct.unlink()
        sacct.write_text("#!/bin/sh\necho 'Slurm accounting storage is disabled'\nexit 1\n")
        sacct.chmod(0o755)
    bad = tmp_path / "badpython"
    bad.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'raise ImportError(\"no sparsecomm on this node\")'\n")
    bad.chmod(0o755)
    from sparsecomm.lab.cluster import executors

    original = executors.make_executor

    def with_bad_python(*args, **kwargs):
        executor = original(*args, **kwargs)
        executor.python = str(bad)
        return executor

    monkeypatch.setattr(executors, "make_executor", with_bad_python)
    assert run_compare(tmp_path, "--cluster", "slurm") != 0
    runs = final_losses(tmp_path / "runs")
    assert [status for status, _ in runs.values()] == ["failed", "failed"]
    summary = json.loads(next((tmp_path / "runs" / "digits-quick" / "runs").glob("dense-*/summary.json")).read_text())
    assert "ended without recording the run" in summary["error"] and "no sparsecomm on this node" in summary["error"]


def latest_checkpoint(run_dir: Path) -> int:
    """The step of the run's latest committed checkpoint (manifest written), 0 if none."""
    return max((int(p.parent.name[5:]) for p in (run_dir / "checkpoints").glob("step-*/manifest.json")), default=0)


def job_processes(tmp_path: Path) -> list[int]:
    """The jobs' own processes (submitit's task process, which runs RunJob)."""
    return [pid for pid, cmdline in processes_mentioning(str(tmp_path)) if "submitit.core._submit" in cmdline]


def jobs_experiment(tmp_path: Path) -> tuple[list[str], Path, Path]:
    """A local --parallel 2 compare with checkpoints, as a command line; its config file and runs."""
    config = digits_quick().with_overrides(name="digits-jobs", arms=("dense", "topk-dgc"), seeds=(0,), steps=240,
                                           checkpoint_every=10)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config.to_dict()))
    argv = [sys.executable, "-m", "sparsecomm.lab.cli", "compare", "--config", str(path), "--out", str(tmp_path / "runs"),
            "--plots", str(tmp_path / "plots"), "--cluster", "local", "--parallel", "2"]
    return argv, path, tmp_path / "runs" / "digits-jobs" / "runs"


def checkpointed_past(runs: Path, steps: dict):
    """A condition: both runs have a committed checkpoint past ``steps`` (run name -> step)."""
    return lambda: runs.is_dir() and len(list(runs.iterdir())) == 2 and all(
        latest_checkpoint(run) > steps.get(run.name, 0) for run in runs.iterdir())


def assert_equal_to_an_uninterrupted_run(tmp_path: Path, config_path: Path) -> None:
    resumed = final_losses(tmp_path / "runs", "digits-jobs")
    assert [s for s, _ in resumed.values()] == ["ok"] * 2
    plain = tmp_path / "plain"
    assert compare.main(["--config", str(config_path), "--out", str(plain / "runs"), "--plots", str(plain / "plots")]) == 0
    assert final_losses(plain / "runs", "digits-jobs") == resumed


def job_logs(tmp_path: Path) -> str:
    return "".join(p.read_text() for p in (tmp_path / "runs" / "digits-jobs" / "jobs").rglob("*_log.out"))


@pytest.mark.slow
def test_ctrl_c_cancels_every_job_and_a_rerun_resumes_them_to_the_uninterrupted_results(tmp_path, sweep):
    argv, config_path, runs = jobs_experiment(tmp_path)
    proc = start_command(argv)
    wait_for(checkpointed_past(runs, {}), 120, "a checkpoint in both runs", proc)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C at the terminal sends (the jobs have sessions of their own)
    output = finish(proc, 120)
    assert proc.returncode == 130, output
    assert "cancelling 2 job(s)" in output and "interrupted: " in output, output
    assert "resumes from its checkpoint at step" in output, output
    assert survivors_after(str(tmp_path), 10.0) == [], output  # no job, torchrun or rank is left
    assert [s for s, _ in final_losses(tmp_path / "runs", "digits-jobs").values()] == ["interrupted"] * 2

    again = finish(start_command(argv), 240)
    assert job_logs(tmp_path).count("resuming from its checkpoint") == 2, again
    assert_equal_to_an_uninterrupted_run(tmp_path, config_path)


@pytest.mark.slow  # ~1 min; scripts/run_slow_tests.sh
def test_a_job_warned_of_its_time_limit_is_requeued_and_resumes_to_the_uninterrupted_results(tmp_path, sweep):
    # SIGUSR2 (what a job gets before its time limit, or a preemption) to both jobs once each has a
    # checkpoint: each records its run interrupted, is requeued by submitit and resumes.
    argv, config_path, runs = jobs_experiment(tmp_path)
    proc = start_command(argv)
    wait_for(checkpointed_past(runs, {}), 120, "a checkpoint in both runs", proc)
    jobs = job_processes(tmp_path)
    assert len(jobs) == 2
    for pid in jobs:
        os.kill(pid, signal.SIGUSR2)
    output = finish(proc, 240)
    assert proc.returncode == 0, output
    assert job_logs(tmp_path).count("resuming from its checkpoint") == 2, output
    assert all(len(list(run.glob("interrupted-*.json"))) == 1 for run in runs.iterdir())  # the stop is kept
    assert_equal_to_an_uninterrupted_run(tmp_path, config_path)
