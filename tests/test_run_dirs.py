"""Run directories are created and opened without following links: a symbolic link planted
under a shared --out (run directory names are deterministic) or a directory of another user
is refused with an error naming it, before anything runs, and the file it points to is left
as it was."""
import os
import stat
import sys
from pathlib import Path

import pytest

from sparsecomm.lab import cli
from sparsecomm.lab.experiment import launch, runner
from sparsecomm.lab.experiment.files import RunDirectoryError
from sparsecomm.lab.experiment.named import digits_quick

pytestmark = pytest.mark.timeout(120)

PRECIOUS = "another user's file: must not change\n"
CONFIG = digits_quick().with_overrides(arms=("dense",), seeds=(0,))


@pytest.fixture
def fake_launch(monkeypatch):
    """A launch that ends at once (nothing trains): only the run directory's handling is tested."""
    monkeypatch.setattr(launch, "torchrun_command", lambda *args: [sys.executable, "-c", "raise SystemExit(1)"])


def _victim(tmp_path) -> Path:
    victim = tmp_path / "victim" / "notes.txt"
    victim.parent.mkdir(exist_ok=True)
    victim.write_text(PRECIOUS)
    return victim


@pytest.mark.parametrize("planted", ["run.lock", "launch.log", "steps.jsonl", "run-config.json"])
def test_a_link_planted_in_a_run_directory_is_refused_and_its_target_kept(tmp_path, fake_launch, planted):
    victim = _victim(tmp_path)
    run_dir = runner.run_directory(CONFIG, tmp_path / "out", "dense", 0)
    run_dir.mkdir(parents=True)
    (run_dir / planted).symlink_to(victim)
    with pytest.raises(RunDirectoryError, match=f"{run_dir / planted} is a symbolic link \\(to {victim}\\): refused"):
        runner.run_experiment(CONFIG, tmp_path / "out", progress=lambda line: None)
    assert victim.read_text() == PRECIOUS
    assert not (run_dir / "summary.json").exists()  # refused before the run started


@pytest.mark.parametrize("component", ["experiment", "runs", "run", "locks"])
def test_a_directory_of_the_experiment_that_is_a_link_is_refused(tmp_path, fake_launch, component):
    elsewhere = tmp_path / "victim"
    elsewhere.mkdir()
    run_dir = runner.run_directory(CONFIG, tmp_path / "out", "dense", 0)
    link = {"experiment": tmp_path / "out" / CONFIG.name, "runs": run_dir.parent, "run": run_dir,
            "locks": tmp_path / "out" / CONFIG.name / ".locks"}[component]
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(RunDirectoryError, match=f"{link} is a symbolic link \\(to {elsewhere}\\): refused"):
        runner.run_experiment(CONFIG, tmp_path / "out", progress=lambda line: None)
    assert not any(elsewhere.iterdir())  # nothing written through the link


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory of another user needs root")
def test_a_run_directory_of_another_user_is_refused(tmp_path, fake_launch):
    run_dir = runner.run_directory(CONFIG, tmp_path / "out", "dense", 0)
    run_dir.mkdir(parents=True)
    os.chown(run_dir, 65534, 65534)  # nobody: could plant links in it at any time
    with pytest.raises(RunDirectoryError, match=f"{run_dir} belongs to another user \\(uid 65534, not 0\\)"):
        runner.run_experiment(CONFIG, tmp_path / "out", progress=lambda line: None)
    assert not any(run_dir.iterdir())


def test_compare_refuses_a_planted_link_before_any_run_with_exit_2(tmp_path, capsys, monkeypatch):
    def run_experiment(*args, **kwargs):
        raise AssertionError("a run was started")

    monkeypatch.setattr(runner, "run_experiment", run_experiment)
    victim = _victim(tmp_path)
    config = digits_quick().with_overrides(arms=("dense", "topk-ef"), seeds=(1,))
    run_dir = runner.run_directory(config, tmp_path / "out", "topk-ef", 1)
    run_dir.mkdir(parents=True)
    (run_dir / "launch.log").symlink_to(victim)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["compare", "--experiment", "digits-quick", "--arms", "dense", "topk-ef", "--seeds", "1",
                  "--out", str(tmp_path / "out"), "--plots", str(tmp_path / "plots")])
    assert exit_info.value.code == 2
    assert f"{run_dir / 'launch.log'} is a symbolic link (to {victim}): refused" in capsys.readouterr().err
    assert victim.read_text() == PRECIOUS


def test_a_plain_run_directory_of_this_user_is_used_as_before(tmp_path, fake_launch):
    runner.run_experiment(CONFIG, tmp_path / "out", progress=lambda line: None)
    run_dir = runner.run_directory(CONFIG, tmp_path / "out", "dense", 0)
    assert (run_dir / "summary.json").is_file() and (run_dir / "launch.log").is_file()
    runner.run_experiment(CONFIG, tmp_path / "out", progress=lambda line: None)  # a re-run, in the same directories
    assert len(list(run_dir.glob("failed-*.json"))) == 1


