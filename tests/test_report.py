"""The report sparsecomm compare prints: verdicts first (one line per arm), then the ledger,
then the plots; every line within 100 columns; exit 4 without a finished dense run."""
from run_dir_fixture import write_run_dir
from sparsecomm.lab import compare
from sparsecomm.lab.results.policy import format_policy
from sparsecomm.lab.report import EXIT_NO_DENSE, report
from sparsecomm.lab.results.text import CONTINUATION, REPORT_WIDTH, fold, fold_lines

SEEDS = (0, 1, 2, 3)


def _curves():
    # dense and topk-ef reach target 1.5 at step 20 in every seed; topk-noef never does.
    curves = {}
    for seed in SEEDS:
        curves[("dense", seed)] = [(10, 1.0, 2.0), (20, 2.0 + seed, 1.5), (30, 3.0 + seed, 1.40 + 0.01 * seed)]
        curves[("topk-ef", seed)] = [(10, 0.5, 2.1), (20, 1.5, 1.5), (30, 2.5, 1.41 + 0.012 * seed)]
        curves[("topk-noef", seed)] = [(10, 0.5, 2.6), (20, 1.5, 2.2), (30, 2.5, 2.0 + 0.013 * seed)]
    return curves


def _printed(capsys, run_dir, plots_dir) -> tuple[int, list[str]]:
    code = report(run_dir, plots_dir)
    return code, capsys.readouterr().out.splitlines()


def test_verdicts_first_then_the_ledger_then_the_plots(tmp_path, capsys):
    run_dir = write_run_dir(tmp_path / "exp", _curves(), step_seconds={"dense": 0.1, "topk-ef": 0.08},
                            target_loss=1.5, failed=(("powersgd", 0),))
    code, lines = _printed(capsys, run_dir, tmp_path / "plots")
    assert code == 0
    assert lines[0] == "" and lines[1].startswith("verdicts vs dense (final val loss")
    verdicts = lines[2:lines.index(next(line for line in lines if line.startswith("overall: ")))]
    assert [line.split()[:2] for line in verdicts] == [["powersgd", "INCONCLUSIVE"], ["topk-ef", "EQUIVALENT"],
                                                       ["topk-noef", "WORSE"]]
    ledger_at = next(i for i, line in enumerate(lines) if line.startswith("experiment exp: "))
    plots_at = lines.index("plots:")
    assert len(verdicts) + 2 < ledger_at < next(i for i, line in enumerate(lines) if line.startswith("arm ")) < plots_at
    assert [line.strip() for line in lines[plots_at + 1:plots_at + 4]] == [
        str(tmp_path / "plots" / name) for name in ("time_to_loss.png", "loss_vs_step.png", "ledger.png")]
    # The report ends with where compression pays: the equivalent arm only (tests/test_breakeven_report.py).
    break_even = lines[plots_at + 5:]
    assert lines[plots_at + 4] == "" and break_even[0].startswith("where compression pays [modelled, ")
    assert [line.split(":")[0] for line in break_even if line.startswith("  ") and line[2] != " "] == [
        "  assumptions", "  topk-ef"]
    assert max(len(line) for line in break_even) <= REPORT_WIDTH
    assert all((tmp_path / "plots" / name).is_file() for name in ("time_to_loss.png", "ledger.png"))
    # The ledger leaves the policy and the target to the verdicts' detail: said once.
    text = " ".join(" ".join(lines).split())
    assert text.count(format_policy({"quality_tolerance": 0.05, "staleness_limit": 1000,
                                     "redundancy_budget": 0.05})) == 1
    assert text.count("target: val loss <= 1.5000") == 1
    assert max(len(line) for line in lines[:plots_at]) <= REPORT_WIDTH


def test_compare_prints_this_report(tmp_path, capsys):
    run_dir = write_run_dir(tmp_path / "exp", _curves(), target_loss=1.5)
    assert compare.report(run_dir, tmp_path / "a") == 0
    from_compare = capsys.readouterr().out
    report(run_dir, tmp_path / "a")
    assert from_compare == capsys.readouterr().out


def test_without_a_finished_dense_run_it_says_so_and_returns_4(tmp_path, capsys):
    curves = {key: c for key, c in _curves().items() if key[0] == "topk-ef"}
    failed = tuple(("dense", seed) for seed in SEEDS)
    run_dir = write_run_dir(tmp_path / "nodense", curves, target_loss=1.5, failed=failed)
    code, lines = _printed(capsys, run_dir, tmp_path / "plots")
    assert code == EXIT_NO_DENSE == 4
    assert lines[1:3] == ["verdicts: not available: no dense run finished (4 failed)",
                          "ledger: not available: no dense run finished (4 failed)"]
    assert "  dense seed 0: failed: RuntimeError: gloo timeout" in lines
    assert lines[lines.index("plots:") + 1:] == [f"  {tmp_path / 'plots' / name}"
                                                 for name in ("time_to_loss.png", "loss_vs_step.png")]


def test_fold_cuts_after_a_separator_in_the_second_half():
    line = "a" * 70 + ", " + "b" * 20 + "; " + "c" * 30
    assert fold(line) == ["a" * 70 + ", " + "b" * 20 + ";", CONTINUATION + "c" * 30]
    # A separator early in the line would leave most of it for the next: cut at a space instead.
    line = "a" * 10 + ", " + " ".join(["word"] * 30)
    first, second = fold(line)
    assert 95 <= len(first) <= 100 and first.endswith(" word")
    assert second.startswith(CONTINUATION + "word") and (first + second).count("word") == 30


def test_fold_keeps_every_line_within_the_width():
    words = " ".join(f"word{i}," for i in range(200))
    for line in (words, "x" * 250):
        parts = fold(line)
        assert all(len(part) <= REPORT_WIDTH for part in parts)
        assert "".join(parts).replace(CONTINUATION, "").replace(" ", "") == line.replace(" ", "")
    # A word longer than a line is cut where the line ends; the indent is never cut off alone.
    assert fold("x" * 250) == ["x" * 100, CONTINUATION + "x" * 94, CONTINUATION + "x" * 56]
    assert fold_lines(["", "short"]) == ["", "short"]


def _runs(buckets_by_arm: dict, parallelism: str = "ddp"):
    from pathlib import Path

    from sparsecomm.lab.results import RunSummary

    return [RunSummary(arm, 0, "ok", Path(arm), extra={"buckets_per_step": found, "parallelism": parallelism})
            for arm, found in buckets_by_arm.items()]


def test_the_report_says_how_many_buckets_a_step_reduced_the_gradient_in():
    from sparsecomm.lab.report import format_buckets

    assert format_buckets(_runs({"dense": 7, "topk-dgc": 7.0})) == \
        "each step reduced the gradient in 7 DDP buckets (every arm)"
    assert format_buckets(_runs({"dense": 3, "topk-dgc": 3}, "hsdp:2x2")) == \
        "each step reduced the gradient in 3 FSDP modules (every arm)"
    assert format_buckets(_runs({"dense": 1, "topk-dgc": 7})).splitlines() == [
        "each step reduced the gradient in this many DDP buckets:", "  dense: 1", "  topk-dgc: 7"]
    assert format_buckets(_runs({"dense": None})) == ""  # runs written before the count was recorded
