"""Plots of a run directory: every figure is written from synthetic runs, the seed averaging
is exact, missing ledger segments are written out (never drawn as zero), and the CLI works."""

import numpy as np
import pytest

from run_dir_fixture import write_run_dir
from sparsecomm.lab import plot_command, plots
from sparsecomm.lab.results import load_experiment, load_runs
from sparsecomm.lab.results.target import Target, resolve_target

ARMS = ("dense", "topk-ef", "powersgd")
SEEDS = (0, 1, 2)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _curves(arms=ARMS):
    curves = {}
    for a, arm in enumerate(arms):
        for seed in SEEDS:
            # Same eval steps in every seed, different wall clock per seed and arm.
            curves[(arm, seed)] = [(10 * k, k * (1.0 + 0.1 * seed + 0.2 * a), 3.0 / k + 0.05 * seed + 0.1 * a)
                                   for k in range(1, 6)]
    return curves


@pytest.fixture
def run_dir(tmp_path):
    failed = (("topk-ef", 3), ("topk-noef", 0))
    return write_run_dir(tmp_path / "exp-small", _curves(), failed=failed)


def _assert_png(path):
    assert path.is_file()
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 5000


def _texts(fig):
    """Every string drawn in the figure: axes texts, titles, labels and legends."""
    return [t.get_text() for t in fig.findobj(lambda a: hasattr(a, "get_text"))]


def test_mean_band_is_exact_on_a_hand_made_example():
    curves = [([0.0, 2.0, 4.0], [4.0, 2.0, 0.0]),  # 4, 3, 2 on the grid
              ([2.0, 0.0, 1.0], [2.0, 2.0, 2.0])]  # unsorted input; 2, 2, 2 on the grid
    mean, lo, hi = plots._mean_band(curves, [0.0, 1.0, 2.0])
    np.testing.assert_allclose(mean, [3.0, 2.5, 2.0])
    np.testing.assert_allclose(lo, [2.0, 2.0, 2.0])
    np.testing.assert_allclose(hi, [4.0, 3.0, 2.0])


def test_common_grid_ends_at_the_shortest_seed_and_never_extrapolates():
    grid = plots._common_grid([([0.0, 5.0, 10.0], [1, 1, 1]), ([0.0, 4.0, 8.0], [1, 1, 1])], points=5)
    np.testing.assert_allclose(grid, [0.0, 2.0, 4.0, 6.0, 8.0])
    grid = plots._common_grid([([1.0, 5.0], [1, 1]), ([2.0, 6.0], [1, 1])], points=3)
    np.testing.assert_allclose(grid, [2.0, 3.5, 5.0])


def test_moving_average():
    np.testing.assert_allclose(plots._moving_average([1, 2, 3, 4, 5], 2), [1.5, 2.5, 3.5, 4.5])
    np.testing.assert_allclose(plots._moving_average([1, 2, 3], 1), [1, 2, 3])


def test_palette_dense_black_distinct_and_fixed_per_name():
    five = ["topk-noef", "topk-ef", "dense", "powersgd", "dense-bf16"]
    styles = plots.arm_styles(five)
    assert plots.arm_order(five) == ["dense", "dense-bf16", "powersgd", "topk-ef", "topk-noef"]
    assert styles["dense"]["color"] == "#000000"
    assert len({s["color"] for s in styles.values()}) == 5
    assert len({str(s["linestyle"]) for s in styles.values()}) == 5
    assert all(s["color"] in plots.OKABE_ITO for s in styles.values())
    # An arm keeps its colour whatever else is plotted; black stays reserved for dense.
    assert plots.arm_styles(["topk-ef"])["topk-ef"] == styles["topk-ef"]
    assert plots.arm_styles(["zeta", "alpha"])["zeta"]["color"] != "#000000"
    assert plots.arm_order(["zeta", "topk-ef", "alpha", "dense", "zeta"]) == ["dense", "topk-ef", "zeta", "alpha"]


