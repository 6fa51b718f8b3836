"""Progress of a run from its steps.jsonl: quiet off a terminal unless asked, one rewritten
line on a terminal, plain lines every few seconds with SPARSECOMM_PROGRESS=1, and a reader
that survives a file that is missing, torn, cut back or replaced."""
import io
import json
import os

import pytest

from sparsecomm.lab.experiment.progress import PROGRESS_ENV, RunProgress, StepsTail


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _train(step: int, loss: float = 2.0, seconds_per_step: float = 0.1) -> dict:
    return {"kind": "train", "step": step, "train_loss": loss, "step_seconds": seconds_per_step,
            "elapsed_seconds": step * seconds_per_step}


def _append(path, *rows, end="\n") -> None:
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows[:-1]) + json.dumps(rows[-1]) + end)


@pytest.fixture(autouse=True)
def no_progress_env(monkeypatch):
    monkeypatch.delenv(PROGRESS_ENV, raising=False)


def _progress(tmp_path, clock, *, terminal: bool, every_s: float = 5.0, total_steps: int = 300):
    stream = io.StringIO()
    progress = RunProgress("topk-dgc seed 1", tmp_path / "steps.jsonl", total_steps, stream=stream,
                           every_s=every_s, is_terminal=terminal, clock=clock)
    return progress, stream


def test_the_line_says_step_time_losses_and_time_left(tmp_path, monkeypatch):
    monkeypatch.setenv(PROGRESS_ENV, "1")
    clock = Clock()
    progress, stream = _progress(tmp_path, clock, terminal=False)
    _append(tmp_path / "steps.jsonl", *[_train(s, 3.0 / s, 14.2 / 120) for s in range(1, 121)],
            {"kind": "eval", "step": 120, "val_loss": 2.4, "elapsed_seconds": 14.5})
    clock.now += 5.0
    progress.poll()
    # 14.2 s for 120 steps: 180 more steps take 21.3 s at that pace.
    assert stream.getvalue() == ("  topk-dgc seed 1: step 120/300 (40%), 14.2 s, train loss 0.025, val loss 2.4, "
                                 "~21.3 s left\n")


def test_not_a_terminal_is_quiet(tmp_path):
    clock = Clock()
    progress, stream = _progress(tmp_path, clock, terminal=False)
    _append(tmp_path / "steps.jsonl", _train(1), _train(2))
    for _ in range(3):
        clock.now += 10.0
        progress.poll()
    progress.close()
    assert stream.getvalue() == "" and not progress.shown


def test_the_environment_asks_for_plain_lines_every_few_seconds(tmp_path, monkeypatch):
    monkeypatch.setenv(PROGRESS_ENV, "1")
    clock = Clock()
    progress, stream = _progress(tmp_path, clock, terminal=False, total_steps=10)
    path = tmp_path / "steps.jsonl"
    _append(path, _train(1))
    progress.poll()
    assert stream.getvalue() == ""  # not every_s since the start yet: a short run leaves no trace
    clock.now += 5.0
    progress.poll()
    assert stream.getvalue().splitlines() == ["  topk-dgc seed 1: step 1/10 (10%), 0.1 s, train loss 2, ~0.9 s left"]
    _append(path, _train(2))
    clock.now += 4.9
    progress.poll()
    assert len(stream.getvalue().splitlines()) == 1  # at most one line every 5 s
    clock.now += 0.1
    progress.poll()
    clock.now += 5.0
    progress.poll()  # nothing new: no repeated line
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and lines[1].startswith("  topk-dgc seed 1: step 2/10 (20%)")
    _append(path, *[_train(s) for s in range(3, 11)])
    progress.close()
    progress.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3 and lines[2] == "  topk-dgc seed 1: step 10/10 (100%), 1.0 s, train loss 2"


def test_close_prints_nothing_when_nothing_was_shown(tmp_path, monkeypatch):
    monkeypatch.setenv(PROGRESS_ENV, "1")
    clock = Clock()
    progress, stream = _progress(tmp_path, clock, terminal=False)
    _append(tmp_path / "steps.jsonl", _train(1))
    progress.poll()
    progress.close()
    assert stream.getvalue() == ""


def test_a_terminal_gets_one_line_rewritten_in_place(tmp_path):
    clock = Clock()
    progress, stream = _progress(tmp_path, clock, terminal=True, total_steps=1000)
    path = tmp_path / "steps.jsonl"
    progress.poll()
    assert stream.getvalue() == ""  # no file yet
    _append(path, *[_train(s, loss=12.5) for s in range(1, 10)])
    progress.poll()  # the first step shows at once
    first = "  topk-dgc seed 1: step 9/1000 (1%), 0.9 s, train loss 12.5, ~1 min 39 s left"
    assert stream.getvalue() == "\r" + first
    _append(path, _train(10, loss=1.0))
    clock.now += 0.2
    progress.poll()
    assert stream.getvalue() == "\r" + first  # refreshed at most every 0.5 s
    clock.now += 0.3
    progress.poll()
    second = "  topk-dgc seed 1: step 10/1000 (1%), 1.0 s, train loss 1, ~1 min 39 s left"
    # The shorter line is padded so that nothing of the longer one stays on the screen.
    assert stream.getvalue() == "\r" + first + "\r" + second.ljust(len(first))
    progress.close()
    assert stream.getvalue().endswith("\r" + second + "\n") and "\n" not in stream.getvalue()[:-1]


