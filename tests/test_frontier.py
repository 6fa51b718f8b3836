"""``sparsecomm frontier``: the per-(arm, density) verdicts and the sparsest equivalent density.

Two ways: on hand-made run directories whose verdicts are worked out by hand (fast, every
verdict and the choice of the sparsest density), and end to end on the digits task with
settings whose answer is known (density 1: the hook's dense fallback, bit-identical to
dense; density 0.001 at 50 steps: far from converged, clearly worse). The density-0.001
runs are those of test_experiment_runner's end-to-end ``compare`` (tests/digits_point.py):
the frontier finds them finished and skips them, as a re-run does.
"""
import json

import pytest

import digits_point
from run_dir_fixture import write_run_dir
from sparsecomm.lab import frontier
from sparsecomm.lab.experiment import runner
from sparsecomm.lab.frontier import FrontierPoint, sparsest_equivalent
from sparsecomm.lab.results import load_runs
from sparsecomm.lab.tolerance import ZERO_VARIANCE_REASON, check
from tost_oracle import paired_diffs, scipy_tost_verdict

DENSE = {0: 1.50, 1: 1.52, 2: 1.49, 3: 1.51, 4: 1.50}  # median 1.50: derived target 1.55 (tolerance 0.05)
FIVE = (-2, -1, 0, 1, 2)

# Per density and arm, (m, u): final loss = dense + m + u * FIVE[seed]. The differences have
# mean m, sd u*sqrt(2.5), se u/sqrt(2); with t(0.95, df 4) = 2.131847 the 90% CI is m +- 1.507 u:
#   (0, .01):    [-0.015, +0.015]  inside +-0.05     equivalent
#   (.03, .01):  [+0.015, +0.045]  inside            equivalent
#   (.045, .01): [+0.030, +0.060]  crosses +0.05     inconclusive
#   (0, .04):    [-0.060, +0.060]  crosses both      inconclusive
#   (.10, .01):  [+0.085, +0.115]  above +0.05       worse
#   (-.10, .01): [-0.115, -0.085]  below -0.05       better
SHIFTS = {
    0.1: {"topk-ef": (0.0, 0.01), "topk-dgc": (0.0, 0.01), "topk-noef": (0.045, 0.01)},
    0.03: {"topk-ef": (0.03, 0.01), "topk-dgc": (0.045, 0.01), "topk-noef": (0.10, 0.01)},
    0.01: {"topk-ef": (0.045, 0.01), "topk-dgc": (0.0, 0.01), "topk-noef": (0.10, 0.01)},
    0.003: {"topk-ef": (0.0, 0.04), "topk-dgc": (-0.10, 0.01), "topk-noef": (0.10, 0.01)},
    0.001: {"topk-ef": (0.10, 0.01), "topk-dgc": (0.10, 0.01), "topk-noef": (0.10, 0.01)},
}
EXPECTED = {
    0.1: {"topk-ef": "equivalent", "topk-dgc": "equivalent", "topk-noef": "inconclusive"},
    0.03: {"topk-ef": "equivalent", "topk-dgc": "inconclusive", "topk-noef": "worse"},
    0.01: {"topk-ef": "inconclusive", "topk-dgc": "equivalent", "topk-noef": "worse"},
    0.003: {"topk-ef": "inconclusive", "topk-dgc": "better", "topk-noef": "worse"},
    0.001: {"topk-ef": "worse", "topk-dgc": "worse", "topk-noef": "worse"},
}
# Sparsest density whose verdict is equivalent or better (no loss): topk-ef's 0.003 and 0.01
# are inconclusive, so 0.03; topk-dgc's is 0.003 ("better"), although 0.03 is inconclusive;
# topk-noef never passes.
SPARSEST = {"topk-ef": "density 0.03 (equivalent)", "topk-dgc": "density 0.003 (better)",
            "topk-noef": "none of the densities tried"}


def bytes_sent(arm: str, density: float) -> float:
    return 340_000.0 if arm == "dense" else 680_000.0 * density


