"""The ledger: figures refuse to mix boundaries, totals add up, unmeasured items stay
unmeasured (never zero), and medians / steps-to-target come out of a run directory right."""
import re

import pytest

from run_dir_fixture import write_run_dir
from sparsecomm.lab import ledger
from sparsecomm.lab.ledger import build_ledger, format_ledger, step_cost_to_target
from sparsecomm.lab.results.quantity import BoundaryError, Quantity, format_value


def test_adding_figures_of_different_boundaries_raises():
    with pytest.raises(BoundaryError, match=r"\[boundary: step, link: loopback\] and s \[boundary: end_to_end, link: loopback\]"):
        Quantity(1.0, "s", "step") + Quantity(2.0, "s", "end_to_end")


def test_figures_measured_over_different_links_do_not_mix():
    with pytest.raises(BoundaryError, match=r"link: 1gbit\] and s \[boundary: step, link: loopback\]"):
        Quantity(1.0, "s", "step", link="1gbit") + Quantity(2.0, "s", "step")
    with pytest.raises(BoundaryError):
        Quantity(1.0, "s", "step", link="1gbit").speedup_over(Quantity(2.0, "s", "step", link="10gbit"))
    assert str(Quantity(1.0, "s", "step", link="1gbit").speedup_over(Quantity(3.0, "s", "step", link="1gbit"))) == \
        "3.00x (boundary: step, link: 1gbit)"


def test_adding_figures_of_different_units_raises():
    with pytest.raises(BoundaryError):
        Quantity(1.0, "s", "step") + Quantity(2.0, "B", "step")


def test_speedup_across_boundaries_raises_and_names_its_boundary():
    with pytest.raises(BoundaryError):
        Quantity(1.0, "s", "step").speedup_over(Quantity(2.0, "s", "time_to_target"))
    speedup = Quantity(1.0, "s", "step").speedup_over(Quantity(1.9, "s", "step"))
    assert str(speedup) == "1.90x (boundary: step, link: loopback)"


def test_unknown_boundary_is_refused():
    with pytest.raises(ValueError, match="boundary must be one of"):
        Quantity(1.0, "s", "wall")


def test_not_measured_propagates_and_is_never_zero():
    total = Quantity(3.0, "s", "end_to_end") + Quantity(None, "s", "end_to_end")
    assert total.value is None and str(total) == "not measured"
    assert str(Quantity(None, "s", "step").speedup_over(Quantity(1.0, "s", "step"))) == "n/a (boundary: step, link: loopback)"


def test_step_times_steps_is_the_only_cross_boundary_product():
    item = step_cost_to_target(Quantity(0.5, "s", "step"), Quantity(40, "steps", "steps_to_target"))
    assert (item.value, item.unit, item.boundary) == (20.0, "s", "end_to_end")
    with pytest.raises(BoundaryError):
        step_cost_to_target(Quantity(40, "steps", "steps_to_target"), Quantity(0.5, "s", "step"))


def _curves():
    # dense reaches 1.5 at step 20 in every seed; topk at step 30 (seeds 0, 1) or never (seed 2)
    curves = {}
    for seed in (0, 1, 2):
        curves[("dense", seed)] = [(10, 1.0 + seed, 2.0), (20, 2.0 + seed, 1.5), (30, 3.0 + seed, 1.4)]
        topk_last = 1.5 if seed < 2 else 1.8
        curves[("topk-ef", seed)] = [(10, 0.5, 2.2), (20, 1.0, 1.9), (30, 1.5, topk_last)]
    return curves


