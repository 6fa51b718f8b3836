"""Your own task and your own training script in a paired experiment, end to end through
``sparsecomm compare``, then ``sparsecomm check``; and the library without the lab.

The examples in experiments/examples/ are what a user would write; these tests run them as
a user would (the command line, 2 ranks, dense and one other arm, a small budget). The
commands that run experiments and read them go through the command's own entry in the
test's process (each launch is still torchrun or mpiexec and ranks of their own); the
commands refused before anything runs are started as ``python -m sparsecomm``.
Every run is a launch of its own (torchrun and its ranks start from scratch, seconds each),
so the tests take as few runs as their assertions need: two seeds where pairing across seeds
is checked, one elsewhere (``check`` then says INCONCLUSIVE, n < 3: its verdicts over seeds
are tested on results in test_tolerance.py); the script tests share one ``compare`` run; two
script endings that both finish the run share a launch; and what run.finish() says without
the metric is checked on ranks forked in-process (a script raising it is the "raises" ending).
"""
import contextlib
import io
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from deadline import run_with_deadline
from sparsecomm.lab.results import load_runs, load_steps
from sparsecomm.lab.results.target import Target
from sparsecomm.lab.tasks import load_user_task
from sparsecomm.lab.tolerance import equivalence

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "experiments" / "examples"
VERDICTS = ("EQUIVALENT", "INCONCLUSIVE", "WORSE", "BETTER")


