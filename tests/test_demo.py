"""The main job's command line: bad arguments stop before anything launches; a short
run launches real 2-rank jobs through torch's elastic launcher and prints the table."""
import subprocess
import sys

import pytest

from sparsecomm import cli

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "2"], "--steps must be >= 3, got 2"),
        (["--density", "0"], "--density must be in (0, 1], got 0.0"),
        (["--density", "nan"], "--density must be in (0, 1], got nan"),
        (["--world-size", "1"], "--world-size must be >= 2, got 1"),
        (["--lr", "-1"], "--lr must be > 0, got -1.0"),
        (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    ],
)
def test_bad_arguments_are_refused_before_launch(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_unknown_command_exits_2(capsys):
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_short_demo_run_prints_every_arm():
    # A subprocess, as a user runs it: the launcher spawns 2 ranks per arm.
    done = subprocess.run(
        [sys.executable, "-m", "sparsecomm", "demo", "--steps", "4", "--density", "0.01"],
        capture_output=True, text=True, timeout=200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines() if line.split()[:1] in (["dense"], ["topk-ef"], ["topk-noef"])}
    assert set(rows) == {"dense", "topk-ef", "topk-noef"}
    assert float(rows["dense"][6]) == 1.0  # dense sends what dense sends
    # 2 warm-up steps dense + 2 steps at 1%: about half of dense, and far from all of it.
    assert 0.45 < float(rows["topk-ef"][6]) < 0.6
    assert rows["topk-ef"][7] == "0.0100"
