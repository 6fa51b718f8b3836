"""``sparsecomm frontier`` end to end on the digits task (2 densities x 2 sparse arms x 2 seeds)."""
import json

import pytest

from sparsecomm import frontier
from sparsecomm.frontier import FrontierPoint, sparsest_equivalent

pytestmark = pytest.mark.timeout(600)


def test_frontier_runs_every_density_and_reports_the_sparsest_equivalent(tmp_path, capsys):
    out, plots = tmp_path / "runs", tmp_path / "plots"
    code = frontier.main(["--experiment", "digits-quick", "--densities", "0.05", "0.01", "--arms", "topk-ef",
                          "topk-dgc", "--seeds", "0", "1", "--steps", "150", "--out", str(out), "--plots", str(plots)])
    assert code == 0
    points = json.loads((out / "digits-quick-frontier.json").read_text())
    assert sorted((p["arm"], p["density"]) for p in points) == [
        ("topk-dgc", 0.01), ("topk-dgc", 0.05), ("topk-ef", 0.01), ("topk-ef", 0.05)]
    assert {p["verdict"] for p in points} <= {"equivalent", "better", "inconclusive", "worse"}
    by_density = {p["density"]: p for p in points if p["arm"] == "topk-ef"}
    assert by_density[0.01]["bytes_per_step"] < by_density[0.05]["bytes_per_step"]  # sparser sends less
    printed = capsys.readouterr().out
    assert "sparsest equivalent topk-ef:" in printed and "sparsest equivalent topk-dgc:" in printed
    assert (plots / "digits-quick-frontier" / "frontier.png").stat().st_size > 10_000


def test_sparsest_equivalent_picks_the_lowest_passing_density():
    def point(arm, density, verdict):
        return FrontierPoint(arm, density, verdict, 0.0, 100.0, 1.0, 10.0, "")

    best = sparsest_equivalent([point("a", 0.01, "worse"), point("a", 0.05, "equivalent"), point("a", 0.1, "equivalent"),
                                point("b", 0.05, "inconclusive")])
    assert best["a"].density == 0.05 and best["b"] is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--densities", "0.01", "0.01"], "--densities must be distinct"),
        (["--densities", "0"], "density"),
        (["--densities", "1.5"], "density"),
        (["--densities", "0.01", "--arms", "dense"], "invalid choice"),
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