def fake_run_experiment(calls):
    """Stands in for runner.run_experiment: writes a finished run directory, trains nothing.

    Each run evaluates at steps 50 (loss 2.5), 100 (final + 0.02) and 150 (final).
    """

    def run_experiment(config, out_root, progress=print):
        calls.append((config.density, config.arms, config.seeds, config.name))
        curves = {}
        for arm in config.arms:
            m, u = (0.0, 0.0) if arm == "dense" else SHIFTS[config.density][arm]
            for seed in config.seeds:
                final = DENSE[seed] + m + u * FIVE[seed]
                curves[(arm, seed)] = [(50, 5.0, 2.5), (100, 10.0, final + 0.02), (150, 15.0, final)]
        return write_run_dir(out_root / config.name, curves,
                             bytes_per_step={arm: bytes_sent(arm, config.density) for arm in config.arms})

    return run_experiment


def test_frontier_on_hand_made_runs_gives_the_hand_worked_verdicts(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(runner, "run_experiment", fake_run_experiment(calls))
    out, plots = tmp_path / "runs", tmp_path / "plots"
    code = frontier.main(["--experiment", "digits-quick", "--densities", "0.01", "0.1", "0.001", "0.03", "0.003",
                          "--arms", "topk-ef", "topk-dgc", "topk-noef", "--seeds", "0", "1", "2", "3", "4",
                          "--out", str(out), "--plots", str(plots)])
    assert code == 0
    # One paired experiment per density, sparsest first, dense + the arms, the seeds asked for.
    assert [c[0] for c in calls] == [0.001, 0.003, 0.01, 0.03, 0.1]
    assert {c[1] for c in calls} == {("dense", "topk-ef", "topk-dgc", "topk-noef")}
    assert {c[2] for c in calls} == {(0, 1, 2, 3, 4)}
    assert len({c[3] for c in calls}) == 5  # a run directory per density

    points = json.loads((out / "digits-quick-frontier.json").read_text())
    assert len(points) == 15
    verdicts = {(p["arm"], p["density"]): p["verdict"] for p in points}
    assert verdicts == {(arm, d): v for d, row in EXPECTED.items() for arm, v in row.items()}
    for p in points:
        m, u = SHIFTS[p["density"]][p["arm"]]
        assert p["mean_loss_diff"] == pytest.approx(m, abs=1e-12)
        assert p["bytes_per_step"] == bytes_sent(p["arm"], p["density"])
        # Target 1.55. m = 0, u = 0.01: every seed is <= 1.54 at step 100 -> 100 steps; m = 0.10:
        # every seed >= 1.58 at the end -> never reached.
        if (m, u) == (0.0, 0.01):
            assert p["steps_to_target"] == 100, p
        if m == 0.10:
            assert p["steps_to_target"] is None and p["time_to_target_s"] is None, p
    printed = capsys.readouterr().out
    for arm, line in SPARSEST.items():
        assert f"sparsest equivalent {arm}: {line}" in printed
    assert (plots / "digits-quick-frontier" / "frontier.png").stat().st_size > 10_000


def test_sparsest_equivalent_picks_the_lowest_passing_density():
    def point(arm, density, verdict):
        return FrontierPoint(arm, density, verdict, 0.0, 100.0, 1.0, 10.0, "")

    best = sparsest_equivalent([point("a", 0.01, "worse"), point("a", 0.05, "equivalent"), point("a", 0.1, "equivalent"),
                                point("a", 0.03, "inconclusive"), point("b", 0.05, "inconclusive"),
                                point("c", 0.1, "equivalent"), point("c", 0.02, "better"), point("c", 0.001, "worse")])
    assert best["a"].density == 0.05 and best["b"] is None and best["c"].density == 0.02


@pytest.mark.timeout(600)
def test_frontier_end_to_end_on_digits_known_verdicts(tmp_path, tmp_path_factory, capsys):
    # 2 densities x (dense + topk-ef) x 3 seeds = 12 runs of 50 steps; the 6 of density 0.001
    # were trained by the shared compare (tests/digits_point.py) into the same --out, and dense,
    # which the density does not change, is copied from there to density 1: 3 runs trained here.
    point = digits_point.compare_point(tmp_path_factory)
    out, plots = point.out, tmp_path / "plots"
    code = frontier.main(["--experiment", "digits-quick", "--densities", "1", "0.001", "--arms", "topk-ef",
                          "--seeds", "0", "1", "2", "--steps", str(digits_point.STEPS), "--out", str(out),
                          "--plots", str(plots)])
    assert code == 0
    printed = capsys.readouterr().out
    # The compare's runs are this frontier's density-0.001 runs (same hashes): skipped, not trained again.
    skipped = [line for line in printed.splitlines() if "finished earlier, skipped" in line]
    compared = [p.name for p in (point.experiment_dir / "runs").iterdir()]
    assert sorted(line.rsplit("(", 1)[-1].rstrip(")") for line in skipped) == sorted(
        compared + [name for name in compared if name.startswith("dense-seed")]), printed
    points = {p["density"]: p for p in json.loads((out / "digits-quick-frontier.json").read_text())}
    assert sorted(points) == [0.001, 1.0] and {p["arm"] for p in points.values()} == {"topk-ef"}
    finals = {}
    for density, p in points.items():
        runs = load_runs(p["run_dir"])
        assert sorted((r.arm, r.seed, r.status) for r in runs) == [
            (a, s, "ok") for a in ("dense", "topk-ef") for s in (0, 1, 2)]
        finals[density] = {a: {r.seed: r.final_val_loss for r in runs if r.arm == a} for a in ("dense", "topk-ef")}
        assert all(r.bytes_dense_per_step == runs[0].bytes_dense_per_step for r in runs)

    # Density 1: sending k = numel values plus indices is larger than the dense buffer, so the
    # hook reduces densely (documented fallback), with a residual that stays zero: the same
    # training as dense, bit for bit, on every seed. Identical runs give zero-variance
    # differences, which the documented rule never calls equivalent: inconclusive.
    one = points[1.0]
    assert finals[1.0]["topk-ef"] == finals[1.0]["dense"] == finals[0.001]["dense"]
    assert one["verdict"] == "inconclusive" and one["mean_loss_diff"] == 0.0
    [arm] = check(one["run_dir"]).arms
    assert arm.equivalence.reason == ZERO_VARIANCE_REASON
    dense_bytes = load_runs(one["run_dir"])[0].bytes_dense_per_step
    assert one["bytes_per_step"] == dense_bytes

    # Density 0.001 (~700 B per step instead of ~340 kB) for 50 steps: far from converged. The
    # precondition, every seed more than 4x the tolerance (0.05) behind dense; then "worse",
    # also by scipy's one-sided t-test on the same differences.
    sparse = points[0.001]
    diffs = paired_diffs(finals[0.001]["dense"], finals[0.001]["topk-ef"])
    assert min(diffs) > 4 * 0.05, diffs
    assert scipy_tost_verdict(diffs, 0.05) == "worse"
    assert sparse["verdict"] == "worse"
    assert sparse["mean_loss_diff"] == pytest.approx(sum(diffs) / 3, rel=1e-9)
    assert sparse["bytes_per_step"] < 0.01 * dense_bytes
    assert sparse["steps_to_target"] is None  # the target: dense median final + 0.05

    assert "sparsest equivalent topk-ef: none of the densities tried" in printed
    assert (plots / "digits-quick-frontier" / "frontier.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--densities", "0.01", "0.01"], "--densities must be distinct"),
        (["--densities", "0"], "density"),
        (["--densities", "1.5"], "density"),
        (["--densities", "0.01", "--arms", "dense"], "dense is always run"),
        (["--densities", "0.01", "--arms", "nope"], "arms must be distinct names of presets"),
        ([], "the following arguments are required: --densities"),
        (["--densities", "0.01", "--link", "1gb"], "link must be 'loopback' or a rate"),
    ],
)
def test_bad_frontier_arguments_fail_before_any_run(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        frontier.main([*argv, "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
