"""``sparsecomm scale``: the paired experiment at several world sizes, verdicts and bytes per rank vs p.

Three ways: every bad argument stops the command before anything runs (the runner is
replaced by one that fails the test if called); hand-made run directories whose verdicts
and byte counters are known (fast: the table, the growth, the cost model's figures, --batch
global's names and batches, a world size whose dense runs all failed); and one real study
on the digits task (2 world sizes x dense and topk-dgc x 1 seed, 4 steps each: 4 launches,
whose cost is the launch, ~10 s each on an idle 2-core machine, not the steps), run twice:
the second invocation trains nothing.
"""
import json
import os

import pytest

from run_dir_fixture import write_run_dir
from sparsecomm.lab import scaling
from sparsecomm.lab.experiment import runner
from sparsecomm.lab.results import load_runs
from sparsecomm.lab.tolerance import check
from tost_oracle import paired_diffs, scipy_tost_verdict

SMALL = ["--experiment", "digits-quick"]


@pytest.fixture
def no_runs(monkeypatch):
    def run_experiment(*args, **kwargs):
        raise AssertionError("an experiment was started before every argument was checked")

    monkeypatch.setattr(runner, "run_experiment", run_experiment)


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "the following arguments are required: --world-sizes"),
        (["--world-sizes", "2"], "argument --world-sizes: give at least two world sizes"),
        (["--world-sizes", "2", "2"], "argument --world-sizes: must be distinct"),
        (["--world-sizes", "1", "2"], "argument --world-sizes: each must be an integer in [2, "),
        (["--world-sizes", "2", "4096"], "argument --world-sizes: each must be an integer in [2, "),
        (["--world-sizes", "2", "three"], "argument --world-sizes: invalid int value"),
        (["--world-sizes", "2", "3", "--batch", "global"], "argument --batch global: the global batch of the "
                                                           "smallest world size, 64 samples"),
        (["--world-sizes", "2", "4", "--batch", "fixed"], "argument --batch: invalid choice"),
        (["--world-sizes", "2", "4", "--arms", "dense"], "argument --arms: needs at least one arm besides 'dense'"),
        (["--world-sizes", "2", "4", "--arms", "nope"], "arms must be distinct names of presets"),
        (["--world-sizes", "2", "4", "--steps", "0"], "steps must be an integer >= 1"),
        (["--world-sizes", "2", "4", "--seeds", "-1"], "seeds must be distinct integers >= 0"),
        (["--world-sizes", "2", "4", "--link", "1gb"], "link must be 'loopback' or a rate"),
        (["--world-sizes", "2", "4", "--parallelism", "hsdp:2x2"], "argument --parallelism: hsdp:2x2 runs on exactly "
                                                                   "2 x 2 = 4 ranks, but a scaling study runs every "
                                                                   "arm at each of --world-sizes 2 4: it needs "
                                                                   'parallelism "ddp"'),
        (["--world-sizes", "2", "4", "--parallelism", "hsdp:02x2"], "argument --parallelism: must be \"ddp\" or"),
    ],
)
def test_bad_arguments_fail_before_any_run(argv, message, no_runs, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        scaling.main([*SMALL, *argv, "--out", str(tmp_path / "runs"), "--plots", str(tmp_path / "plots")])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_a_per_rank_batch_too_large_at_some_world_size_names_it(no_runs, capsys, tmp_path):
    # digits-mlp has 1437 training samples: 700 per rank fit 2 ranks, not 3.
    config = tmp_path / "big-batch.json"
    config.write_text(json.dumps({"name": "big-batch", "task": "digits-mlp", "batch_size": 700,
                                  "arms": ["dense", "topk-ef"]}))
    with pytest.raises(SystemExit):
        scaling.main(["--config", str(config), "--world-sizes", "2", "3", "--out", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert "argument --world-sizes: at world size 3 (700 samples per rank)" in err and "batch_size must be" in err
    assert not (tmp_path / "runs").exists()


def test_unwritable_plots_folder_is_refused(no_runs, capsys, tmp_path):
    (tmp_path / "plots").write_text("a file, not a folder")
    with pytest.raises(SystemExit):
        scaling.main([*SMALL, "--world-sizes", "2", "4", "--out", str(tmp_path / "runs"),
                      "--plots", str(tmp_path / "plots")])
    assert "argument --plots" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Hand-made runs: known verdicts and counters

DENSE = {0: 1.50, 1: 1.52, 2: 1.49}
OFFSETS = {0: -1, 1: 0, 2: 1}
DENSE_BYTES, PAYLOAD = 340_000.0, 680.0
# (m, u) per world size: topk-dgc final = dense + m + u * OFFSETS[seed]; the 90% CI of the
# mean difference is m +- 2.92 u / sqrt(3): (0, .01) inside +-0.05, (.10, .01) above it.
SHIFTS = {2: (0.0, 0.01), 4: (0.10, 0.01)}


def fake_run_experiment(calls, dense_fails_at=()):
    """Stands in for runner.run_experiment: finished runs whose top-k hook received (p-1) payloads."""

    def run_experiment(config, out_root, progress=print):
        p = config.world_size
        calls.append((p, config.batch_size, config.name, config.arms, config.seeds))
        m, u = SHIFTS[p]
        curves, failed = {}, []
        for seed in config.seeds:
            if p in dense_fails_at:
                failed.append(("dense", seed))
            else:
                curves[("dense", seed)] = [(50, 5.0, 2.5), (100, 10.0, DENSE[seed])]
            final = DENSE[seed] + m + u * OFFSETS[seed]
            curves[("topk-dgc", seed)] = [(50, 6.0, 2.5), (100, 12.0, final)]
        stats = {"steps": 100, "bytes_received": 100 * (p - 1) * PAYLOAD,
                 "last_step": {"step": 99, "bytes_received": (p - 1) * PAYLOAD}}
        return write_run_dir(out_root / config.name, curves, failed=tuple(failed),
                             bytes_per_step={"dense": DENSE_BYTES, "topk-dgc": PAYLOAD},
                             summary_extra={"dense": {"bytes_dense_per_step": DENSE_BYTES},
                                            "topk-dgc": {"bytes_dense_per_step": DENSE_BYTES,
                                                         "hook_stats": stats}})

    return run_experiment


def test_hand_made_study_with_a_global_batch(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(runner, "run_experiment", fake_run_experiment(calls))
    out, plots = tmp_path / "runs", tmp_path / "plots"
    code = scaling.main([*SMALL, "--world-sizes", "4", "2", "--arms", "topk-dgc", "--seeds", "0", "1", "2",
                         "--batch", "global", "--out", str(out), "--plots", str(plots)])
    assert code == 0
    # Sorted for the user; dense added as the baseline; the global batch 64 split: 32 then 16 per rank.
    assert [c[:3] for c in calls] == [(2, 32, "digits-quick-p2"), (4, 16, "digits-quick-p4-b16")]
    assert {c[3] for c in calls} == {("dense", "topk-dgc")} and {c[4] for c in calls} == {(0, 1, 2)}
    folder = plots / "digits-quick-global64-scaling"
    study = json.loads((folder / "scaling.json").read_text())
    assert study["study"]["batch"] == "global" and study["study"]["global_batch"] == {"2": 64, "4": 64}
    points = {(p["world_size"], p["arm"]): p for p in study["points"]}
    assert sorted(points) == [(2, "dense"), (2, "topk-dgc"), (4, "dense"), (4, "topk-dgc")]
    for p in (2, 4):
        dense, topk = points[(p, "dense")], points[(p, "topk-dgc")]
        assert dense["verdict"] == "baseline"
        [judged] = check(topk["run_dir"]).arms  # the lab's own verdict, as compare prints it
        assert topk["verdict"] == judged.equivalence.verdict
        assert topk["metric_gap"] == pytest.approx(SHIFTS[p][0], abs=1e-12)
        runs = load_runs(topk["run_dir"])
        finals = {a: {r.seed: r.final_val_loss for r in runs if r.arm == a} for a in ("dense", "topk-dgc")}
        assert topk["verdict"] == scipy_tost_verdict(paired_diffs(finals["dense"], finals["topk-dgc"]), 0.05)
        assert topk["bytes_received_per_step"] == (p - 1) * PAYLOAD
        assert topk["received_source"] == scaling.RECEIVED_HOOK
        assert dense["bytes_received_per_step"] == round(2 * (p - 1) / p * DENSE_BYTES)
        assert dense["received_source"] == scaling.RECEIVED_RING
        assert dense["batch_size"] == topk["batch_size"] == 64 // p
        assert topk["exposed_comm_fraction"] == pytest.approx(0.2)  # the fixture waits 0.2 x each step
    assert [points[(p, "topk-dgc")]["verdict"] for p in (2, 4)] == ["equivalent", "worse"]
    assert study["growth_of_bytes_received"]["topk-dgc"]["measured"] == 3.0
    assert study["growth_of_bytes_received"]["dense"]["measured"] == pytest.approx(1.5, rel=1e-5)
    modelled = study["modelled"]
    assert modelled["from_world_size"] == 4
    topk = modelled["bytes_received_per_rank_per_step"]["topk-dgc"]
    assert topk["16"] == 15 * PAYLOAD and topk["256"] == 255 * PAYLOAD
    # p x 680 B >= 340 kB from p = 500: the hook would allreduce densely, as dense does.
    assert modelled["dense_fallback_from"]["topk-dgc"] == 500
    dense_1024 = modelled["bytes_received_per_rank_per_step"]["dense"]["1024"]
    assert topk["1024"] == dense_1024 == 2 * 1023 / 1024 * DENSE_BYTES
    printed = capsys.readouterr().out
    assert "fixed: the global batch, 64 samples" in printed and "modelled bytes received per rank per step" in printed
    markdown = (folder / "scaling.md").read_text()
    assert "| 4 | topk-dgc | 16 | worse |" in markdown and "(modelled)" in markdown
    assert (folder / "scaling.png").stat().st_size > 10_000


def test_a_world_size_without_finished_dense_is_unavailable(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(runner, "run_experiment", fake_run_experiment([], dense_fails_at=(4,)))
    out, plots = tmp_path / "runs", tmp_path / "plots"
    code = scaling.main([*SMALL, "--world-sizes", "2", "4", "--arms", "topk-dgc", "--seeds", "0", "1", "2",
                         "--out", str(out), "--plots", str(plots)])
    assert code == 0
    study = json.loads((plots / "digits-quick-scaling" / "scaling.json").read_text())
    points = {(p["world_size"], p["arm"]): p for p in study["points"]}
    assert points[(4, "topk-dgc")]["verdict"] == "unavailable" and points[(4, "dense")]["dense_failed"] == 3
    assert points[(4, "topk-dgc")]["bytes_received_per_step"] == 3 * PAYLOAD  # its own runs finished
    assert points[(2, "topk-dgc")]["verdict"] == "equivalent"
    assert "unavailable: no dense run finished at that p" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# A real study


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_real_study_on_digits_then_a_rerun_trains_nothing(tmp_path, capsys):
    out, plots = tmp_path / "runs", tmp_path / "plots"
    argv = [*SMALL, "--world-sizes", "2", "3", "--arms", "dense", "topk-dgc", "--seeds", "0", "--steps", "4",
            "--out", str(out), "--plots", str(plots)]
    assert scaling.main(argv) == 0
    first = capsys.readouterr().out
    folder = plots / "digits-quick-scaling"
    study = json.loads((folder / "scaling.json").read_text())
    points = {(p["world_size"], p["arm"]): p for p in study["points"]}
    assert sorted(points) == [(2, "dense"), (2, "topk-dgc"), (3, "dense"), (3, "topk-dgc")], first
    for (p, arm), point in points.items():
        assert point["seeds_finished"] == 1 and point["failed"] == 0, point
        assert point["bytes_sent_per_step"] > 0 and point["bytes_received_per_step"] > 0, point
        assert point["batch_size"] == 32
    for p in (2, 3):
        topk = points[(p, "topk-dgc")]
        # The all-gather: each rank takes in the other p - 1 ranks' payloads of k entries.
        assert topk["received_source"] == scaling.RECEIVED_HOOK
        assert topk["bytes_received_per_step"] == pytest.approx((p - 1) * topk["bytes_sent_per_step"])
        assert topk["bytes_sent_per_step"] < 0.05 * points[(p, "dense")]["bytes_sent_per_step"]
        [judged] = check(topk["run_dir"]).arms
        assert topk["verdict"] == judged.equivalence.verdict == "inconclusive"  # 1 seed: never judged
    assert points[(3, "topk-dgc")]["bytes_received_per_step"] > points[(2, "topk-dgc")]["bytes_received_per_step"]
    assert study["growth_of_bytes_received"]["topk-dgc"]["measured"] == pytest.approx(2.0)
    assert set(study["modelled"]["bytes_received_per_rank_per_step"]) == {"dense", "topk-dgc"}
    assert "scaling study digits-quick: world sizes 2, 3" in first
    assert (folder / "scaling.md").read_text().startswith("# Scaling study: digits-quick")
    assert (folder / "scaling.png").stat().st_size > 10_000

    def run_dirs():
        return {path: os.stat(path / "summary.json").st_mtime_ns for path in out.glob("*/runs/*")}

    before = run_dirs()
    assert len(before) == 4
    assert scaling.main(argv) == 0
    second = capsys.readouterr().out
    assert run_dirs() == before
    assert second.count("finished earlier, skipped") == 4, second


def test_shared_exchanges_are_modelled_as_a_ring_of_values_plus_the_leaders_indices(tmp_path):
    """Hand-worked: k values of V = 400 B and an index region of I = 100 B per step. A rank
    takes in 2 (p-1)/p x V from the ring and, when it does not lead, I from the leader's
    broadcast: on average over the rotating leader (p-1)/p x (2 V + I), 675 B at p = 4."""
    values, index, measured_p = 400.0, 100.0, 4

    def mean_received(p):  # the hand-worked mean over ranks, not the module's formula
        return 2 * (p - 1) / p * values + (p - 1) / p * index

    hook_stats = {"steps": 100, "last_step": {"step": 99, "bytes_received": mean_received(measured_p)}}
    averager_stats = {"steps": 100, "bytes_received": 100 * 2 * (measured_p - 1) / measured_p * values}
    curves = {(arm, 0): [(50, 5.0, 2.0)] for arm in ("dense", "si", "mask", "delta-si")}
    spec = lambda reducer, exchange: {"reducer": reducer, "options": {"exchange": exchange}}  # noqa: E731
    run_dir = write_run_dir(tmp_path / "p4", curves, bytes_per_step={"dense": 4000.0, "si": 425.0, "mask": 400.0},
                            summary_extra={"si": {"arm_spec": spec("topk", "shared-index"), "hook_stats": hook_stats},
                                           "mask": {"arm_spec": spec("topk", "shared-mask"), "hook_stats": {
                                               "steps": 100, "last_step": {"bytes_received": 600.0}}},
                                           "delta-si": {"arm_spec": spec("sparse-delta", "shared-index"),
                                                        "hook_stats": averager_stats}})
    sizes = [2, 4, 16, 1024]
    modelled = {m.arm: m for m in scaling.modelled_traffic(run_dir, ["si", "mask", "delta-si"], sizes, measured_p)}
    for p in sizes:
        assert modelled["si"].bytes_received[p] == pytest.approx(mean_received(p), rel=1e-12)
        assert modelled["mask"].bytes_received[p] == pytest.approx(2 * (p - 1) / p * values, rel=1e-12)
        assert modelled["delta-si"].bytes_received[p] == pytest.approx(2 * (p - 1) / p * values, rel=1e-12)
    # Flat in p: at most 2x the p = 2 figure at any p, and no dense fallback.
    assert modelled["si"].bytes_received[1024] / modelled["si"].bytes_received[2] < 2
    assert all(m.dense_fallback_from is None and "no dense fallback" in m.how for m in modelled.values())
    assert "shared-index" in modelled["si"].how and "p = 4" in modelled["si"].how