def test_time_to_loss_plot(run_dir, tmp_path):
    runs = load_runs(run_dir)
    seen = {}
    path = plots.plot_time_to_loss(runs, Target(1.2345, "declared"), tmp_path / "out" / "t.png",
                                   on_figure=lambda fig: seen.update(fig=fig))
    _assert_png(path)
    ax = seen["fig"].axes[0]
    texts = _texts(seen["fig"])
    assert ax.get_title() == "time to loss"
    assert ax.get_xlabel() == plots.TIME_XLABEL
    assert "target 1.2345" in texts
    assert "dense (3 seeds)" in texts
    assert "topk-ef (3 seeds, 1 failed)" in texts
    assert "topk-noef (1 failed)" in texts  # counted, not just named
    # One mean line per arm that finished (no per-seed lines, nothing for the failed arm).
    assert len([line for line in ax.get_lines() if line.get_label() and not line.get_label().startswith("_")]) == 3


def test_loss_vs_step_plot_without_target(run_dir, tmp_path):
    seen = {}
    path = plots.plot_loss_vs_step(load_runs(run_dir), None, tmp_path / "s.png", on_figure=lambda fig: seen.update(fig=fig))
    _assert_png(path)
    texts = _texts(seen["fig"])
    assert "powersgd (3 seeds)" in texts
    assert not any(t.startswith("target") for t in texts)


def test_ledger_annotation_strings():
    assert plots.ledger_annotation({"setup": 1.0, "step x steps": 2.0, "checkpoint": 0.5, "recovery": 0.1}) == ""
    assert plots.ledger_annotation({"setup": 1.0, "step x steps": 2.0, "checkpoint": None, "recovery": None}) \
        == "checkpoint, recovery: not measured"
    assert plots.ledger_annotation({"setup": 1.0, "step x steps": None, "checkpoint": 0.5}) \
        == "target not reached; recovery: not measured"
    unreached = {"setup": 1.0, "step x steps": None, "checkpoint": None, "recovery": None,
                 "target_reached": False, "budget_steps": 300, "budget_seconds": 21.0}
    assert plots.ledger_annotation(unreached) == "not reached in 300 steps; checkpoint, recovery: not measured"
    assert plots.ledger_annotation({**unreached, "setup": None, "target_reached": None}) == "no finished run"


def test_ledger_plot_writes_missing_segments_out(tmp_path):
    items = {
        "topk-ef": {"setup": 2.0, "step x steps": 30.0, "checkpoint": None, "recovery": None},
        "dense": {"setup": 2.0, "step x steps": 45.0, "checkpoint": 1.0, "recovery": 3.0},
        "topk-noef": {"setup": 2.0, "step x steps": None, "checkpoint": None, "recovery": None},
    }
    seen = {}
    path = plots.plot_ledger_items(items, tmp_path / "l" / "ledger.png", on_figure=lambda fig: seen.update(fig=fig))
    _assert_png(path)
    ax = seen["fig"].axes[0]
    texts = _texts(seen["fig"])
    assert "checkpoint, recovery: not measured" in texts
    assert "target not reached; checkpoint, recovery: not measured" in texts
    assert "51.0 s" in texts  # dense: everything measured, so the total is shown
    assert [t.get_text() for t in ax.get_yticklabels()] == ["dense", "topk-ef", "topk-noef"]
    assert ax.get_xlabel() == "seconds"
    # Only measured segments are drawn: 4 (dense) + 2 (topk-ef) + 1 (topk-noef).
    assert len(ax.patches) == 7
    assert all(s in texts for s in plots.SEGMENTS)


def _bars(ax, arm_index: int) -> list:
    """The bar segments drawn for the arm on row ``arm_index``, left to right."""
    bars = [p for p in ax.patches if abs(p.get_y() + p.get_height() / 2 - arm_index) < 1e-9]
    return sorted(bars, key=lambda p: p.get_x())


