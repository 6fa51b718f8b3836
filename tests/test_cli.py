"""The ``sparsecomm`` entry point: every command is reachable, bad input exits 2 before work."""
import pytest

from sparsecomm import cli


def test_help_lists_every_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("compare", "ledger", "check", "plot"):
        assert f"  {command} " in out


def test_unknown_command_exits_2(capsys):
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["compare", "--steps", "0"], "steps must be an integer >= 1, got 0"),
        (["compare", "--seeds", "-1"], "seeds must be distinct integers >= 0"),
        (["compare", "--arms", "topk-ef"], "arms must be a list that includes 'dense'"),
        (["compare", "--experiment", "nope"], "invalid choice: 'nope'"),
        (["compare", "--config", "/nonexistent/config.json"], "No such file"),
    ],
)
def test_compare_refuses_bad_arguments_before_launching(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing was written, nothing launched
