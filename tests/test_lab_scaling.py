"""``sparsecomm scale``: the paired experiment at several world sizes, verdicts and bytes per rank vs p.

Three ways: every bad argument stops the command before anything runs (the runner is
replaced by one that fails the test if called); hand-made run directories whose verdicts
and byte counters are known (fast: the table, the growth and its ratio to a ring's, the
cost model's figures, --batch global's and --batch both's names and batches, a world size
whose dense runs all failed, the scaling capture and the step budget against hand-computed
numbers, the modelled time to target on a link against the alpha-beta formulas written out);
and one real study on the digits task (2 world sizes x dense and topk-dgc x 1 seed, 4 steps
for dense and 6 for topk-dgc under --step-budget 1.5: 4 launches, whose cost is the launch,
~10 s each on an idle 2-core machine, not the steps), run twice: the second invocation trains
nothing.
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
    """Stands in for runner.run_experiment: finished runs whose top-k hook received (p-1) payloads
    (an experiment already written is reused, as the runner reuses finished runs)."""

    def run_experiment(config, out_root, progress=print):
        p = config.world_size
        calls.append((p, config.batch_size, config.name, config.arms, config.seeds))
        if (out_root / config.name / "experiment.json").exists():
            return out_root / config.name
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
    # With a step budget of 1.5: topk-dgc trains 6 steps, evaluated at dense's 4 and at its own 6.
    argv = [*SMALL, "--world-sizes", "2", "3", "--arms", "dense", "topk-dgc", "--seeds", "0", "--steps", "4",
            "--step-budget", "1.5", "--model-link", "1gbit", "--out", str(out), "--plots", str(plots)]
    assert scaling.main(argv) == 0
    first = capsys.readouterr().out
    folder = plots / "digits-quick-budget1.5x-scaling"
    study = json.loads((folder / "scaling.json").read_text())
    points = {(p["world_size"], p["arm"]): p for p in study["points"]}
    assert sorted(points) == [(2, "dense"), (2, "topk-dgc"), (3, "dense"), (3, "topk-dgc")], first
    for (p, arm), point in points.items():
        assert point["seeds_finished"] == 1 and point["failed"] == 0, point
        assert point["bytes_sent_per_step"] > 0 and point["bytes_received_per_step"] > 0, point
        assert point["batch_size"] == 32
        [run] = [r for r in load_runs(point["run_dir"]) if r.arm == arm]
        assert [e.step for e in run.evals] == ([4] if arm == "dense" else [4, 6])
        assert point["final_metric_mean"] == run.evals[0].val_loss  # judged at dense's step 4
    for p in (2, 3):
        topk = points[(p, "topk-dgc")]
        # The all-gather: each rank takes in the other p - 1 ranks' payloads of k entries. What
        # it sends besides is budget="model"'s all-reduce of counts (in the hook's bytes sent).
        assert topk["received_source"] == scaling.RECEIVED_HOOK
        [run] = [r for r in load_runs(topk["run_dir"]) if r.arm == "topk-dgc"]
        last = run.extra["hook_stats"]["last_step"]
        assert topk["bytes_received_per_step"] == (p - 1) * (last["bytes_sent"] - last["bytes_budget"])
        assert topk["bytes_sent_per_step"] < 0.05 * points[(p, "dense")]["bytes_sent_per_step"]
        [judged] = check(topk["run_dir"]).arms
        assert topk["verdict"] == judged.equivalence.verdict == "inconclusive"  # 1 seed: never judged
    assert points[(3, "topk-dgc")]["bytes_received_per_step"] > points[(2, "topk-dgc")]["bytes_received_per_step"]
    assert study["growth_of_bytes_received"]["topk-dgc"]["measured"] == pytest.approx(2.0)
    assert set(study["modelled"]["bytes_received_per_rank_per_step"]) == {"dense", "topk-dgc"}
    assert "scaling study digits-quick: world sizes 2, 3" in first
    assert (folder / "scaling.md").read_text().startswith("# Scaling study: digits-quick")
    assert study["study"]["experiments"] == {"2": "digits-quick-p2-budget1.5x", "3": "digits-quick-p3-budget1.5x"}
    # The real runs' records carry what the model needs: every (p, arm) gets a modelled step on 1gbit.
    modelled = {(q["world_size"], q["arm"]): q for q in study["modelled_time_to_target"]["1gbit"]["points"]}
    assert {q["mode"] for q in modelled.values()} == {"allreduce", "sparse allgather"}
    assert all(q["step"]["value"] > 0 and q["step"]["kind"] == "modelled" for q in modelled.values())
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


# ---------------------------------------------------------------------------------------------
# Scaling capture, --batch both, the step budget, the modelled ledger on a link


def fake_from_curves(calls, curves_at, summary_extra=None):
    """Stands in for runner.run_experiment: ``curves_at(config)`` gives the curves of the
    experiment at ``config``'s world size; an experiment already written is reused, as the
    runner reuses finished runs."""

    def run_experiment(config, out_root, progress=print):
        calls.append(config)
        root = out_root / config.name
        if (root / "experiment.json").exists():
            return root
        return write_run_dir(root, curves_at(config), summary_extra=summary_extra,
                             bytes_per_step={"dense": DENSE_BYTES, "topk-dgc": PAYLOAD})

    return run_experiment


def test_capture_against_hand_computed_shares_of_dense_gain(tmp_path, monkeypatch):
    """Dense gains G_s from p=2 to p=4 and to p=8, topk-dgc A_s: capture_s = A_s / G_s; the
    mean and its 90% t interval written out here (t quantile from scipy)."""
    from scipy import stats

    arm_at_2 = {0: 1.60, 1: 1.62, 2: 1.58}
    gains = {4: ({0: 0.20, 1: 0.22, 2: 0.18}, {0: 0.10, 1: 0.09, 2: 0.12}),
             8: ({0: 0.30, 1: 0.33, 2: 0.27}, {0: -0.03, 1: 0.00, 2: 0.03})}

    def curves_at(config):
        p = config.world_size
        dense_gain, arm_gain = gains.get(p, ({s: 0.0 for s in DENSE}, {s: 0.0 for s in DENSE}))
        curves = {}
        for seed in DENSE:
            curves[("dense", seed)] = [(100, 10.0, DENSE[seed] - dense_gain[seed])]
            curves[("topk-dgc", seed)] = [(100, 12.0, arm_at_2[seed] - arm_gain[seed])]
        return curves

    monkeypatch.setattr(runner, "run_experiment", fake_from_curves([], curves_at))
    assert scaling.main([*SMALL, "--world-sizes", "2", "4", "8", "--arms", "topk-dgc", "--seeds", "0", "1", "2",
                         "--steps", "100", "--out", str(tmp_path / "runs"), "--plots", str(tmp_path / "plots")]) == 0
    study = json.loads((tmp_path / "plots" / "digits-quick-scaling" / "scaling.json").read_text())
    t = stats.t.ppf(0.95, 2)
    for p, (dense_gain, arm_gain) in gains.items():
        shares = [arm_gain[s] / dense_gain[s] for s in (0, 1, 2)]
        mean = sum(shares) / 3
        sd = (sum((c - mean) ** 2 for c in shares) / 2) ** 0.5
        got = study["capture"]["topk-dgc"][str(p)]
        assert got["undefined"] is None and got["from"] == 2 and got["ci"] == "90% CI"
        assert got["per_seed"] == pytest.approx({str(s): c for s, c in zip((0, 1, 2), shares)}, rel=1e-9)
        assert got["mean"] == pytest.approx(mean, rel=1e-9)
        assert got["ci_low"] == pytest.approx(mean - t * sd / 3 ** 0.5, rel=1e-9)
        assert got["ci_high"] == pytest.approx(mean + t * sd / 3 ** 0.5, rel=1e-9)
    # About half of dense's gain to p=4 kept (0.53); to p=8 none (0.004).
    assert 0.4 < study["capture"]["topk-dgc"]["4"]["mean"] < 0.6
    assert abs(study["capture"]["topk-dgc"]["8"]["mean"]) < 0.05
    markdown = (tmp_path / "plots" / "digits-quick-scaling" / "scaling.md").read_text()
    assert "| arm | capture p=2->4 | capture p=2->8 |" in markdown


def test_capture_is_undefined_where_dense_gains_nothing_or_within_noise():
    metric = {(2, "dense"): {0: 1.50, 1: 1.52, 2: 1.49}, (2, "a"): {0: 1.6, 1: 1.6, 2: 1.6}}
    # Dense worse at p=4 on seed 1: no gain to share there.
    metric[(4, "dense")] = {0: 1.40, 1: 1.53, 2: 1.39}
    metric[(4, "a")] = {0: 1.5, 1: 1.5, 2: 1.5}
    lost = scaling.capture("a", 2, 4, metric)
    assert not lost.defined and lost.mean is None
    assert "gains nothing" in lost.undefined and "seed(s) 1" in lost.undefined
    assert lost.shown().startswith("undefined: ")
    # Gains of 0.001, 0.2 and 0.002: all > 0, but their 90% CI reaches below 0.
    metric[(8, "dense")] = {0: 1.499, 1: 1.32, 2: 1.488}
    metric[(8, "a")] = {0: 1.5, 1: 1.5, 2: 1.5}
    noise = scaling.capture("a", 2, 8, metric)
    assert not noise.defined and noise.mean is None and "within noise" in noise.undefined
    # Where higher is better (an accuracy), gains flip sign: dense up 0.1, the arm up 0.05 -> 0.5.
    acc = {(2, "dense"): {0: 0.80, 1: 0.81, 2: 0.79}, (2, "a"): {0: 0.70, 1: 0.71, 2: 0.69},
           (4, "dense"): {0: 0.90, 1: 0.92, 2: 0.88}, (4, "a"): {0: 0.75, 1: 0.76, 2: 0.74}}
    kept = scaling.capture("a", 2, 4, acc, mode="max")
    assert kept.per_seed == pytest.approx({0: 0.5, 1: 0.05 / 0.11, 2: 0.05 / 0.09})
    # A seed missing at one p is left out of the pairs.
    del acc[(4, "a")][2]
    assert scaling.capture("a", 2, 4, acc, mode="max").seeds == (0, 1)


def test_batch_both_runs_each_study_and_the_smallest_p_once(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(runner, "run_experiment", fake_run_experiment(calls))
    out, plots = tmp_path / "runs", tmp_path / "plots"
    code = scaling.main([*SMALL, "--world-sizes", "2", "4", "--arms", "topk-dgc", "--seeds", "0", "1", "2",
                         "--batch", "both", "--model-link", "100mbit", "--out", str(out), "--plots", str(plots)])
    assert code == 0
    # per-rank: p2, p4 at 32 per rank; global: p2 (the same experiment), p4 at 16 per rank.
    assert [c[:3] for c in calls] == [(2, 32, "digits-quick-p2"), (4, 32, "digits-quick-p4"),
                                      (2, 32, "digits-quick-p2"), (4, 16, "digits-quick-p4-b16")]
    per_rank = json.loads((plots / "digits-quick-scaling" / "scaling.json").read_text())
    global_ = json.loads((plots / "digits-quick-global64-scaling" / "scaling.json").read_text())
    assert per_rank["study"]["batch"] == "per-rank" and per_rank["study"]["global_batch"] == {"2": 64, "4": 128}
    assert global_["study"]["batch"] == "global" and global_["study"]["global_batch"] == {"2": 64, "4": 64}
    assert per_rank["study"]["experiments"]["2"] == global_["study"]["experiments"]["2"]
    # Compute is measured at p=2, at 32 samples per rank: under a fixed global batch, p=4's 16 make it an upper bound.
    [compute] = [line for line in global_["modelled_time_to_target"]["100mbit"]["assumptions"] if "compute" in line]
    assert "smaller at p=4 (16 samples, 32 at p=2), so the step there is overstated" in compute
    assert "overstated" not in " ".join(per_rank["modelled_time_to_target"]["100mbit"]["assumptions"])
    printed = capsys.readouterr().out
    assert "--batch per-rank, weak scaling" in printed and "fixed: the global batch, 64 samples" in printed


def test_step_budget_trains_the_other_arms_longer_and_judges_them_at_dense_steps(tmp_path, monkeypatch, capsys):
    """topk-dgc is worse than dense at step 100 (+0.10 +- 0.01: worse), equivalent by step 200
    (+0.00 +- 0.01), and first reaches dense's target (median 1.50 + 0.05) at step 150."""

    def curves_at(config):
        assert config.steps == 100 and config.steps_of("dense") == 100 and config.steps_of("topk-dgc") == 200
        curves = {}
        for seed in DENSE:
            curves[("dense", seed)] = [(50, 5.0, 2.5), (100, 10.0, DENSE[seed])]
            curves[("topk-dgc", seed)] = [(50, 6.0, 2.5), (100, 12.0, DENSE[seed] + 0.10 + 0.01 * OFFSETS[seed]),
                                          (150, 18.0, DENSE[seed] + 0.02),
                                          (200, 24.0, DENSE[seed] + 0.01 * OFFSETS[seed])]
        return curves

    calls = []
    monkeypatch.setattr(runner, "run_experiment", fake_from_curves(calls, curves_at))
    out, plots = tmp_path / "runs", tmp_path / "plots"
    assert scaling.main([*SMALL, "--world-sizes", "2", "4", "--arms", "topk-dgc", "--seeds", "0", "1", "2",
                         "--steps", "100", "--step-budget", "2", "--out", str(out), "--plots", str(plots)]) == 0
    assert [c.name for c in calls] == ["digits-quick-p2-budget2x", "digits-quick-p4-budget2x"]
    study = json.loads((plots / "digits-quick-budget2x-scaling" / "scaling.json").read_text())
    assert study["study"]["step_budget"] == 2.0 and study["study"]["steps_other_arms"] == 200
    points = {(p["world_size"], p["arm"]): p for p in study["points"]}
    for p in (2, 4):
        topk, dense = points[(p, "topk-dgc")], points[(p, "dense")]
        assert (topk["steps"], dense["steps"]) == (200, 100)
        assert topk["verdict"] == "worse" and topk["metric_gap"] == pytest.approx(0.10, abs=1e-12)
        assert topk["final_metric_mean"] == pytest.approx(sum(DENSE.values()) / 3 + 0.10)
        assert topk["budget_metric_mean"] == pytest.approx(sum(DENSE.values()) / 3)
        # The whole run reaches the target: at step 150, in 18 s.
        assert (topk["steps_to_target"], topk["time_to_target_s"]) == (150, 18.0)
        assert (dense["steps_to_target"], dense["time_to_target_s"]) == (100, 10.0)
        # The check judges the arm's last evaluation: not the study's verdict here.
        [judged] = check(topk["run_dir"]).arms
        assert judged.equivalence.verdict == "equivalent"
    printed = capsys.readouterr().out
    assert "100 steps for dense, 200 for the other arms (--step-budget 2" in printed
    assert "val loss @100" in printed and "val loss @end" in printed