def test_ledger_medians_and_totals_from_a_run_dir(tmp_path):
    run_dir = write_run_dir(tmp_path / "exp", _curves(), step_seconds={"dense": 0.1, "topk-ef": 0.05},
                            setup_seconds=2.0, target_loss=1.5, failed=(("powersgd", 0),))
    built = build_ledger(run_dir)
    dense, topk, powersgd = built.arm("dense"), built.arm("topk-ef"), built.arm("powersgd")
    assert dense.steps_to_target.value == 20
    assert dense.time_to_target.value == 3.0  # median of 2.0, 3.0, 4.0
    assert dense.step_x_steps.value == pytest.approx(2.0)  # 0.1 s x 20 steps
    # The totals add up: the measured part is setup + step x steps; the total is not measured.
    assert dense.measured_part.value == pytest.approx(2.0 + 2.0)
    assert dense.end_to_end.value is None
    assert dense.missing_items == ["checkpoint", "recovery"]
    # One seed of topk never reached the target: no median over the lucky seeds.
    assert topk.steps_to_target.value is None
    assert topk.steps_to_target.note == "not reached in 1/3 seeds"
    assert (powersgd.num_ok, powersgd.num_failed) == (0, 1)
    text = format_ledger(built)
    assert text.splitlines()[0].startswith("policy: quality tolerance 0.05")
    assert "target: val loss <= 1.5000 (declared in the config)" in text
    assert "topk-ef: target not reached in 1/3 seeds within 30 steps" in _unfolded(text)
    rows = _table_rows(text)
    assert rows["dense"][:2] == ["dense", "3/0"] and rows["dense"][-2] == ">= 4.0 s"  # partial: a lower bound
    # One seed did not reach the target: no number, but the budget it was not reached in.
    assert rows["topk-ef"][-1] == "not reached in 30 steps" and "20" not in rows["topk-ef"]
    # Exposed communication: the fixture's wait after backward is 0.2 x each step (20 ms of 100 ms).
    assert dense.exposed_comm.value == pytest.approx(0.02) and ledger.exposed_fraction(dense) == pytest.approx(0.2)
    assert "dense: exposed communication (the wait for it after backward) 20.0 ms per step, 20% of the step" in (
        _unfolded(text))
    assert rows["powersgd"] == ["powersgd", "0/3", "no finished run"]  # seed 0 failed, seeds 1 and 2 missing
    speedups = _speedup_lines(text)
    assert speedups["topk-ef"] == "step 2.00x  steps, time, total: n/a (target not reached)"  # 0.05 s vs 0.1 s
    assert speedups["powersgd"] == "n/a: no finished run"


def _unfolded(text: str) -> str:
    return " ".join(text.split())