def test_an_arm_that_missed_the_target_is_drawn_at_its_whole_budget_hatched(tmp_path):
    budget = {"budget_steps": 300}
    items = {
        "dense": {"setup": 2.0, "step x steps": 45.0, "checkpoint": 1.0, "recovery": 3.0, "target_reached": True,
                  "budget_seconds": 60.0, **budget},
        # The cheapest per step, but it never got there: without the budget it would be the shortest bar.
        "topk-noef": {"setup": 2.0, "step x steps": None, "checkpoint": 1.0, "recovery": 3.0, "target_reached": False,
                      "budget_seconds": 54.0, **budget},
        "powersgd": {"setup": None, "step x steps": None, "checkpoint": None, "recovery": None, "target_reached": None,
                     "budget_seconds": None, **budget},
    }
    seen = {}
    plots.plot_ledger_items(items, tmp_path / "ledger.png", on_figure=lambda fig: seen.update(fig=fig))
    fig = seen["fig"]
    ax = fig.axes[0]
    order = [t.get_text() for t in ax.get_yticklabels()]
    assert order == ["dense", "powersgd", "topk-noef"]
    dense, powersgd, noef = (_bars(ax, order.index(arm)) for arm in order)
    hatched = [p for p in ax.patches if p.get_gid() == plots.NOT_REACHED_GID]
    assert len(hatched) == 1 and hatched[0] in noef
    (budget_bar,) = hatched
    assert budget_bar.get_hatch() == plots.NOT_REACHED_BAR["hatch"]
    assert not any(p.get_hatch() == plots.NOT_REACHED_BAR["hatch"] for p in dense + powersgd)
    # Where step x steps would be: after setup, as long as step x all 300 steps; then the rest.
    assert (budget_bar.get_x(), budget_bar.get_width()) == (2.0, 54.0)
    assert [p.get_width() for p in noef] == [2.0, 54.0, 1.0, 3.0]
    assert noef[-1].get_x() + noef[-1].get_width() == 60.0 > 51.0 == dense[-1].get_x() + dense[-1].get_width()
    assert powersgd == []
    texts = _texts(fig)
    assert "not reached in 300 steps" in texts and "no finished run" in texts and "51.0 s" in texts
    assert plots.NOT_REACHED_LABEL in texts  # in the legend
    assert ax.get_xlim()[1] >= 60.0


def test_the_ledger_of_a_run_dir_draws_the_unreached_arm_at_its_budget(tmp_path):
    from sparsecomm.lab.ledger import ledger_items_for_plot

    # Final losses 0.6 + 0.05 x seed (dense) and 0.7 + 0.05 x seed (topk-ef): target 0.7 is
    # reached by every dense seed, by topk-ef's seed 0 only.
    curves = _curves(arms=("dense", "topk-ef"))
    run_dir = write_run_dir(tmp_path / "exp", curves, step_seconds={"dense": 0.1, "topk-ef": 0.05}, target_loss=0.7)
    items = ledger_items_for_plot(run_dir)
    assert items["topk-ef"]["target_reached"] is False and items["dense"]["target_reached"] is True
    seen = []
    save = plots.save_figure
    plots.save_figure = lambda fig, path, on_figure: (seen.append(fig), save(fig, path, on_figure))[1]
    try:
        plots.plot_run_dir(run_dir, tmp_path / "plots", items)
    finally:
        plots.save_figure = save
    ax = seen[-1].axes[0]
    (budget_bar,) = [p for p in ax.patches if p.get_gid() == plots.NOT_REACHED_GID]
    assert budget_bar.get_width() == pytest.approx(0.05 * 50)  # step x the configured 50 steps
    assert "not reached in 50 steps" in " ".join(_texts(seen[-1]))


def test_plot_run_dir_with_and_without_ledger(run_dir, tmp_path):
    paths = plots.plot_run_dir(run_dir, tmp_path / "a")
    assert [p.name for p in paths] == ["time_to_loss.png", "loss_vs_step.png"]
    ledger = {"dense": {"setup": 1.0, "step x steps": 5.0, "checkpoint": None, "recovery": None}}
    paths = plots.plot_run_dir(run_dir, tmp_path / "b", ledger_items=ledger)
    assert [p.name for p in paths] == ["time_to_loss.png", "loss_vs_step.png", "ledger.png"]
    for p in paths:
        _assert_png(p)
        assert p.parent == tmp_path / "b"


def test_wall_clock_plots_name_the_link(tmp_path, monkeypatch):
    titles = []
    save = plots.save_figure
    monkeypatch.setattr(plots, "save_figure", lambda fig, path, on_figure: (titles.append(fig.axes[0].get_title()),
                                                                           save(fig, path, on_figure))[1])
    run_dir = write_run_dir(tmp_path / "linked", _curves(), link="1gbit")
    plots.plot_run_dir(run_dir, tmp_path / "out", ledger_items={"dense": {"setup": 1.0, "step x steps": 2.0}})
    time_to_loss, loss_vs_step, ledger = titles
    assert time_to_loss == "time to loss, ranks linked by 1gbit"
    assert ledger.endswith("ranks linked by 1gbit")
    assert loss_vs_step == "loss vs step"  # steps do not depend on the link