def test_step_budget_in_the_config_sets_steps_and_hashes():
    from sparsecomm.lab.experiment.named import digits_quick

    base = digits_quick().with_overrides(steps=5)
    longer = base.with_overrides(step_budget=1.5)
    assert (longer.steps_of("dense"), longer.steps_of("topk-dgc"), base.steps_of("topk-dgc")) == (5, 8, 5)  # 7.5 up
    assert "step_budget" not in base.to_dict() and longer.to_dict()["step_budget"] == 1.5
    # Dense's run is the same at any budget (its hash too); the longer arm's is another run.
    assert longer.run_hash("dense", 0) == base.run_hash("dense", 0)
    assert longer.run_hash("topk-dgc", 0) != base.run_hash("topk-dgc", 0)
    with pytest.raises(ValueError, match=r"step_budget must be a finite number >= 1 .*got 0.5"):
        base.with_overrides(step_budget=0.5)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--step-budget", "0.5"], "argument --step-budget: must be a finite number >= 1"),
        (["--step-budget", "nan"], "argument --step-budget: must be a finite number >= 1"),
        (["--step-budget", "two"], "argument --step-budget: invalid float value"),
        (["--model-link", "loopback"], "argument --model-link: must be a rate to model the communication on"),
        (["--model-link", "1gb"], "argument --model-link: link must be 'loopback' or a rate"),
        (["--model-link", "1gbit", "1gbit"], "argument --model-link: must be distinct"),
        (["--world-sizes", "2", "3", "--batch", "both"], "argument --batch both: the global batch of the smallest "
                                                         "world size, 64 samples"),
    ],
)
def test_new_arguments_fail_before_any_run(argv, message, no_runs, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        scaling.main([*SMALL, "--world-sizes", "2", "4", *argv, "--out", str(tmp_path / "runs"),
                      "--plots", str(tmp_path / "plots")])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_modelled_ledger_against_a_hand_computation_on_the_link(tmp_path):
    """At p = 2 and 4 on 100mbit (12.5 MB/s each way, alpha 25 us, one bucket per step): dense's
    step = its compute + compress at p = 2 + a ring allreduce of D; topk's = its compute +
    compress at p = 2 + a ring all-gather of P + the scatter-add of p x k entries at the rate
    measured at p = 2. The runs at p = 4 took 5x longer per step (8 ranks' worth of crowding):
    their times must not enter. Time to target = steps-to-target measured x step."""
    D, k = 4_000_000.0, 10_000
    P = 8.0 * k  # int32 index + fp32 value per entry
    rate, alpha = 100e6 / 8, 25e-6
    adds_at = {2: 1e8, 4: 1e7}  # scatter-adds per second measured at each p (p = 4's crowded)
    step_at = {2: {"dense": 0.2, "topk-dgc": 0.1}, 4: {"dense": 1.0, "topk-dgc": 0.5}}
    run_dirs = {}
    for p in (2, 4):
        curves = {}
        for seed in (0, 1, 2):
            curves[("dense", seed)] = [(100, 10.0, 1.0)]
            curves[("topk-dgc", seed)] = [(100, 10.0, 1.2), (150, 15.0, 1.0)]
            curves[("loco", seed)] = [(100, 10.0, 1.0)]
            curves[("si", seed)] = [(100, 10.0, 1.0)]
            curves[("mask", seed)] = [(100, 10.0, 1.1), (200, 20.0, 1.0)]
        stats = {"steps": 100, "sparse_calls": 100, "bytes_sent": 100 * P, "bytes_dense": 100 * D,
                 "elements_total": 100 * D / 4, "elements_sparse": 100 * D / 4, "elements_sent": 100 * k,
                 "seconds_unpack": 100 * k * p / adds_at[p]}
        run_dirs[p] = write_run_dir(
            tmp_path / f"p{p}", curves, step_seconds=step_at[p],
            bytes_per_step={"dense": D, "topk-dgc": P, "loco": 1000.0, "si": P, "mask": P},
            summary_extra={"dense": {"world_size": p, "bytes_dense_per_step": D},
                           "topk-dgc": {"world_size": p, "hook_stats": stats, "bytes_dense_per_step": D},
                           "loco": {"world_size": p, "arm_spec": {"reducer": "sparse-delta", "options": {}}},
                           "si": {"world_size": p, "hook_stats": stats, "bytes_dense_per_step": D,
                                  "arm_spec": {"reducer": "topk", "options": {"exchange": "shared-index"}}},
                           "mask": {"world_size": p, "hook_stats": stats, "bytes_dense_per_step": D,
                                    "arm_spec": {"reducer": "topk", "options": {"exchange": "shared-mask"}}}})
    ledger = scaling.link_ledger(run_dirs, ["dense", "topk-dgc", "loco", "si", "mask"], "100mbit")
    got = {(q.world_size, q.arm): q for q in ledger.points}
    for p in (2, 4):
        dense_step = 0.2 * 0.7 + 0.2 * 0.1 + 2 * (p - 1) * alpha + 2 * (p - 1) / p * D / rate
        topk_step = 0.1 * 0.7 + 0.1 * 0.1 + (p - 1) * alpha + (p - 1) * P / rate + p * k / adds_at[2]
        dense, topk = got[(p, "dense")], got[(p, "topk-dgc")]
        assert (dense.mode, topk.mode) == ("allreduce", "sparse allgather")
        assert dense.step.value == pytest.approx(dense_step, rel=1e-9)
        assert topk.step.value == pytest.approx(topk_step, rel=1e-9)
        assert (dense.steps_to_target, topk.steps_to_target) == (100, 150)
        assert dense.time_to_target.value == pytest.approx(100 * dense_step, rel=1e-9)
        assert topk.time_to_target.value == pytest.approx(150 * topk_step, rel=1e-9)
        assert topk.speedup == pytest.approx(100 * dense_step / (150 * topk_step), rel=1e-9)
        assert topk.time_to_target.kind == "modelled" and topk.time_to_target.link == "100mbit"
        assert got[(p, "loco")].mode == scaling.NOT_MODELLED and "sparse-delta" in got[(p, "loco")].note
        assert got[(p, "si")].mode == scaling.NOT_MODELLED and "exchange shared-index" in got[(p, "si")].note
        assert got[(p, "si")].time_to_target.value is None
        # The shared mask: what a rank sends (values and bitmap) in two ring allreduces per bucket,
        # no fallback; it scatters its k entries once.
        mask_step = 0.1 * 0.7 + 0.1 * 0.1 + 2 * 2 * (p - 1) * alpha + 2 * (p - 1) / p * P / rate + k / adds_at[2]
        mask = got[(p, "mask")]
        assert mask.mode == "sparse shared-mask" and mask.step.value == pytest.approx(mask_step, rel=1e-9)
        assert mask.time_to_target.value == pytest.approx(200 * mask_step, rel=1e-9)
    # On 100mbit dense's 4 MB allreduce costs 0.32 s per step at p = 2: top-k pays despite 1.5x the steps.
    assert got[(2, "topk-dgc")].speedup > 2
    assert any("alpha 25 us" in line for line in ledger.assumptions)


def test_modelled_ledger_and_ring_growth_in_the_report(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(runner, "run_experiment", fake_run_experiment([]))
    out, plots = tmp_path / "runs", tmp_path / "plots"
    assert scaling.main([*SMALL, "--world-sizes", "2", "4", "--arms", "topk-dgc", "--seeds", "0", "1", "2",
                         "--model-link", "100mbit", "1gbit@100us", "--out", str(out), "--plots", str(plots)]) == 0
    study = json.loads((plots / "digits-quick-scaling" / "scaling.json").read_text())
    ledgers = study["modelled_time_to_target"]
    assert set(ledgers) == {"100mbit", "1gbit@100us"}
    assert all("modelled" in ledger["label"] for ledger in ledgers.values())
    assumptions = ledgers["1gbit@100us"]["assumptions"]
    assert any("alpha 100 us per message (the link's latency)" in line for line in assumptions)
    rows = {(q["world_size"], q["arm"]): q for q in ledgers["100mbit"]["points"]}
    assert rows[(4, "topk-dgc")]["time_to_target"]["kind"] == "modelled"
    assert rows[(4, "topk-dgc")]["time_to_target"]["value"] is None  # worse at p=4: never reached the target
    # The all-gather's bytes received grow as p - 1: 3x from 2 to 4, twice a ring's 1.5x.
    grown = study["growth_of_bytes_received"]["topk-dgc"]["by_world_size"]["4"]
    assert grown["measured"] == 3.0 and grown["ring"] == pytest.approx(1.5) and grown["over_ring"] == pytest.approx(2.0)
    assert study["growth_of_bytes_received"]["dense"]["by_world_size"]["4"]["over_ring"] == pytest.approx(1.0, rel=1e-5)
    assert study["capture"]["topk-dgc"]["4"]["undefined"].startswith("dense gains nothing")
    printed = capsys.readouterr().out
    assert "does it pay at p workers on 100mbit? time to target, MODELLED" in printed
    assert "/ ring 1.50x" in printed
    markdown = (plots / "digits-quick-scaling" / "scaling.md").read_text()
    assert "| 2 | topk-dgc | 100 |" in markdown and "(modelled)" in markdown
