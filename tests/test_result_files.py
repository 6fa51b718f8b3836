"""Result files the readers (ledger, check, plot) must not trust: summaries that are another
run's, truncated or foreign files, torn steps.jsonl lines, and runs that did not finish.
Synthetic run directories only: nothing is trained."""
import json

import pytest

from run_dir_fixture import write_run_dir
from sparsecomm.lab import ledger, plot_command, plots, tolerance
from sparsecomm.lab.results import ResultFileError, ResultFileWarning, load_runs, load_steps

DENSE = {0: 1.50, 1: 1.52, 2: 1.49, 3: 1.51, 4: 1.50}
NOISE = (0.001, -0.002, 0.0015, 0.0, -0.001)
HASH = "0123456789"  # the fixture's directory hash


def _curves(shift=0.15, arms=("dense", "topk-ef")):
    """dense and topk-ef, 5 seeds; topk-ef ends `shift` above dense (0.15: clearly worse at 0.05)."""
    curves = {}
    for seed in DENSE:
        for arm in arms:
            final = DENSE[seed] + (0.0 if arm == "dense" else shift + NOISE[seed])
            curves[(arm, seed)] = [(10, 1.0, final + 0.5), (20, 2.0, final)]
    return curves


def _summary(run_dir, arm, seed):
    return run_dir / "runs" / f"{arm}-seed{seed}-{HASH}" / "summary.json"


def _edit_summary(run_dir, arm, seed, changes=None, **more):
    changes = {**(changes or {}), **more}
    path = _summary(run_dir, arm, seed)
    summary = json.loads(path.read_text())
    summary.update(changes)
    path.write_text(json.dumps(summary))
    return path


def _run_all(run_dir, capsys):
    """(exit code, stdout, stderr) of ledger, check and plot on ``run_dir``."""
    results = {}
    for name, main in (("ledger", ledger.main), ("check", tolerance.main), ("plot", plot_command.main)):
        extra = ["--out", str(run_dir.parent / "plots")] if name == "plot" else []
        code = main([str(run_dir), *extra])
        out, err = capsys.readouterr()
        results[name] = (code, out, err)
    return results


# --- bug 1: a summary that is not the run its directory names -----------------------------------


@pytest.mark.parametrize("changes, said", [
    ({"config_hash": "fedcba987654"}, "config_hash 'fedcba987654', not '0123456789'"),
    ({"seed": 7}, "seed 7, not 4"),
    ({"arm": "topk-noef"}, "arm 'topk-noef', not 'topk-ef'"),
])
def test_a_summary_of_another_run_is_excluded_and_counted(tmp_path, capsys, changes, said):
    # Seed 4's summary is replaced by another run's, much better one: mixed in, it turned the
    # check's WORSE into INCONCLUSIVE. Excluded, the other four seeds are still clearly worse.
    run_dir = write_run_dir(tmp_path / "exp", _curves())
    _edit_summary(run_dir, "topk-ef", 4, {**changes, "evals": [[10, 1.0, 1.5], [20, 2.0, DENSE[4] - 0.3]]})
    report = tolerance.check(run_dir)
    (arm,) = report.arms
    assert arm.equivalence.verdict == "worse", arm.equivalence.reason
    assert arm.equivalence.n == 4 and arm.failed == 1
    assert report.exit_code == 1
    text = tolerance.format_report(report)
    assert "failed runs 1 (1 invalid)" in text
    assert said in text.replace("\n      ", " ")
    runs = {(r.arm, r.seed): r for r in load_runs(run_dir)}
    assert runs[("topk-ef", 4)].status == "invalid"  # listed under the directory's arm and seed
    built = ledger.build_ledger(run_dir)
    assert built.arm("topk-ef").runs_column == "4/1 (1 invalid)"
    assert "topk-ef seed 4: invalid:" in ledger.format_ledger(built)


def test_an_ok_summary_without_config_hash_is_excluded(tmp_path):
    run_dir = write_run_dir(tmp_path / "exp", _curves())
    path = _summary(run_dir, "topk-ef", 0)
    summary = json.loads(path.read_text())
    del summary["config_hash"]
    path.write_text(json.dumps(summary))
    run = next(r for r in load_runs(run_dir) if (r.arm, r.seed) == ("topk-ef", 0))
    assert run.status == "invalid" and "config_hash 'none'" in run.error