def test_plot_run_dir_without_a_finished_dense_run(tmp_path, capsys):
    run_dir = write_run_dir(tmp_path / "nodense", _curves(arms=("topk-ef",)), failed=(("dense", 0),))
    with pytest.raises(ValueError):
        resolve_target(load_experiment(run_dir), load_runs(run_dir))
    paths = plots.plot_run_dir(run_dir, tmp_path / "out")
    assert len(paths) == 2
    assert "no target line" in capsys.readouterr().err


def test_main_writes_plots_and_skips_ledger_when_unavailable(run_dir, tmp_path, monkeypatch, capsys):
    def unavailable(run_dir):
        raise ValueError("ledger not available: no dense run finished")

    monkeypatch.setattr(plot_command, "ledger_items_for_plot", unavailable)
    assert plot_command.main([str(run_dir), "--out", str(tmp_path / "out")]) == 0
    out, err = capsys.readouterr()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["loss_vs_step.png", "time_to_loss.png"]
    assert str(tmp_path / "out" / "time_to_loss.png") in out
    assert "ledger plot skipped" in err


def test_main_draws_ledger_and_defaults_out_dir(run_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(plot_command, "ledger_items_for_plot",
                        lambda d: {"dense": {"setup": 1.0, "step x steps": 4.0, "checkpoint": 0.2, "recovery": None}})
    monkeypatch.chdir(tmp_path)
    assert plot_command.main([str(run_dir)]) == 0
    out_dir = tmp_path / "plots" / "exp-small"
    assert sorted(p.name for p in out_dir.iterdir()) == ["ledger.png", "loss_vs_step.png", "time_to_loss.png"]
    assert len(capsys.readouterr().out.splitlines()) == 3


def test_main_missing_run_dir(tmp_path, capsys):
    assert plot_command.main([str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert plot_command.main([str(tmp_path / "empty")]) == 2
    assert "experiment.json" in capsys.readouterr().err


def test_a_metric_other_than_the_loss_names_the_axes_and_drops_the_train_loss(run_dir, tmp_path):
    target = Target(0.9, "declared", "val_accuracy", "max")
    seen = {}
    plots.plot_loss_vs_step(load_runs(run_dir), target, tmp_path / "s.png", on_figure=lambda fig: seen.update(s=fig))
    plots.plot_time_to_loss(load_runs(run_dir), target, tmp_path / "t.png", on_figure=lambda fig: seen.update(t=fig))
    steps_axes, time_axes = seen["s"].axes[0], seen["t"].axes[0]
    assert steps_axes.get_ylabel() == "val_accuracy" and steps_axes.get_title() == "val_accuracy vs step"
    assert time_axes.get_ylabel() == "val_accuracy"
    labels = [h.get_label() for h in steps_axes.get_legend().legend_handles]
    assert not any("train loss" in label for label in labels)  # a loss on an accuracy's axis would mislead
    plots.plot_loss_vs_step(load_runs(run_dir), None, tmp_path / "d.png", on_figure=lambda fig: seen.update(d=fig))
    assert seen["d"].axes[0].get_ylabel() == "loss"
    assert any("train loss" in h.get_label() for h in seen["d"].axes[0].get_legend().legend_handles)


def test_arms_defined_as_data_take_colours_no_preset_of_the_figure_uses():
    styles = plots.arm_styles(["dense", "dense-bf16", "topk-dgc", "sparseloco", "mine", "floor"])
    assert len({s["color"] for s in styles.values()}) == 6
    assert styles["topk-dgc"] == plots.arm_styles(["dense", "topk-dgc"])["topk-dgc"]  # presets keep theirs


def test_a_link_planted_where_a_plot_goes_is_replaced_not_written_through(run_dir, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("someone else's file")
    planted = tmp_path / "plots" / "s.png"
    planted.parent.mkdir()
    planted.symlink_to(victim)
    path = plots.plot_loss_vs_step(load_runs(run_dir), None, planted)
    assert victim.read_text() == "someone else's file"
    assert not path.is_symlink()
    _assert_png(path)
    assert sorted(p.name for p in planted.parent.iterdir()) == ["s.png"]  # no temporary file left