def test_the_environment_can_silence_a_terminal(tmp_path, monkeypatch):
    monkeypatch.setenv(PROGRESS_ENV, "0")
    clock = Clock()
    progress, stream = _progress(tmp_path, clock, terminal=True)
    _append(tmp_path / "steps.jsonl", _train(1))
    progress.poll()
    progress.close()
    assert stream.getvalue() == ""


def test_without_is_terminal_the_stream_is_asked(tmp_path):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    _append(tmp_path / "steps.jsonl", _train(1))
    streams = [Terminal(), io.StringIO()]
    for stream in streams:
        progress = RunProgress("dense seed 0", tmp_path / "steps.jsonl", 10, stream=stream, clock=Clock())
        progress.poll()
        progress.close()
    assert streams[0].getvalue().startswith("\r  dense seed 0: step 1/10") and streams[1].getvalue() == ""


def test_a_torn_last_line_waits_for_its_end(tmp_path):
    path = tmp_path / "steps.jsonl"
    tail = StepsTail(path)
    assert tail.read() == ([], False)  # no file yet
    _append(path, _train(1), _train(2), end="")
    text = path.read_text()
    path.write_text(text[:-5])  # the writer is mid-line
    rows, restarted = tail.read()
    assert [r["step"] for r in rows] == [1] and not restarted
    with open(path, "a") as f:
        f.write(text[-5:] + "\n")
    rows, restarted = tail.read()
    assert [r["step"] for r in rows] == [2] and not restarted
    assert tail.read() == ([], False)  # nothing new: nothing read twice


def test_lines_that_are_not_json_objects_are_skipped(tmp_path):
    path = tmp_path / "steps.jsonl"
    path.write_bytes(b'{"kind": "train", "step": 1}\nnot json\n[1, 2]\n\xff\xfe\n{"kind": "train", "step": 2}\n')
    rows, _ = StepsTail(path).read()
    assert [r["step"] for r in rows] == [1, 2]


def test_a_file_replaced_by_a_resume_is_read_again_from_its_start(tmp_path):
    path = tmp_path / "steps.jsonl"
    tail = StepsTail(path)
    _append(path, *[_train(s) for s in range(1, 31)])
    assert len(tail.read()[0]) == 30
    # A resume from the step-20 checkpoint: a new file with the rows up to step 20, renamed over.
    replacement = tmp_path / ".steps.jsonl.tmp"
    replacement.write_text("".join(json.dumps(_train(s)) + "\n" for s in range(1, 21)))
    os.replace(replacement, path)
    rows, restarted = tail.read()
    assert restarted and [r["step"] for r in rows] == list(range(1, 21))


def test_a_file_cut_back_in_place_is_read_again_from_its_start(tmp_path):
    path = tmp_path / "steps.jsonl"
    tail = StepsTail(path)
    _append(path, *[_train(s) for s in range(1, 31)])
    tail.read()
    with open(path, "w") as f:  # same file, shorter
        f.write(json.dumps(_train(1)) + "\n")
    rows, restarted = tail.read()
    assert restarted and [r["step"] for r in rows] == [1]
    # Rewritten in place to a longer file: the last line read no longer ends where it did.
    with open(path, "w") as f:
        f.write(json.dumps({"kind": "eval", "step": 1, "val_loss": 2.0, "note": "x" * 7}) + "\n" + "y" * 100 + "\n")
    rows, restarted = tail.read()
    assert restarted and [r["kind"] for r in rows] == ["eval"]


def test_progress_after_a_resume_shows_the_rewritten_rows(tmp_path, monkeypatch):
    monkeypatch.setenv(PROGRESS_ENV, "1")
    clock = Clock()
    progress, stream = _progress(tmp_path, clock, terminal=False, total_steps=40)
    path = tmp_path / "steps.jsonl"
    _append(path, *[_train(s) for s in range(1, 31)], {"kind": "eval", "step": 30, "val_loss": 1.5})
    clock.now += 5.0
    progress.poll()
    replacement = tmp_path / ".steps.jsonl.tmp"
    replacement.write_text("".join(json.dumps(_train(s)) + "\n" for s in range(1, 21)))
    os.replace(replacement, path)
    clock.now += 5.0
    progress.poll()
    last = stream.getvalue().splitlines()[-1]
    assert last.startswith("  topk-dgc seed 1: step 20/40 (50%)") and "val loss" not in last  # that eval was cut