def _sparsecomm(*args, cwd=ROOT, timeout=400) -> subprocess.CompletedProcess:
    """``python -m sparsecomm ARGS`` as a process of its own."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return run_with_deadline([sys.executable, "-m", "sparsecomm", *map(str, args)], timeout=timeout, env=env, cwd=cwd)


def _sparsecomm_here(*args) -> subprocess.CompletedProcess:
    """``sparsecomm ARGS`` through the command's own entry (sparsecomm.lab.cli.main) in this
    process, from the repository root, output captured: what ``python -m sparsecomm`` runs,
    without starting an interpreter that imports torch, scipy and matplotlib again for every
    command (seconds each). The runs a compare launches are processes of their own as ever."""
    from sparsecomm.lab import cli

    output = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
        patch.chdir(ROOT)
        patch.setenv("OMP_NUM_THREADS", "1")
        patch.setattr(sys, "path", list(sys.path))  # a --task's directory goes on it: not for the tests after
        try:
            code = cli.main([str(arg) for arg in args])
        except SystemExit as stop:  # argparse's refusals
            code = stop.code
    return subprocess.CompletedProcess(["sparsecomm", *map(str, args)], code, output.getvalue(), None)


def _compare(tmp_path, *args, seeds=(0,), script_args=()) -> Path:
    result = _sparsecomm_here("compare", *args, "--seeds", *seeds, "--out", tmp_path / "runs", "--plots",
                              tmp_path / "plots", *(("--", *script_args) if script_args else ()))
    assert result.returncode == 0, result.stdout[-4000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    return run_dir


def _check_gives_a_verdict(run_dir: Path, arm: str) -> str:
    result = _sparsecomm_here("check", run_dir)
    assert result.returncode in (0, 1, 3), result.stdout[-3000:]  # equivalent / worse / inconclusive
    line = next(line for line in result.stdout.splitlines() if line.strip().startswith(arm))
    assert any(verdict in line.upper() for verdict in VERDICTS), result.stdout
    return result.stdout


# --- your own task --------------------------------------------------------------------------


def test_a_user_task_runs_paired_through_compare_and_check(tmp_path):
    run_dir = _compare(tmp_path, "--task", "experiments/examples/user_task.py:make_task", "--arms", "dense",
                       "t3=topk:density=0.003,momentum=0.9", "--steps", 30, seeds=(0, 1))
    runs = load_runs(run_dir)
    assert sorted((r.arm, r.seed) for r in runs) == sorted((a, s) for a in ("dense", "t3") for s in (0, 1))
    assert all(r.status == "ok" and r.evals[-1].step == 30 for r in runs)
    spec = json.loads(next(run_dir.glob("runs/t3-seed0-*/summary.json")).read_text())
    assert spec["arm_spec"]["options"]["density"] == 0.003 and spec["arm_spec"]["options"]["momentum"] == 0.9
    # Paired: dense and the arm started from the same weights (same seed), so their first
    # training losses agree; different seeds start elsewhere.
    first = {(arm, seed): load_steps(next(run_dir.glob(f"runs/{arm}-seed{seed}-*")))[0]["train_loss"]
             for arm in ("dense", "t3") for seed in (0, 1)}
    assert first[("dense", 0)] == first[("t3", 0)] and first[("dense", 1)] == first[("t3", 1)]
    assert first[("dense", 0)] != first[("dense", 1)]
    _check_gives_a_verdict(run_dir, "t3")


def test_user_task_errors_name_the_task(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="nothere.py: no such file"):
        load_user_task("nothere.py:make")
    (tmp_path / "bad_tasks.py").write_text("def make():\n    return 42\n")
    with pytest.raises(ValueError, match=r"make\(\) returned int, not a sparsecomm.lab.tasks.Task"):
        load_user_task("bad_tasks.py:make")
    with pytest.raises(ValueError, match="has no callable 'other'"):
        load_user_task("bad_tasks:other")  # a module next to you imports, as with python -m
    result = _sparsecomm("compare", "--task", "bad_tasks.py:make", "--out", tmp_path / "runs", cwd=tmp_path)
    assert result.returncode == 2 and "returned int" in result.stdout
    assert not (tmp_path / "runs").exists()  # refused before anything ran


def test_a_task_file_imports_its_neighbours_whatever_the_current_directory(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "neighbour_of_task.py").write_text("SAMPLES = 77\n")
    (tmp_path / "sub" / "task_with_neighbour.py").write_text(textwrap.dedent("""
        from sparsecomm.lab.tasks import Task
        import neighbour_of_task
        class Small(Task):
            num_train_samples = neighbour_of_task.SAMPLES
            build_model = train_batch = loss = val_loss = None
        def make():
            return Small()
        """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])  # restored afterwards
    assert load_user_task("sub/task_with_neighbour.py:make").num_train_samples == 77


@pytest.mark.parametrize("task, source, said", [
    ("sys:exit", None, "task sys:exit: exit() ended the process (SystemExit, code None) instead of returning"),
    ("quits.py:make", "import sys\ndef make():\n    sys.exit(0)\n",
     "task quits.py:make: make() ended the process (SystemExit, code 0)"),
    ("quits.py:make", "import sys\nsys.exit(0)\n",
     "task quits.py:make: importing quits.py ended the process (SystemExit, code 0)"),
    ("quits.py:make", "def make():\n    raise KeyboardInterrupt\n", "task quits.py:make: make() raised KeyboardInterrupt"),
])
def test_a_task_that_exits_or_interrupts_fails_the_command(tmp_path, task, source, said):
    if source is not None:
        (tmp_path / "quits.py").write_text(source)
    result = _sparsecomm("compare", "--task", task, "--out", tmp_path / "runs", cwd=tmp_path, timeout=120)
    assert result.returncode == 2 and said in result.stdout, result.stdout[-3000:]
    assert not (tmp_path / "runs").exists()  # refused before anything ran


# --- your own script ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def user_script_run(tmp_path_factory) -> tuple[Path, Path]:
    """One compare of user_script.py, shared by the two tests below: dense and topk-dgc, seed 0,
    30 steps, the script's own --eval-every 10, and the metric val_accuracy (higher is better)
    with its tolerance (topk-ef runs the script under mpiexec below). Returns (run directory,
    plots root)."""
    tmp_path = tmp_path_factory.mktemp("user_script")
    run_dir = _compare(tmp_path, "--script", EXAMPLES / "user_script.py", "--arms", "dense", "topk-dgc", "--steps", 30,
                       "--metric", "val_accuracy", "--mode", "max", "--tolerance", 0.05, script_args=("--eval-every", 10))
    return run_dir, tmp_path / "plots"


def test_a_user_script_runs_paired_through_compare_and_check(user_script_run):
    run_dir, plots = user_script_run
    runs = {(r.arm, r.seed): r for r in load_runs(run_dir)}
    assert sorted(runs) == [("dense", 0), ("topk-dgc", 0)]
    assert all(r.status == "ok" for r in runs.values())
    assert [e.step for e in runs[("dense", 0)].evals] == [10, 20, 30]  # the script's own eval cadence
    for (arm, seed), run in runs.items():
        rows = load_steps(next(run_dir.glob(f"runs/{arm}-seed{seed}-*")))
        train = [r for r in rows if r["kind"] == "train"]
        assert [r["step"] for r in train] == list(range(1, 31))
        steady = train[2:]  # after the two dense warm-up steps
        sent, dense = sum(r["bytes_sent"] for r in steady), sum(r["bytes_dense"] for r in steady)
        assert (sent < 0.1 * dense) if arm == "topk-dgc" else sent == dense
    summary = json.loads(next(run_dir.glob("runs/topk-dgc-seed0-*/summary.json")).read_text())
    assert summary["arm_spec"]["options"]["momentum"] == 0.9 and summary["hook_stats"]["bytes_sent"] > 0
    _check_gives_a_verdict(run_dir, "topk-dgc")
    ledger = _sparsecomm_here("ledger", run_dir)
    assert ledger.returncode == 0 and "topk-dgc" in ledger.stdout
    assert (plots / run_dir.name / "time_to_loss.png").is_file()


@pytest.mark.slow  # ~1 min; the Trainer integration itself is test_integrations_transformers.py, scripts in the lab above
def test_a_hugging_face_trainer_script_runs_paired_through_compare_and_check(tmp_path):
    pytest.importorskip("transformers")
    run_dir = _compare(tmp_path, "--script", EXAMPLES / "hf_trainer.py", "--arms", "dense", "topk-dgc", "--steps", 10,
                       script_args=("--eval-steps", 5))
    runs = {(r.arm, r.seed): r for r in load_runs(run_dir)}
    assert sorted(runs) == [("dense", 0), ("topk-dgc", 0)] and all(r.status == "ok" for r in runs.values())
    assert [e.step for e in runs[("topk-dgc", 0)].evals] == [5, 10]  # the Trainer's eval_loss, logged as val_loss
    summary = json.loads(next(run_dir.glob("runs/topk-dgc-seed0-*/summary.json")).read_text())
    assert 0 < summary["bytes_sent_per_step"] < 0.1 * summary["bytes_dense_per_step"]
    _check_gives_a_verdict(run_dir, "topk-dgc")


def test_the_metric_can_be_one_where_higher_is_better(user_script_run):
    run_dir, _ = user_script_run  # compared with --metric val_accuracy --mode max --tolerance 0.05
    runs = load_runs(run_dir)
    assert all(0 <= e.val_loss <= 1 for r in runs for e in r.evals)  # accuracies, as logged
    out = _check_gives_a_verdict(run_dir, "topk-dgc")
    assert "val_accuracy >=" in out


def test_higher_is_better_turns_the_difference_around():
    dense, arm = {0: 0.90, 1: 0.80, 2: 0.85}, {0: 0.88, 1: 0.79, 2: 0.84}  # the arm is worse by 0.02, 0.01, 0.01
    result = equivalence(dense, arm, 0.05, higher_is_better=True)
    assert result.mean_diff == pytest.approx(0.04 / 3)  # dense - arm: > 0 reads "worse", as for a loss
    assert equivalence(dense, arm, 0.05).mean_diff == pytest.approx(-0.04 / 3)
    target = Target(0.85, "declared", "val_accuracy", "max")
    assert target.reached(0.86) and not target.reached(0.84) and "val_accuracy >= 0.8500" in target.describe()


@pytest.mark.slow
def test_a_user_script_runs_under_mpiexec_too(tmp_path):
    from mpi_launch import mpiexec_or_skip

    mpiexec_or_skip()
    result = _sparsecomm_here("compare", "--script", EXAMPLES / "user_script.py", "--launcher", "mpiexec", "--arms",
                              "dense", "topk-ef", "--seeds", 0, "--steps", 6, "--world-size", 3, "--out",
                              tmp_path / "runs", "--plots", tmp_path / "plots", "--", "--eval-every", 3)
    assert result.returncode == 0, result.stdout[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    runs = load_runs(run_dir)
    assert [(r.arm, r.status, r.extra["world_size"]) for r in runs] == [("dense", "ok", 3), ("topk-ef", "ok", 3)]


def test_a_script_run_standalone_is_a_plain_dense_run(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(EXAMPLES / "user_script.py"), "--steps", "6", "--eval-every", "3"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARSECOMM_")}
    result = run_with_deadline(command, timeout=120, env={**env, "OMP_NUM_THREADS": "1"}, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "dense seed 0: 6 steps" in result.stdout
    assert not any(tmp_path.iterdir())  # nothing written outside the lab


SCRIPT_HEAD = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import sparsecomm.lab
dist.init_process_group("gloo")
run = sparsecomm.lab.init()
torch.manual_seed(run.seed)
model = DDP(torch.nn.Linear(4, 2))
optimizer = run.apply(model, torch.optim.SGD(model.parameters(), lr=0.1))
for step in range(1, 4):
    model(torch.randn(8, 4) + dist.get_rank()).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
"""