def test_files_opened_in_a_run_directory_never_follow_a_link_planted_after_the_check(tmp_path):
    """The openers themselves refuse a link (O_NOFOLLOW), and a file replaced atomically
    replaces the link, not its target."""
    from sparsecomm.lab.experiment.files import write_json_atomically
    from sparsecomm.lab.experiment.run_locks import RunLock
    from sparsecomm.lab.experiment.steps_log import STEPS_FILE, StepLog, write_steps_atomically

    victim = _victim(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for name in ("run.lock", STEPS_FILE, "summary.json"):
        (run_dir / name).symlink_to(victim)
    with pytest.raises(RunDirectoryError, match="run.lock is a symbolic link"):
        RunLock(run_dir).acquire()
    assert RunLock(run_dir).holder() == "?"  # not the victim's contents
    with pytest.raises(RunDirectoryError, match=f"{STEPS_FILE} is a symbolic link"):
        StepLog(run_dir, append=True)
    write_json_atomically(run_dir / "summary.json", {"status": "ok"})
    write_steps_atomically(run_dir, [{"kind": "train", "step": 1}])
    assert not (run_dir / "summary.json").is_symlink() and not (run_dir / STEPS_FILE).is_symlink()
    assert victim.read_text() == PRECIOUS


def test_frontier_refuses_a_planted_link_with_exit_2(tmp_path, capsys, fake_launch):
    """Also where it copies a finished dense run from a sibling frontier experiment (another wire)."""
    import json

    from sparsecomm.lab.frontier import point_config

    elsewhere = tmp_path / "victim"
    elsewhere.mkdir()
    target = point_config(digits_quick().with_overrides(seeds=(0,)), 0.01, ("topk-ef",), None)
    wanted = runner.run_directory(target, tmp_path / "out", "dense", 0)
    sibling = tmp_path / "out" / f"{target.name}-chunk-rice" / "runs" / wanted.name  # a finished dense run to reuse
    sibling.mkdir(parents=True)
    (sibling / "summary.json").write_text(json.dumps({"status": "ok", "config_hash": target.run_hash("dense", 0)}))
    wanted.parent.parent.mkdir(parents=True)
    wanted.parent.symlink_to(elsewhere, target_is_directory=True)
    code = cli.main(["frontier", "--experiment", "digits-quick", "--densities", "0.01", "--arms", "topk-ef", "--seeds",
                     "0", "--out", str(tmp_path / "out"), "--plots", str(tmp_path / "plots")])
    assert code == 2
    assert f"{wanted.parent} is a symbolic link (to {elsewhere}): refused" in capsys.readouterr().err
    assert not any(elsewhere.iterdir())  # nothing copied through the link


# ----- directories others may write to ---------------------------------------------------------
# Whoever may write to a directory may rename its entries (unless it has the sticky bit), so they
# could swap a directory the lab checked for one of their own after the check.


def test_an_out_others_may_write_to_without_the_sticky_bit_is_refused_before_any_run(tmp_path, capsys, monkeypatch):
    def run_experiment(*args, **kwargs):
        raise AssertionError("a run was started")

    monkeypatch.setattr(runner, "run_experiment", run_experiment)
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o777)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["compare", "--experiment", "digits-quick", "--arms", "dense", "topk-ef", "--seeds", "1",
                  "--out", str(out), "--plots", str(tmp_path / "plots")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"--out {out} may be written by other users (mode drwxrwxrwx, 0o777) and has no sticky bit: refused" in err
    assert f"chmod +t {out}" in err and "or choose another --out" in err
    assert list(out.iterdir()) == []


def test_a_directory_under_out_others_may_write_to_is_refused(tmp_path, fake_launch):
    experiment_dir = tmp_path / "out" / CONFIG.name
    experiment_dir.mkdir(parents=True)
    experiment_dir.chmod(0o733)  # others may create and rename entries, without reading it
    with pytest.raises(RunDirectoryError, match=f"a directory under --out: {experiment_dir} may be written by other "
                                                r"users \(mode drwx-wx-wx, 0o733\) and has no sticky bit"):
        runner.run_experiment(CONFIG, tmp_path / "out", progress=lambda line: None)
    assert list(experiment_dir.iterdir()) == []


def test_a_sticky_out_is_used_and_the_lab_makes_its_directories_0o755_whatever_the_umask(tmp_path, fake_launch):
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o1777)  # as /tmp: others may create entries there, not rename ours
    previous = os.umask(0o002)  # would make every new directory group-writable
    try:
        runner.run_experiment(CONFIG, out, progress=lambda line: None)
    finally:
        os.umask(previous)
    run_dir = runner.run_directory(CONFIG, out, "dense", 0)
    assert (run_dir / "summary.json").is_file()
    made = [run_dir, run_dir.parent, out / CONFIG.name]
    assert [oct(stat.S_IMODE(path.stat().st_mode)) for path in made] == ["0o755"] * 3


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user or group needs root")
def test_an_out_of_another_user_or_writable_by_another_group_is_refused(tmp_path, fake_launch):
    out = tmp_path / "out"
    out.mkdir()
    os.chown(out, 0, 65534)
    out.chmod(0o775)  # nogroup's members may write to it
    with pytest.raises(RunDirectoryError, match=r"--out .* may be written by other users \(mode drwxrwxr-x, 0o775\)"):
        runner.run_experiment(CONFIG, out, progress=lambda line: None)
    out.chmod(0o1775)
    os.chown(out, 65534, 65534)  # its owner may rename its entries, sticky bit or not
    with pytest.raises(RunDirectoryError, match=f"--out {out} belongs to another user \\(uid 65534\\)"):
        runner.run_experiment(CONFIG, out, progress=lambda line: None)
    assert list(out.iterdir()) == []
