"""The experiment runner: config validation before any launch, failure and hang recording,
skipping finished runs, and a short real end-to-end ``sparsecomm compare`` (whose runs
test_frontier and test_experiment_wire reuse: tests/digits_point.py)."""
import json
import sys
import time

import numpy as np
import pytest
from scipy import stats

from digits_point import NAME, compare_point
from sparsecomm.lab import cli, tolerance
from sparsecomm.lab.experiment import launch, runner
from sparsecomm.lab.experiment.config import ExperimentConfig
from sparsecomm.lab.experiment.named import EXPERIMENTS, digits_quick
from sparsecomm.lab.results.policy import Policy
from sparsecomm.lab.results import load_runs
from tost_oracle import paired_diffs, scipy_tost_verdict

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"arms": ("topk-ef",)}, "arms must be a list that includes 'dense'"),
        ({"arms": ("dense", "topk")}, "arms must be distinct names of presets"),
        ({"seeds": (0, 0)}, "seeds must be distinct integers >= 0"),
        ({"seeds": (-1,)}, "seeds must be distinct integers >= 0"),
        ({"world_size": 1}, "world_size must be an integer >= 2"),
        ({"density": 0.0}, "density must be in (0, 1]"),
        ({"density": float("nan")}, "density must be in (0, 1]"),
        ({"lr": -1.0}, "lr must be a finite number > 0"),
        ({"warmup_steps": 1}, "warmup_steps must be an integer >= 2"),
        ({"task": "imagenet"}, "task must be one of"),
        ({"steps": 2.5}, "steps must be an integer >= 1"),
        ({"name": "a/b"}, "name must be a non-empty string without '/'"),
    ],
)
def test_bad_config_values_name_the_field_and_range(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        digits_quick().with_overrides(**overrides)


def test_policy_values_are_validated():
    with pytest.raises(ValueError, match="policy.quality_tolerance must be a finite number > 0"):
        Policy(quality_tolerance=0)
    with pytest.raises(ValueError, match="policy.redundancy_budget must be a fraction in"):
        Policy(redundancy_budget=2)


def test_config_round_trips_through_json_and_rejects_unknown_keys():
    for make in EXPERIMENTS.values():
        config = make()
        assert ExperimentConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    with pytest.raises(ValueError, match=r"unknown experiment config keys \['densty'\]"):
        ExperimentConfig.from_dict({**digits_quick().to_dict(), "densty": 0.1})


def test_run_hash_ignores_report_only_fields_but_not_training_fields():
    base = digits_quick()
    assert base.run_hash("dense", 0) == base.with_overrides(name="other", seeds=(0, 5), policy=Policy(quality_tolerance=1.0)).run_hash("dense", 0)
    assert base.run_hash("dense", 0) != base.with_overrides(lr=0.01).run_hash("dense", 0)
    assert base.run_hash("dense", 0) != base.run_hash("dense", 1)


def _fake_launch(monkeypatch, code: str):
    monkeypatch.setattr(launch, "torchrun_command", lambda *args: [sys.executable, "-c", code])


def test_a_crashing_run_is_recorded_as_failed_with_its_error(tmp_path, monkeypatch):
    _fake_launch(monkeypatch, "import sys; print('RuntimeError: gloo says no'); sys.exit(1)")
    config = digits_quick().with_overrides(arms=("dense",), seeds=(0,))
    experiment_dir = runner.run_experiment(config, tmp_path, progress=lambda line: None)
    (run,) = load_runs(experiment_dir)
    assert run.status == "failed"
    assert "exit code 1" in run.error and "RuntimeError: gloo says no" in run.error


def test_a_hung_run_is_killed_after_the_stall_timeout(tmp_path, monkeypatch):
    _fake_launch(monkeypatch, "import time; time.sleep(60)")
    config = digits_quick().with_overrides(arms=("dense",), seeds=(0,), stall_timeout_s=1.0)
    started = time.monotonic()
    experiment_dir = runner.run_experiment(config, tmp_path, progress=lambda line: None)
    assert time.monotonic() - started < 20
    (run,) = load_runs(experiment_dir)
    assert run.status == "failed" and run.error.startswith("stalled: no step completed for 1 s")


def test_a_failed_run_is_retried_and_its_record_kept(tmp_path, monkeypatch):
    _fake_launch(monkeypatch, "import sys; sys.exit(3)")
    config = digits_quick().with_overrides(arms=("dense",), seeds=(0,))
    runner.run_experiment(config, tmp_path, progress=lambda line: None)
    runner.run_experiment(config, tmp_path, progress=lambda line: None)
    run_dir = runner.run_directory(config, tmp_path, "dense", 0)
    assert len(list(run_dir.glob("failed-*.json"))) == 1 and (run_dir / "summary.json").exists()


def test_a_changed_config_keeps_the_previous_snapshot(tmp_path, monkeypatch):
    _fake_launch(monkeypatch, "import sys; sys.exit(1)")
    config = digits_quick().with_overrides(arms=("dense",), seeds=(0,))
    runner.run_experiment(config, tmp_path, progress=lambda line: None)
    runner.run_experiment(config.with_overrides(lr=0.01), tmp_path, progress=lambda line: None)
    (snapshot,) = (tmp_path / config.name / "history").glob("experiment-*.json")
    assert json.loads(snapshot.read_text())["config"]["lr"] == config.lr


@pytest.mark.timeout(600)
def test_compare_end_to_end_on_digits_and_rerun_skips_finished_runs(tmp_path_factory, capsys):
    # 2 arms x 3 seeds x 2 gloo ranks, launched by torchrun, 50 steps each at density 0.001:
    # `python -m sparsecomm compare --config` (tests/digits_point.py; test_frontier reuses these runs).
    point = compare_point(tmp_path_factory)
    first = point.first
    assert first.returncode == 0, first.stderr[-3000:]
    out = first.stdout
    assert out.count(": final val loss") == 6
    assert "policy: quality tolerance 0.05" in out and "target: val loss <=" in out
    assert "all measured @loopback: ranks linked by" in " ".join(out.split()) and "speedup vs dense" in out
    # The verdict, against scipy's one-sided t-tests on the per-seed final losses read from the
    # run directory (digits-quick's tolerance 0.05 at the default alpha 0.05: a 90% CI). On the
    # development machine: worse, CI ~[+1.18, +1.31] (3 seeds, 50 steps at density 0.001).
    runs = load_runs(point.experiment_dir)
    finals = {arm: {r.seed: r.final_val_loss for r in runs if r.arm == arm} for arm in ("dense", "topk-ef")}
    diffs = paired_diffs(finals["dense"], finals["topk-ef"])
    expected = scipy_tost_verdict(diffs, digits_quick().policy.quality_tolerance)
    lo, hi = stats.t.interval(0.90, len(diffs) - 1, loc=np.mean(diffs), scale=stats.sem(diffs))
    assert f"topk-ef: {expected.upper()} (90% CI [{lo:+.4g}, {hi:+.4g}]" in out, (expected, diffs, out[-2500:])
    assert tolerance.main([str(point.experiment_dir)]) == {"equivalent": 0, "better": 0, "worse": 1,
                                                           "inconclusive": 3}[expected]
    for name in ("time_to_loss.png", "loss_vs_step.png", "ledger.png"):
        path = point.plots / NAME / name
        assert path.stat().st_size > 5000 and str(path) in out
    assert [(r.arm, r.seed, r.status) for r in runs] == [(a, s, "ok") for a in ("dense", "topk-ef") for s in (0, 1, 2)]
    topk = next(r for r in runs if r.arm == "topk-ef")
    assert topk.bytes_sent_per_step < 0.005 * topk.bytes_dense_per_step  # 0.1% density: ~0.2% of dense bytes
    # The same command again, in this process: every run is found finished and skipped.
    capsys.readouterr()
    assert cli.main(point.command[3:]) == 0
    assert capsys.readouterr().out.count("finished earlier, skipped") == 6