def _run_script(tmp_path, monkeypatch, source: str, arms=("dense",)) -> dict:
    """Run ``train.py`` (given relative, from tmp_path) through the runner: {arm: summary}."""
    from sparsecomm.lab.experiment import runner
    from sparsecomm.lab.experiment.config import ExperimentConfig

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(textwrap.dedent(source))
    config = ExperimentConfig(name="s", script="train.py", arms=arms, seeds=(0,), steps=3)
    runner.run_experiment(config, tmp_path / "runs", progress=lambda line: None)
    return {arm: json.loads((runner.run_directory(config, tmp_path / "runs", arm, 0) / "summary.json").read_text())
            for arm in arms}


INIT_ONLY = """
import sys
import torch.distributed as dist
import sparsecomm.lab
dist.init_process_group("gloo")
run = sparsecomm.lab.init()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("source, status, said", [
    # Two endings that finish, in one launch: the relative --script path is the command's, not
    # the directory the script moved to before init(); and (the docs) finish() runs at the end
    # when a script forgets it, also after the group is gone. run.log's step: the steps taken.
    ("import os\nos.chdir('/')\n" + SCRIPT_HEAD + "run.log({'val_loss': 0.5})\ndist.destroy_process_group()\n", "ok",
     None),
    # Slow (CI time): the same record path as "raises", with other words.
    pytest.param(INIT_ONLY + "sys.exit('no data for this arm')\n", "failed",
                 "SystemExit: the script called sys.exit('no data for this arm') at train.py:8, after "
                 "sparsecomm.lab.init(), before run.apply(...)", marks=pytest.mark.slow),
    pytest.param(SCRIPT_HEAD + "raise KeyboardInterrupt\n", "failed",
                 "KeyboardInterrupt: the script raised KeyboardInterrupt at train.py:15, after 3 optimizer step(s)",
                 marks=pytest.mark.slow),
    (SCRIPT_HEAD + "raise RuntimeError('the user script broke at step 3')\n", "failed",
     "RuntimeError: the user script broke at step 3"),
    (SCRIPT_HEAD, "failed", "RuntimeError: the script returned after sparsecomm.lab.init() and 3 optimizer step(s), "
                            "but run.log never recorded the experiment's metric 'val_loss'"),
    ("import torch.distributed as dist\ndist.init_process_group('gloo')\ndist.destroy_process_group()\n", "failed",
     "RuntimeError: the script returned without calling sparsecomm.lab.init(): nothing connected it to the run"),
], ids=["chdir-before-init-and-destroys-group-without-finish", "sys-exit-message-after-init", "keyboard-interrupt",
        "raises", "returns-without-metric", "never-calls-init"])
def test_how_a_script_ends_is_what_its_run_records(tmp_path, monkeypatch, source, status, said):
    summary = _run_script(tmp_path, monkeypatch, "import sys\n" + source)["dense"]
    assert summary["status"] == status, summary
    if said is not None:
        assert said in summary["error"], summary["error"]
    else:
        assert summary["evals"] == [[3, summary["evals"][0][1], 0.5]]


def test_finish_without_the_metric_raises_naming_it(tmp_path):
    """run.finish() before run.log recorded the metric raises on every rank, naming it. A
    script that does so ends by raising, the "raises" ending above (same record, this message);
    here its ranks are forked in-process rather than launched."""
    from rank_processes import run_on_ranks
    from script_run_ranks import finish_without_the_metric

    (tmp_path / "train.py").write_text("# the run's script (not run: the ranks call the lab themselves)\n")
    outcomes = run_on_ranks(finish_without_the_metric, str(tmp_path / "train.py"), str(tmp_path), timeout=120)
    said = ("run.finish: run.log never recorded the experiment's metric 'val_loss' (log it at least once, at the "
            "end)")
    assert outcomes == [("RuntimeError", said, 3)] * 2, outcomes


def test_a_script_logging_a_non_finite_or_tensor_metric_is_measured_not_failed(tmp_path, monkeypatch):
    from sparsecomm.lab import tolerance
    from sparsecomm.lab.results import load_runs

    # One run: a tensor at step 2, then NaN (a diverged run) at the end.
    tail = ("run.log({'val_loss': torch.tensor(0.5)}, step=2)\n"
            "run.log({'val_loss': float('nan'), 'train_loss': torch.tensor([2.0])}, step=3)\nrun.finish()\n")
    summary = _run_script(tmp_path, monkeypatch, SCRIPT_HEAD + tail)["dense"]
    assert summary["status"] == "ok", summary
    assert [step for step, _, _ in summary["evals"]] == [2, 3]
    assert summary["evals"][0][2] == 0.5 and math.isnan(summary["evals"][1][2])
    (run,) = load_runs(tmp_path / "runs" / "s")
    assert math.isnan(run.final_val_loss)
    # Paired against a finite loss (the run's own 0.5 at step 2): no verdict on a NaN.
    verdict = tolerance.equivalence({0: run.evals[0].val_loss}, {0: run.final_val_loss}, 0.1)
    assert verdict.verdict == "inconclusive" and "non-finite final loss at seed(s) [0]" in verdict.reason


@pytest.mark.parametrize("value, message", [
    (torch.tensor([1.0, 2.0]), r"run.log: val_loss must be a number or a one-element tensor, got a tensor of shape \(2,\)"),
    ("0.5", "run.log: val_loss must be a real number or a one-element tensor, got '0.5'"),
    (True, "run.log: val_loss must be a real number or a one-element tensor, got True"),
])
def test_a_metric_that_is_not_one_number_is_refused_when_logged(value, message):
    from sparsecomm.lab.experiment.script_run import Run

    run = Run(arm="dense", seed=0)  # standalone: log() checks the same way
    with pytest.raises(ValueError, match=message):
        run.log({"val_loss": value})
    for accepted in (float("inf"), np.float32(0.25), torch.tensor(0.5, dtype=torch.bfloat16), 3):
        run.log({"val_loss": accepted, "train_loss": accepted})


# --- the library without the lab ------------------------------------------------------------

LIBRARY_ALONE = """
import sys
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import sparsecomm, sparsecomm.hooks, sparsecomm.ops, sparsecomm.comm, sparsecomm.checkpoint, sparsecomm.monitor
import sparsecomm.integrations, sparsecomm.dist
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
model = DDP(torch.nn.Linear(64, 8))
state = sparsecomm.register_topk_hook(model, density=0.05, exchange="auto")
sgd = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.randn(4, 64)).sum().backward()
    sgd.step()
    sgd.zero_grad()
assert state.stats()["bytes_sent"] > 0
assert not [m for m in sys.modules if m.startswith("sparsecomm.lab")], "the library imported the lab"
del model, state, sgd
sparsecomm.dist.shutdown()  # the DDP model freed first: a gloo group left to interpreter exit can abort it
print("library ok")
"""


def test_the_library_needs_neither_scipy_matplotlib_nor_scikit_learn(tmp_path):
    # Shadow packages first on the path stand for "not installed": importing one fails.
    for name in ("scipy", "matplotlib", "sklearn"):
        (tmp_path / "shadow" / name).mkdir(parents=True)
        (tmp_path / "shadow" / name / "__init__.py").write_text(
            f"raise ImportError('{name} is not installed (the library must not need it)')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "shadow"), str(ROOT)]))
    shadowed = subprocess.run([sys.executable, "-c", "import scipy"], env=env, capture_output=True, text=True,
                              timeout=60)
    assert shadowed.returncode != 0 and "scipy is not installed" in shadowed.stderr  # the shadows do shadow
    result = subprocess.run([sys.executable, "-c", LIBRARY_ALONE, str(tmp_path / "store")], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path, env=env)
    assert result.returncode == 0 and "library ok" in result.stdout, result.stderr[-3000:]