def _table_rows(text: str) -> dict[str, list[str]]:
    """The ledger's table rows by arm, split into cells (cells hold single spaces only)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("arm "))
    rows = []
    for line in lines[start + 1:]:
        if not line:
            break
        rows.append(re.split(r"\s{2,}", line))
    return {row[0]: row for row in rows}


def _speedup_lines(text: str) -> dict[str, str]:
    lines = text.splitlines()
    start = lines.index("speedup vs dense (dense cost / arm cost; > 1: the arm is cheaper):")
    return {line.split()[0]: line.split(None, 1)[1].strip() for line in lines[start + 1:] if line.startswith("  ")}


def _all_reached_curves():
    # Every seed of every arm reaches 1.5: dense at step 20, the top-k arms at step 30.
    curves = {}
    for seed in (0, 1, 2):
        curves[("dense", seed)] = [(10, 1.0, 2.0), (20, 2.0 + seed, 1.5), (30, 3.0 + seed, 1.4)]
        for arm in ("topk-ef", "topk-dgc"):
            curves[(arm, seed)] = [(10, 0.5, 2.2), (20, 1.0, 1.9), (30, 1.5 + seed, 1.45)]
    return curves


def test_table_cells_are_the_figures_values(tmp_path):
    run_dir = write_run_dir(tmp_path / "exp", _all_reached_curves(), step_seconds={"dense": 0.1, "topk-ef": 0.05},
                            bytes_per_step={"dense": 4e6, "topk-ef": 40e3}, target_loss=1.5)
    built = build_ledger(run_dir)
    rows = _table_rows(format_ledger(built))
    assert list(rows) == [a.arm for a in built.arms]  # one row per arm
    for a in built.arms:
        assert rows[a.arm] == [
            a.arm, f"{a.num_ok}/0", format_value(a.step.value, "s"), format_value(a.bytes_per_step.value, "B"),
            format_value(a.setup.value, "s"), "n/m", "n/m", f"{a.steps_to_target.value:g}",
            format_value(a.step_x_steps.value, "s"), f">= {format_value(a.measured_part.value, 's')}",
            format_value(a.time_to_target.value, "s")]
    assert rows["topk-ef"][2:4] == ["50.0 ms", "40.00 kB"]


def test_one_speedup_line_per_arm_with_the_speedup_ratios(tmp_path):
    run_dir = write_run_dir(tmp_path / "exp", _all_reached_curves(), step_seconds={"dense": 0.1, "topk-ef": 0.05},
                            target_loss=1.5)
    built = build_ledger(run_dir)
    speedups = _speedup_lines(format_ledger(built))
    assert sorted(speedups) == ["topk-dgc", "topk-ef"]
    dense, topk = built.arm("dense"), built.arm("topk-ef")
    ratios = [topk.step.speedup_over(dense.step).ratio, topk.steps_to_target.speedup_over(dense.steps_to_target).ratio,
              topk.time_to_target.speedup_over(dense.time_to_target).ratio,
              topk.measured_part.speedup_over(dense.measured_part).ratio]
    assert speedups["topk-ef"] == ("step {:.2f}x  steps {:.2f}x  time {:.2f}x  total {:.2f}x "
                                   "(without checkpoint, recovery)").format(*ratios)
    assert ratios[:2] == [2.0, pytest.approx(20 / 30)]


def test_every_line_fits_in_100_columns(tmp_path):
    # The widest case: six arms, checkpoint and recovery measured, an emulated link, a failed
    # run, hook notes, one arm that never reached the target, and big numbers.
    arms = ("dense", "dense-bf16", "powersgd", "topk-ef", "topk-noef", "topk-dgc")
    curves = {(arm, seed): [(1000, 100.0, 2.0), (2000, 1200.0 + seed, 1.45 + 0.01 * i),
                            (4000, 2400.0, 2.5 if arm == "topk-noef" else 1.4 + 0.01 * seed)]
              for i, arm in enumerate(arms) for seed in range(3)}
    extra = {arm: {"checkpoint_seconds": 12.345, "recovery_seconds": 40.0, "lost_steps": 50, "total_seconds": 2500.0,
                   "hook_stats": {"sparse_calls": 400, "fused_calls": 300}} for arm in arms}
    run_dir = write_run_dir(tmp_path / "exp", curves, step_seconds=dict.fromkeys(arms, 0.5123), setup_seconds=12.5,
                            failed=(("topk-ef", 3),), bytes_per_step={"dense": 123.45e6}, summary_extra=extra,
                            link="10gbit")
    text = format_ledger(build_ledger(run_dir))
    assert max(len(line) for line in text.splitlines()) <= 100, text
    rows = _table_rows(text)
    assert len(rows["dense"]) == 11 and rows["dense"][5:7] == ["12.3 s", "45.6 s"]  # ckpt, recovery measured
    assert rows["topk-noef"][-1] == "not reached in 4000 steps"


def test_a_long_arm_name_still_fits(tmp_path):
    topk = {seed: c for (arm, seed), c in _all_reached_curves().items() if arm == "topk-ef"}
    curves = {**_all_reached_curves(), **{("topk-ef-chunk4096-rice", seed): c for seed, c in topk.items()}}
    text = format_ledger(build_ledger(write_run_dir(tmp_path / "exp", curves, target_loss=1.5)))
    assert max(len(line) for line in text.splitlines()) <= 100, text
    assert any(line.startswith("topk-ef-chunk4096-rice ") for line in text.splitlines())


def test_the_boundaries_and_the_link_are_said_once_in_a_legend(tmp_path):
    run_dir = write_run_dir(tmp_path / "exp", _curves(), step_seconds={"dense": 0.1, "topk-ef": 0.05},
                            target_loss=1.5, link="1gbit")
    built = build_ledger(run_dir)
    assert {built.arm("dense").step.link, built.arm("topk-ef").time_to_target.link} == {"1gbit"}
    text = format_ledger(built)
    unfolded = _unfolded(text)
    assert unfolded.count("boundaries:") == 1 and unfolded.count("@1gbit") == 1
    assert "step, sent/step = step" in unfolded and "steps = steps_to_target" in unfolded
    assert "all measured @1gbit: ranks linked by an emulated 1gbit link per rank" in unfolded
    assert "linked by 1gbit" in text and "loopback" not in text
    assert "[" not in "".join(" ".join(row) for row in _table_rows(text).values())


def test_without_context_the_policy_and_target_are_left_to_the_report(tmp_path):
    built = build_ledger(write_run_dir(tmp_path / "exp", _curves(), target_loss=1.5))
    text = format_ledger(built, context=False)
    assert "policy:" not in text and "target: val loss" not in text
    assert text.splitlines()[0].startswith("experiment exp: task synthetic")


def test_ledger_items_for_plot_keep_unmeasured_as_none(tmp_path):
    run_dir = write_run_dir(tmp_path / "exp", _curves(), target_loss=1.5)
    items = ledger.ledger_items_for_plot(run_dir)
    assert items["dense"]["checkpoint"] is None and items["dense"]["recovery"] is None
    assert items["topk-ef"]["step x steps"] is None  # not reached in every seed
    assert items["dense"]["setup"] == 2.0


def test_ledger_items_for_plot_carry_the_budget_of_an_arm_that_missed_the_target(tmp_path):
    run_dir = write_run_dir(tmp_path / "exp", _curves(), step_seconds={"dense": 0.1, "topk-ef": 0.05},
                            target_loss=1.5, failed=(("powersgd", 0),))
    items = ledger.ledger_items_for_plot(run_dir)
    assert items["topk-ef"]["target_reached"] is False and items["dense"]["target_reached"] is True
    assert items["powersgd"]["target_reached"] is None  # no finished run
    assert {values["budget_steps"] for values in items.values()} == {30}  # the config's steps
    assert items["topk-ef"]["budget_seconds"] == pytest.approx(0.05 * 30)  # step x the whole budget
    assert items["powersgd"]["budget_seconds"] is None


def test_cli_missing_directory_exits_2(tmp_path, capsys):
    assert ledger.main([str(tmp_path / "nope")]) == 2
    assert "experiment.json is missing" in capsys.readouterr().err


def test_checkpoint_and_recovery_items_when_measured(tmp_path):
    extra = {"dense": {"checkpoint_seconds": 0.5, "recovery_seconds": 4.0, "lost_steps": 10, "total_seconds": 3600.0},
             "topk-ef": {"unverified_reason": "max residual age 1200 > staleness limit 1000"}}
    run_dir = write_run_dir(tmp_path / "exp", _curves(), step_seconds={"dense": 0.1}, target_loss=1.5,
                            summary_extra=extra)
    dense = build_ledger(run_dir).arm("dense")
    assert dense.checkpoint.value == 0.5
    # one fault costs 4 s + 10 steps x 0.1 s; the declared rate is 1 per hour, the run 1 hour
    assert dense.recovery.value == pytest.approx(5.0)
    assert dense.end_to_end.value == pytest.approx(2.0 + 2.0 + 0.5 + 5.0)
    topk = build_ledger(run_dir).arm("topk-ef")
    assert topk.checkpoint.value is None and topk.recovery.value is None
    assert "UNVERIFIED topk-ef: max residual age 1200 > staleness limit 1000" in format_ledger(build_ledger(run_dir))


def test_the_ledger_says_which_hook_path_ran(tmp_path):
    extra = {"topk-ef": {"hook_stats": {"sparse_calls": 40, "fused_calls": 40}},
             "topk-dgc": {"hook_stats": {"sparse_calls": 40, "fused_calls": 0}},
             "dense": {"hook_stats": None}}
    curves = {**_curves(), **{("topk-dgc", seed): c for (arm, seed), c in _curves().items() if arm == "topk-ef"}}
    text = _unfolded(format_ledger(build_ledger(write_run_dir(tmp_path / "exp", curves, target_loss=1.5,
                                                               summary_extra=extra))))
    assert "topk-ef: hook path: fused kernel in 120 of 120 sparse calls" in text  # 3 seeds x 40
    assert "topk-dgc: hook path: fused kernel in 0 of 120 sparse calls: the others formed acc in the bucket first" in text
    assert "dense: hook path" not in text


def test_the_ledger_names_resumes_that_fell_back_to_an_older_checkpoint(tmp_path):
    fallback = [{"restored": 20, "skipped": {"30": "rank 1: sha256 of rank1.pt differs from the manifest"}}]
    extra = {"topk-ef": {"checkpoint_fallbacks": fallback}}
    text = format_ledger(build_ledger(write_run_dir(tmp_path / "exp", _curves(), target_loss=1.5, summary_extra=extra)))
    assert "topk-ef: 3 resume(s) skipped a latest checkpoint that did not verify" in text  # one per seed
    assert "dense: " not in text.split("resume(s)")[0].splitlines()[-1]