def test_experiment_json_must_list_each_run_under_its_own_arm_and_seed(tmp_path, capsys):
    run_dir = write_run_dir(tmp_path / "exp", _curves())
    experiment = json.loads((run_dir / "experiment.json").read_text())
    experiment["runs"] = {f"{arm}/{seed}": f"{arm}-seed{seed}-{HASH}" for arm in ("dense", "topk-ef") for seed in DENSE}
    experiment["runs"]["dense/0"] = f"topk-ef-seed0-{HASH}"
    (run_dir / "experiment.json").write_text(json.dumps(experiment))
    for name, (code, _, err) in _run_all(run_dir, capsys).items():
        assert code == 2, name
        assert f"{run_dir / 'experiment.json'}: not a sparsecomm experiment.json" in err, (name, err)
        assert "'dense/0'" in err and "Traceback" not in err


# --- bug 5: truncated and foreign files name the file and exit 2 --------------------------------


def _truncate(path, keep=40):
    path.write_text(path.read_text()[:keep])


BAD_FILES = {
    "truncated summary.json": (lambda d: _truncate(_summary(d, "topk-ef", 2)),
                               lambda d: f"{_summary(d, 'topk-ef', 2)}: not a sparsecomm summary.json: invalid JSON"),
    "summary.json a list": (lambda d: _summary(d, "dense", 1).write_text("[1, 2]"),
                            lambda d: f"{_summary(d, 'dense', 1)}: not a sparsecomm summary.json: expected a JSON object"),
    "summary.json seed a string": (lambda d: _edit_summary(d, "dense", 1, {"seed": "1"}),
                                   lambda d: f"{_summary(d, 'dense', 1)}: not a sparsecomm summary.json: seed must be"),
    "summary.json bad evals": (lambda d: _edit_summary(d, "dense", 1, evals=[[10, 1.0]]),
                               lambda d: f"{_summary(d, 'dense', 1)}: not a sparsecomm summary.json: evals[0] must be"),
    "empty experiment.json": (lambda d: (d / "experiment.json").write_text(""),
                              lambda d: f"{d / 'experiment.json'}: not a sparsecomm experiment.json: invalid JSON (empty"),
    "experiment.json a list": (lambda d: (d / "experiment.json").write_text("[]"),
                               lambda d: f"{d / 'experiment.json'}: not a sparsecomm experiment.json: expected a JSON "
                                         'object with a "config" object'),
    "foreign experiment.json": (lambda d: (d / "experiment.json").write_text('{"config": {"name": "x", "version": 3}}'),
                                lambda d: f"{d / 'experiment.json'}: not a sparsecomm experiment.json: config has no "
                                          "'task'"),
    "experiment.json name escapes": (
        lambda d: (d / "experiment.json").write_text((d / "experiment.json").read_text().replace('"name": "exp"',
                                                                                                  '"name": "../x"')),
        lambda d: f"{d / 'experiment.json'}: not a sparsecomm experiment.json: config.name must be"),
    "experiment.json policy": (
        lambda d: (d / "experiment.json").write_text((d / "experiment.json").read_text().replace(
            '"quality_tolerance": 0.05', '"quality_tolerance": "0.05"')),
        lambda d: f"{d / 'experiment.json'}: not a sparsecomm experiment.json: config.policy.quality_tolerance must be"),
    "stray directory under runs/": (lambda d: (d / "runs" / "notes").mkdir() or (d / "runs" / "notes" / "summary.json")
                                    .write_text("{}"),
                                    lambda d: f"{d / 'runs' / 'notes'}: not a run directory"),
}


@pytest.mark.parametrize("damage", BAD_FILES)
def test_every_reader_names_the_bad_file_and_exits_2(tmp_path, capsys, damage):
    run_dir = write_run_dir(tmp_path / "exp", _curves())
    spoil, message = BAD_FILES[damage]
    spoil(run_dir)
    for name, (code, out, err) in _run_all(run_dir, capsys).items():
        assert code == 2, (name, out, err)
        assert message(run_dir) in err, (name, err)
        assert "Traceback" not in err
    assert not (tmp_path / "plots").exists()  # plot stopped before writing a figure


def test_a_malformed_steps_line_in_the_middle_names_file_and_line(tmp_path, capsys):
    run_dir = write_run_dir(tmp_path / "exp", _curves())
    steps = _summary(run_dir, "dense", 3).parent / "steps.jsonl"
    lines = steps.read_text().splitlines(keepends=True)
    lines[4] = lines[4][:25] + "\n"  # a cut line with lines after it: not a torn last write
    steps.write_text("".join(lines))
    with pytest.raises(ResultFileError, match=f"{steps}:5: not a steps.jsonl line: invalid JSON"):
        load_steps(steps.parent)
    assert plot_command.main([str(run_dir), "--out", str(tmp_path / "plots")]) == 2
    assert f"{steps}:5: not a steps.jsonl line" in capsys.readouterr().err
    lines[4] = '{"kind": "train", "step": "5"}\n'
    steps.write_text("".join(lines))
    with pytest.raises(ResultFileError, match=f"{steps}:5: train row: step must be an integer"):
        load_steps(steps.parent)
    lines[4] = "[1, 2]\n"
    steps.write_text("".join(lines))
    with pytest.raises(ResultFileError, match=f"{steps}:5: not a steps.jsonl row"):
        load_steps(steps.parent)


