"""``sparsecomm tensorboard``: a run directory's recorded curves as TensorBoard event files, read
back with TensorBoard's own reader and compared with the rows of steps.jsonl."""
import json
import os
import sys

import pytest

from metrics_checks import scalars
from run_dir_fixture import write_run_dir
from sparsecomm.lab import cli

pytest.importorskip("tensorboard")

CURVES = {("dense", 0): [(2, 0.4, 2.0), (4, 0.8, 1.5)], ("topk-dgc", 0): [(2, 0.3, 2.1), (4, 0.6, 1.6)],
          ("topk-dgc", 1): [(2, 0.3, 2.2), (4, 0.6, 1.7)]}


@pytest.fixture
def experiment(tmp_path):
    return write_run_dir(tmp_path / "exp", CURVES, bytes_per_step={"dense": 1000.0, "topk-dgc": 40.0},
                         step_seconds={"dense": 0.2, "topk-dgc": 0.15})


def _files(root):
    return {os.path.relpath(os.path.join(folder, name), root) for folder, _, names in os.walk(root) for name in names}


def test_every_arm_and_seed_of_an_experiment_becomes_a_run(experiment, capsys):
    before = _files(experiment)
    assert cli.main(["tensorboard", str(experiment)]) == 0
    out = experiment / "tensorboard"
    assert sorted(_files(experiment) - before) == sorted(
        os.path.relpath(p, experiment) for p in out.rglob("events.out.tfevents.*"))  # nothing else written
    assert sorted(p.parent.relative_to(out).as_posix() for p in out.rglob("events.out.tfevents.*.sparsecomm")) == [
        "dense/seed0", "topk-dgc/seed0", "topk-dgc/seed1"]
    assert f"tensorboard --logdir {out}" in capsys.readouterr().out
    logged = scalars(out / "topk-dgc" / "seed1")
    assert logged["train/loss"] == [(step, pytest.approx(3.0 / step)) for step in (1, 2, 3, 4)]
    assert logged["val/val_loss"] == [(2, pytest.approx(2.2)), (4, pytest.approx(1.7))]
    assert logged["traffic/bytes_sent_per_step"] == [(step, 40.0) for step in (1, 2, 3, 4)]
    assert logged["traffic/bytes_dense_per_step"] == [(step, 1000.0) for step in (1, 2, 3, 4)]
    assert logged["traffic/compression"] == [(step, pytest.approx(0.04)) for step in (1, 2, 3, 4)]
    assert logged["time/step_seconds"] == [(step, pytest.approx(0.15)) for step in (1, 2, 3, 4)]
    assert {"time/compute_seconds", "time/compress_seconds", "time/comm_wait_seconds"} <= logged.keys()
    assert scalars(out / "dense" / "seed0")["traffic/bytes_sent_per_step"][0] == (1, 1000.0)


def test_again_replaces_its_own_files_and_one_run_goes_to_out(experiment, tmp_path):
    assert cli.main(["tensorboard", str(experiment)]) == 0
    keep = experiment / "tensorboard" / "dense" / "seed0" / "events.out.tfevents.1.someone-else"
    keep.write_bytes(b"")  # not the command's: left alone
    assert cli.main(["tensorboard", str(experiment)]) == 0
    assert len(list((experiment / "tensorboard" / "dense" / "seed0").glob("*.sparsecomm"))) == 1 and keep.exists()
    assert [step for step, _ in scalars(experiment / "tensorboard" / "topk-dgc" / "seed0")["train/loss"]] == [1, 2, 3, 4]
    run = experiment / "runs" / "topk-dgc-seed0-0123456789"
    # A script's run: another metric, and train rows without a loss.
    rows = [{"kind": "train", "step": 1, "train_loss": None, "bytes_sent": 10, "bytes_dense": 100},
            {"kind": "eval", "step": 1, "val_loss": 0.9, "metric": "val_accuracy", "elapsed_seconds": 1.0}]
    (run / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli.main(["tensorboard", str(run), "--out", str(tmp_path / "one")]) == 0
    assert _files(tmp_path / "one") == {p for p in _files(tmp_path / "one") if p.startswith("topk-dgc/seed0/")}
    logged = scalars(tmp_path / "one" / "topk-dgc" / "seed0")
    assert logged["val/val_accuracy"] == [(1, pytest.approx(0.9))] and "train/loss" not in logged
    assert logged["traffic/compression"] == [(1, pytest.approx(0.1))]


def test_bad_directories_exit_2_naming_them_before_writing(experiment, tmp_path, capsys):
    assert cli.main(["tensorboard", str(tmp_path / "nowhere")]) == 2
    assert f"DIR {tmp_path / 'nowhere'} does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli.main(["tensorboard", str(tmp_path / "empty")]) == 2
    assert "is neither an experiment directory (no experiment.json) nor a run directory" in capsys.readouterr().err
    torn = experiment / "runs" / "topk-dgc-seed1-0123456789" / "steps.jsonl"
    torn.write_text('{"kind": "train", "step": 1}\nnot json\n{"kind": "train", "step": 2}\n')
    assert cli.main(["tensorboard", str(experiment)]) == 2
    assert f"{torn}:2: not a steps.jsonl line" in capsys.readouterr().err
    assert not (experiment / "tensorboard").exists()  # every file is read before anything is written
    for run in (experiment / "runs").iterdir():
        (run / "steps.jsonl").unlink()
    assert cli.main(["tensorboard", str(experiment)]) == 2
    assert "no run has recorded a step yet" in capsys.readouterr().err


def test_without_tensorboard_it_names_the_extra_and_writes_nothing(experiment, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    assert cli.main(["tensorboard", str(experiment)]) == 2
    assert "pip install 'sparsecomm[tensorboard]'" in capsys.readouterr().err
    assert not (experiment / "tensorboard").exists()
