"""The ``sparsecomm`` entry point: every command is reachable, bad input exits 2 before work,
and compare / frontier end an interrupted or dense-less experiment without a traceback."""
import json
import os
from pathlib import Path

import pytest

from run_dir_fixture import write_run_dir
from sparsecomm.lab import cli
from sparsecomm.lab.experiment import runner
from sparsecomm.lab.experiment.config import MAX_SEED, task_train_samples
from sparsecomm.lab.experiment.named import digits_quick
from sparsecomm.lab.results.policy import Policy


def test_help_lists_every_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("compare", "ledger", "check", "plot"):
        assert f"  {command} " in out


def test_unknown_command_exits_2(capsys):
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["compare", "--steps", "0"], "steps must be an integer >= 1, got 0"),
        (["compare", "--seeds", "-1"], "seeds must be distinct integers >= 0"),
        (["compare", "--arms", "topk-ef"], "arms must be a list that includes 'dense'"),
        (["compare", "--experiment", "nope"], "invalid choice: 'nope'"),
        (["compare", "--config", "/nonexistent/config.json"], "No such file"),
    ],
)
def test_compare_refuses_bad_arguments_before_launching(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing was written, nothing launched


# --- compare and frontier: everything refused before the first run; what a run ends with --------

@pytest.fixture
def no_launch(monkeypatch):
    """runner.run_experiment fails the test if called: nothing may start."""
    def run_experiment(*args, **kwargs):
        raise AssertionError("a run was started")

    monkeypatch.setattr(runner, "run_experiment", run_experiment)


def _refused(argv, tmp_path, capsys) -> str:
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--out", str(out), "--plots", str(tmp_path / "plots")])
    assert exit_info.value.code == 2
    assert not out.exists()
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def _config_file(tmp_path, content: str):
    path = tmp_path / "exp.json"
    path.write_text(content)
    return path


GOOD = json.dumps({"name": "mine", "task": "digits-mlp", "arms": ["dense", "topk-ef"], "seeds": [0], "steps": 5})


@pytest.mark.parametrize("content, message", [
    ("null", "must be a JSON object of ExperimentConfig fields, got null"),
    ("[1, 2]", "must be a JSON object of ExperimentConfig fields, got list"),
    ('"digits"', "must be a JSON object of ExperimentConfig fields, got str"),
    ('{"name": "x", "task": "digits-mlp", "densty": 0.1}', "unknown experiment config keys ['densty']"),
    ('{"task": "digits-mlp"}', "name is required"),
    ('{"name": "x", "task": "digits-mlp", "policy": 5}', "policy must be a JSON object of Policy fields, got 5"),
    ('{"name": "x", "task": "digits-mlp", "policy": {"tolerance": 1}}', "unknown policy keys ['tolerance']"),
    ('{"name": "x", "task": "digits-mlp", "seeds": [[0]]}', "seeds must be distinct integers >= 0"),
    ('{"name": "x", "task": "digits-mlp", "seeds": 3}', "seeds must be a JSON list, got 3"),
    ('{"name": "x", "task": "digits-mlp", "arms": "dense"}', "arms must be a JSON list, got 'dense'"),
    ('{"name": "x", "task": "digits-mlp", "lr": "0.1"}', "lr must be a finite number > 0, got '0.1'"),
    ('{"name": "x", "task": "digits-mlp", "link": 5}', "link must be"),
    ('{"name": "x", "task": ', "not valid JSON (Expecting value at line 1 column 23; truncated?)"),
    ('{"name": "../up", "task": "digits-mlp"}', "name must be a non-empty string without '/'"),
    ('{"name": "x", "task": "digits-mlp", "lr": 0.1, "lr": 0.2}', "key 'lr' appears twice in one JSON object"),
])
def test_every_bad_config_file_names_the_file_and_the_field(content, message, tmp_path, capsys, no_launch):
    path = _config_file(tmp_path, content)
    err = _refused(["compare", "--config", str(path)], tmp_path, capsys)
    assert f"argument --config: {path}: " in err and message in err, err


@pytest.mark.parametrize("argv, message", [
    (["--seeds", str(2**64)], f"seeds must be distinct integers >= 0 and <= {MAX_SEED}"),
    (["--seeds", "0", str(2**32)], f"seeds must be distinct integers >= 0 and <= {MAX_SEED}"),
    (["--name", ".."], "argument --name: must be 1 to 128 characters"),
    (["--name", "a/b"], "argument --name: must be 1 to 128 characters"),
    (["--name", "a\0b"], "argument --name: must be 1 to 128 characters"),
    (["--name", ""], "argument --name: must be 1 to 128 characters"),
    (["--name", "x" * 129], "argument --name: must be 1 to 128 characters"),
    (["--arms", "dense"], "argument --arms: needs at least one arm besides 'dense'"),
])
def test_compare_refuses_bad_seeds_names_and_arms_before_any_run(argv, message, tmp_path, capsys, no_launch):
    err = _refused(["compare", "--experiment", "digits-quick", *argv], tmp_path, capsys)
    assert message in err, err


@pytest.mark.parametrize("field, value, message", [
    ("world_size", 1_000_000, "world_size must be an integer >= 2 and <= 1024, got 1000000"),
    ("batch_size", 10**9, "batch_size must be an integer >= 1 and <= 718 (samples per rank per step: the digits-mlp "
                          "task's 1437 training samples / world_size 2"),
    ("arms", ["dense"], "needs at least one arm besides 'dense'"),
])
def test_compare_bounds_world_and_batch_size(field, value, message, tmp_path, capsys, no_launch):
    path = _config_file(tmp_path, json.dumps({**json.loads(GOOD), field: value}))
    err = _refused(["compare", "--config", str(path)], tmp_path, capsys)
    assert message in err and str(path) in err, err


def test_compare_bounds_the_world_size_by_this_machines_cores(tmp_path, capsys, no_launch, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    path = _config_file(tmp_path, json.dumps({**json.loads(GOOD), "world_size": 9}))
    err = _refused(["compare", "--config", str(path)], tmp_path, capsys)
    assert "world_size must be <= 8 for a run on this machine (4 ranks per CPU core x 2 cores" in err


def test_task_sizes_used_for_the_batch_bound_are_the_tasks_own():
    from sparsecomm.lab.tasks import get_task

    for task in ("digits-mlp", "pydoc-gpt"):
        assert task_train_samples(task) == get_task(task).num_train_samples


@pytest.mark.parametrize("which", ["--out", "--plots"])
def test_unwritable_out_or_plots_is_refused_before_any_run(which, tmp_path, capsys, no_launch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    dirs = {"--out": str(tmp_path / "out"), "--plots": str(tmp_path / "plots"), which: str(blocker / "sub")}
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["compare", "--experiment", "digits-quick", "--out", dirs["--out"], "--plots", dirs["--plots"]])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {which}: {blocker / 'sub' / 'digits-quick'} cannot be created: {blocker} is not a directory" in err
    assert not (tmp_path / "out").exists()


def _fake_runs(monkeypatch, curves, failed=()):
    def run_experiment(config, out_root, progress=print):
        return write_run_dir(out_root / config.name, curves, failed=failed)

    monkeypatch.setattr(runner, "run_experiment", run_experiment)


@pytest.mark.parametrize("signal_name, code", [("SIGINT", 130), ("SIGTERM", 143)])
@pytest.mark.parametrize("command", ["compare", "frontier"])
def test_an_interrupted_experiment_prints_its_report_and_exits_with_the_signal(
        command, signal_name, code, tmp_path, capsys, monkeypatch):
    def run_experiment(config, out_root, progress=print):
        raise runner.ExperimentInterrupted("stopped by a signal: 2 runs kept, dense seed 1 resumes at step 100",
                                           signal_name)

    monkeypatch.setattr(runner, "run_experiment", run_experiment)
    argv = ["--experiment", "digits-quick", "--out", str(tmp_path / "out"), "--plots", str(tmp_path / "plots")]
    if command == "frontier":
        argv += ["--densities", "0.01"]
    assert cli.main([command, *argv]) == code
    err = capsys.readouterr().err
    assert "stopped by a signal: 2 runs kept, dense seed 1 resumes at step 100" in err and "Traceback" not in err


def test_compare_without_a_finished_dense_run_says_so_and_exits_4(tmp_path, capsys, monkeypatch):
    curves = {("topk-ef", s): [(10, 1.0, 2.0), (20, 2.0, 1.5)] for s in (0, 1, 2)}
    _fake_runs(monkeypatch, curves, failed=(("dense", 0), ("dense", 1), ("dense", 2)))
    code = cli.main(["compare", "--experiment", "digits-quick", "--out", str(tmp_path / "out"),
                     "--plots", str(tmp_path / "plots")])
    out, err = capsys.readouterr()
    assert code == 4, err
    assert "ledger: not available: no dense run finished (3 failed)" in out
    assert "verdicts: not available: no dense run finished (3 failed)" in out
    assert "dense seed 0: failed: RuntimeError: gloo timeout" in out
    assert "Traceback" not in err


def test_frontier_counts_failed_runs_and_a_density_without_dense_is_unavailable(tmp_path, capsys, monkeypatch):
    dense = {0: 1.50, 1: 1.52, 2: 1.49}

    def run_experiment(config, out_root, progress=print):
        curves = {(arm, s): [(10, 1.0, 2.0), (20, 2.0, dense[s] + (0.0 if arm == "dense" else 0.001 * s))]
                  for arm in config.arms for s in dense}
        failed = ()
        if config.density == 0.01:  # one topk-ef seed failed
            failed = (("topk-ef", 3),)
        if config.density == 0.001:  # every dense run failed
            curves = {k: v for k, v in curves.items() if k[0] != "dense"}
            failed = tuple(("dense", s) for s in dense)
        return write_run_dir(out_root / config.name, curves, failed=failed)

    monkeypatch.setattr(runner, "run_experiment", run_experiment)
    out = tmp_path / "out"
    assert cli.main(["frontier", "--experiment", "digits-quick", "--densities", "0.01", "0.001", "--arms", "topk-ef",
                     "--out", str(out), "--plots", str(tmp_path / "plots")]) == 0
    points = {p["density"]: p for p in json.loads((out / "digits-quick-frontier.json").read_text())}
    # topk-ef seed 3 failed, so dense seed 3 (configured, never run here) is missing
    assert (points[0.01]["failed"], points[0.01]["dense_failed"], points[0.01]["not_ok"]) == \
        (1, 1, "arm: 1 failed; dense: 1 missing")
    assert points[0.001]["verdict"] == "unavailable" and points[0.001]["dense_failed"] == 3
    printed = capsys.readouterr().out
    assert "failed runs (any status but ok, or missing; not compared): 5" in printed  # 1 + 3 + dense seed 3 missing


def test_run_hash_covers_steps_and_a_non_default_staleness_limit():
    base = digits_quick()
    assert base.run_hash("dense", 0) != base.with_overrides(steps=base.steps + 1).run_hash("dense", 0)
    root = Path("runs")
    assert runner.run_directory(base, root, "dense", 0) != runner.run_directory(base.with_overrides(steps=10), root,
                                                                                 "dense", 0)
    # The staleness limit is recorded in the run (unverified_reason): another limit is another run.
    assert base.run_hash("topk-ef", 0) != base.with_overrides(policy=Policy(staleness_limit=5)).run_hash("topk-ef", 0)
    # The default keeps earlier hashes; the tolerance only changes the report.
    assert base.run_hash("topk-ef", 0) == base.with_overrides(policy=Policy(quality_tolerance=1.0,
                                                                            staleness_limit=1000)).run_hash("topk-ef", 0)


HUGE_TASK = """
from sparsecomm.lab.tasks import Task

class Huge(Task):
    name = "huge"
    num_train_samples = 10**12
    build_model = train_batch = loss = val_loss = None

def make():
    return Huge()
"""


def test_batch_size_of_a_task_with_a_huge_dataset_is_bounded_by_the_global_batch(tmp_path, monkeypatch):
    from sparsecomm.lab.experiment.config import ExperimentConfig

    monkeypatch.chdir(tmp_path)
    (tmp_path / "huge_task.py").write_text(HUGE_TASK)
    bound = 2**20 // 4  # the stated bound on the global batch, over 4 ranks
    with pytest.raises(ValueError, match=rf"batch_size must be an integer >= 1 and <= {bound} \(samples per rank per "
                                         rf"step: MAX_GLOBAL_BATCH 1048576 \(2\*\*20\) samples per step over all ranks "
                                         rf"/ world_size 4.*got 1000000000"):
        ExperimentConfig(name="x", task="huge_task.py:make", world_size=4, batch_size=10**9)
    with pytest.raises(ValueError, match=rf"<= {bound} .*got {bound + 1}"):
        ExperimentConfig(name="x", task="huge_task.py:make", world_size=4, batch_size=bound + 1)
    assert ExperimentConfig(name="x", task="huge_task.py:make", world_size=4, batch_size=bound).batch_size == bound


def test_an_arm_with_transport_mpi_needs_the_mpiexec_launcher(tmp_path, capsys, no_launch):
    err = _refused(["compare", "--experiment", "digits-quick", "--arms", "dense", "m=topk:transport=mpi"], tmp_path,
                   capsys)
    assert ("arm 'm': transport 'mpi' needs launcher 'mpiexec' (the ranks must be one MPI job; under torchrun every "
            "rank is an MPI job of one process), got launcher 'torchrun'") in err, err
    config = digits_quick().with_overrides(launcher="mpiexec", arms=("dense", "m"),
                                           arm_definitions={"m": {"reducer": "topk", "options": {"transport": "mpi"}}})
    assert config.arm("m").options["transport"] == "mpi"  # one MPI job: accepted