def test_a_torn_last_line_of_steps_is_dropped_with_a_warning(tmp_path, capsys):
    run_dir = write_run_dir(tmp_path / "exp", _curves())
    steps = _summary(run_dir, "topk-ef", 1).parent / "steps.jsonl"
    whole = steps.read_text()
    number = whole.count("\n") + 1
    steps.write_text(whole + '{"kind": "train", "step": 21, "train_lo')  # crash mid-write
    with pytest.warns(ResultFileWarning, match=f"{steps}:{number}: torn last line dropped"):
        rows = load_steps(steps.parent)
    assert len(rows) == number - 1 and rows[-1]["kind"] == "eval"
    assert plot_command.main([str(run_dir), "--out", str(tmp_path / "plots")]) == 0
    err = capsys.readouterr().err
    assert err.count(f"sparsecomm plot: warning: {steps}:{number}: torn last line dropped") == 1
    steps.write_text(whole + '{"kind": "train", "step": 21}')  # complete, only the newline is missing: kept
    assert len(load_steps(steps.parent)) == number


def test_a_single_run_directory_is_not_an_experiment_directory(tmp_path, capsys):
    run_dir = write_run_dir(tmp_path / "exp", _curves())
    one = _summary(run_dir, "dense", 0).parent
    assert ledger.main([str(one)]) == 2
    assert "give the experiment directory two levels up" in capsys.readouterr().err


# --- statuses other than ok: counted, shown, never dropped ---------------------------------------


def test_an_interrupted_run_is_counted_and_its_status_shown_everywhere(tmp_path, capsys):
    run_dir = write_run_dir(tmp_path / "exp", _curves(shift=0.0), failed=(("topk-ef", 5),))
    _edit_summary(run_dir, "topk-ef", 2, status="interrupted", error="stopped by SIGTERM at step 12", evals=[])
    _edit_summary(run_dir, "dense", 3, evals=[])  # "ok", but no evaluation: no final loss
    built = ledger.build_ledger(run_dir)
    assert built.arm("topk-ef").num_failed == 2
    assert built.arm("topk-ef").runs_column == "4/2 (1 interrupted, 1 failed)"
    assert built.arm("dense").runs_column == "4/1 (1 no evaluations), 1 missing"  # was neither ok nor failed
    text = ledger.format_ledger(built)
    assert "runs not in the figures, counted as failed (4):" in text
    assert "topk-ef seed 2: interrupted: stopped by SIGTERM at step 12" in text
    assert "topk-ef seed 5: failed: RuntimeError: gloo timeout" in text
    assert "dense seed 3: ok but without evaluations" in text
    assert "dense seed 5: missing (no summary.json" in text
    report = tolerance.format_report(tolerance.check(run_dir))
    assert "failed runs 2 (1 interrupted, 1 failed)" in report
    assert "topk-ef seed 2: interrupted: stopped by SIGTERM at step 12" in report
    seen = []
    save = plots.save_figure
    plots.save_figure = lambda fig, path, on_figure: (seen.append(fig), save(fig, path, on_figure))[1]
    try:
        plots.plot_run_dir(run_dir, tmp_path / "plots", ledger.ledger_items_for_plot(run_dir))
    finally:
        plots.save_figure = save
    assert len(seen) == 3
    for fig in seen:
        texts = [t.get_text() for t in fig.findobj(lambda a: hasattr(a, "get_text"))]
        note = " ".join(next(t for t in texts if t.startswith("not drawn, counted as failed: 3 of 11 runs")).split())
        assert "topk-ef seed 2 interrupted" in note and "dense seed 3 without evaluations" in note
    legend = [t.get_text() for t in seen[0].axes[0].get_legend().get_texts()]
    assert "topk-ef (4 seeds, 1 interrupted, 1 failed)" in legend
    assert "dense (4 seeds, 1 no evaluations)" in legend


def test_check_without_a_finished_dense_run_says_so(tmp_path, capsys):
    run_dir = write_run_dir(tmp_path / "exp", _curves(arms=("topk-ef",)), failed=(("dense", 0), ("dense", 1)))
    _edit_summary(run_dir, "dense", 1, status="interrupted")
    assert tolerance.main([str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "verdicts not available: no dense run finished (1 failed, 1 interrupted)" in err
    assert "dense seed 0: failed: RuntimeError: gloo timeout" in err and "Traceback" not in err
    assert ledger.main([str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "ledger not available: no dense run finished (1 failed, 1 interrupted" in err
    assert "dense seed 1: interrupted" in err
