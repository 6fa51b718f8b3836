"""The ledger: figures refuse to mix boundaries, totals add up, unmeasured items stay
unmeasured (never zero), and medians / steps-to-target come out of a run directory right."""
import pytest

from run_dir_fixture import write_run_dir
from sparsecomm.lab import ledger
from sparsecomm.lab.ledger import BoundaryError, Figure, build_ledger, format_ledger, step_cost_to_target


def test_adding_figures_of_different_boundaries_raises():
    with pytest.raises(BoundaryError, match=r"\[boundary: step, link: loopback\] and s \[boundary: end_to_end, link: loopback\]"):
        Figure(1.0, "s", "step") + Figure(2.0, "s", "end_to_end")


def test_figures_measured_over_different_links_do_not_mix():
    with pytest.raises(BoundaryError, match=r"link: 1gbit\] and s \[boundary: step, link: loopback\]"):
        Figure(1.0, "s", "step", link="1gbit") + Figure(2.0, "s", "step")
    with pytest.raises(BoundaryError):
        Figure(1.0, "s", "step", link="1gbit").speedup_over(Figure(2.0, "s", "step", link="10gbit"))
    assert str(Figure(1.0, "s", "step", link="1gbit").speedup_over(Figure(3.0, "s", "step", link="1gbit"))) == \
        "3.00x (boundary: step, link: 1gbit)"


def test_adding_figures_of_different_units_raises():
    with pytest.raises(BoundaryError):
        Figure(1.0, "s", "step") + Figure(2.0, "B", "step")


def test_speedup_across_boundaries_raises_and_names_its_boundary():
    with pytest.raises(BoundaryError):
        Figure(1.0, "s", "step").speedup_over(Figure(2.0, "s", "time_to_target"))
    speedup = Figure(1.0, "s", "step").speedup_over(Figure(1.9, "s", "step"))
    assert str(speedup) == "1.90x (boundary: step, link: loopback)"


def test_unknown_boundary_is_refused():
    with pytest.raises(ValueError, match="boundary must be one of"):
        Figure(1.0, "s", "wall")


def test_not_measured_propagates_and_is_never_zero():
    total = Figure(3.0, "s", "end_to_end") + Figure(None, "s", "end_to_end")
    assert total.value is None and str(total) == "not measured"
    assert str(Figure(None, "s", "step").speedup_over(Figure(1.0, "s", "step"))) == "n/a (boundary: step, link: loopback)"


def test_step_times_steps_is_the_only_cross_boundary_product():
    item = step_cost_to_target(Figure(0.5, "s", "step"), Figure(40, "steps", "steps_to_target"))
    assert (item.value, item.unit, item.boundary) == (20.0, "s", "end_to_end")
    with pytest.raises(BoundaryError):
        step_cost_to_target(Figure(40, "steps", "steps_to_target"), Figure(0.5, "s", "step"))


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
    assert "not reached in 1/3 seeds" in text
    assert "not measured (partial 4.0 s)" in text
    assert "2.00x (boundary: step, link: loopback)" in text  # topk step 0.05 s vs dense 0.1 s
    # topk's partial total lacks step x steps, dense's has it: no ratio of unlike sums.
    assert "(step x steps, checkpoint, recovery missing): n/a (dense and this arm do not have the same items measured)" in text


def test_every_boundary_label_states_the_link(tmp_path):
    run_dir = write_run_dir(tmp_path / "exp", _curves(), step_seconds={"dense": 0.1, "topk-ef": 0.05},
                            target_loss=1.5, link="1gbit")
    built = build_ledger(run_dir)
    assert {built.arm("dense").step.link, built.arm("topk-ef").time_to_target.link} == {"1gbit"}
    text = format_ledger(built)
    header = next(line for line in text.splitlines() if line.startswith("arm "))
    labels = header.count("[")
    assert labels == 9 and header.count("@1gbit]") == labels
    assert "linked by 1gbit" in text and "emulated 1gbit link" in text
    assert "2.00x (boundary: step, link: 1gbit)" in text
    assert "link: loopback" not in text


def test_ledger_items_for_plot_keep_unmeasured_as_none(tmp_path):
    run_dir = write_run_dir(tmp_path / "exp", _curves(), target_loss=1.5)
    items = ledger.ledger_items_for_plot(run_dir)
    assert items["dense"]["checkpoint"] is None and items["dense"]["recovery"] is None
    assert items["topk-ef"]["step x steps"] is None  # not reached in every seed
    assert items["dense"]["setup"] == 2.0


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
    text = format_ledger(build_ledger(write_run_dir(tmp_path / "exp", curves, target_loss=1.5, summary_extra=extra)))
    assert "topk-ef: hook path: fused kernel in 120 of 120 sparse calls" in text  # 3 seeds x 40
    assert "topk-dgc: hook path: fused kernel in 0 of 120 sparse calls: the others formed acc in the bucket first" in text
    assert "dense: hook path" not in text


def test_the_ledger_names_resumes_that_fell_back_to_an_older_checkpoint(tmp_path):
    fallback = [{"restored": 20, "skipped": {"30": "rank 1: sha256 of rank1.pt differs from the manifest"}}]
    extra = {"topk-ef": {"checkpoint_fallbacks": fallback}}
    text = format_ledger(build_ledger(write_run_dir(tmp_path / "exp", _curves(), target_loss=1.5, summary_extra=extra)))
    assert "topk-ef: 3 resume(s) skipped a latest checkpoint that did not verify" in text  # one per seed
    assert "dense: " not in text.split("resume(s)")[0].splitlines()[-1]
