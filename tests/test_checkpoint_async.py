"""A9 asynchronous saves and B5 durability order (2 gloo ranks, different data per rank,
AdamW, the top-k hook with per-rank residuals).

A9: ``save_async`` returns once the cut is copied; changing weights, optimizer moments,
residuals and the caller's dicts right after it returns must not change the checkpoint,
and the next save waits for the one in flight. The writer is slowed down so that the
changes really happen while the background thread is still writing.

B5: with ``os.fsync``, ``os.replace`` and ``os.rename`` recorded (and still done), every
save, synchronous or not, makes its data files durable before the manifest, the manifest
before its rename, then fsyncs the directory, renames it into place, fsyncs the root, and
deletes old checkpoints only after that.
"""
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import sparsecomm.checkpoint.files as checkpoint_files
from sparsecomm.checkpoint import committed_steps, step_directory
from test_checkpoint import _Job
from test_checkpoint_faults import _Log, _attempt, _fingerprint, _get, _run_logged

pytestmark = pytest.mark.timeout(120)

_WRITE = checkpoint_files.write_durably


def _slow_write(path, data):
    time.sleep(0.5)
    return _WRITE(path, data)


class _Recorder:
    """Records fsync / replace / rename / rmtree calls with a clock every process on the host shares."""

    def __init__(self):
        self.events = []
        self.real = {name: getattr(os, name) for name in ("fsync", "replace", "rename")}
        self.real["rmtree"] = shutil.rmtree

    def __enter__(self):
        def fsync(fd):
            self.events.append((time.monotonic_ns(), "fsync", os.readlink(f"/proc/self/fd/{fd}")))
            return self.real["fsync"](fd)

        def move(name):
            def call(src, dst, *args, **kwargs):
                self.real[name](src, dst, *args, **kwargs)
                self.events.append((time.monotonic_ns(), name, str(src), str(dst)))
            return call

        def rmtree(path, *args, **kwargs):
            self.events.append((time.monotonic_ns(), "rmtree", str(path), ""))
            return self.real["rmtree"](path, *args, **kwargs)

        os.fsync, os.replace, os.rename = fsync, move("replace"), move("rename")
        shutil.rmtree = rmtree
        return self

    def __exit__(self, *exc):
        os.fsync, os.replace, os.rename = self.real["fsync"], self.real["replace"], self.real["rename"]
        shutil.rmtree = self.real["rmtree"]


def _train_one(job):
    job.step += 1
    x = torch.randn(8, 32, generator=job.data)
    loss = job.ddp(x).pow(2).mean()
    job.optimizer.zero_grad()
    loss.backward()
    job.optimizer.step()
    job.scheduler.step()


def _async_saves(rank, world_size, root, log_dir):
    root = Path(root)
    out = _Log(log_dir, rank)
    job = _Job(rank, root)
    _attempt(out, "async", lambda: _staging(job, root, out))
    checkpoint_files.write_durably = _WRITE
    _attempt(out, "durability", lambda: _durability(job, out))
    return dict(out)


def _staging(job, root, out):
    job.train(5)
    expected = _fingerprint(job)
    checkpoint_files.write_durably = _slow_write
    position = {"step": 5, "epoch": [0]}
    handle = job.manager.save_async(5, data_position=position)
    # Change everything the checkpoint holds while it is being written.
    position["epoch"].append(1)
    with torch.no_grad():
        for p in job.model.parameters():
            p.add_(1.0)
    for state in job.optimizer.state.values():
        state["exp_avg"].add_(1.0)
    next(iter(job.hook.memories.residuals._entries.values())).add_(1.0)
    out["in flight after the changes"] = not handle.done()
    out["blocking seconds"] = handle.blocking_seconds
    out["saved to"] = str(handle.wait())
    out["total seconds"] = handle.seconds
    loaded = job.manager.load(5)
    out["restored equals the state at save"] = _fingerprint(job) == expected
    out["data position"] = loaded.data_position
    # The next save waits for the one in flight; the training step between them runs its
    # collectives while the background thread runs its own.
    job.step = 5
    _train_one(job)
    first = job.manager.save_async(6, data_position={"step": 6})
    _train_one(job)
    second = job.manager.save_async(7, data_position={"step": 7})
    out["previous done when the next returns"] = (first.done(), 6 in committed_steps(root))
    second.wait()
    out["committed"] = committed_steps(root)
    return "done"


def _durability(job, out):
    """B5: the durability order, synchronous and asynchronous (steps 8 and 9)."""
    job.step = job.hook.step  # where the state really is, whatever the part above reached
    job.train(7)
    if 7 not in committed_steps(job.manager.root):  # an old checkpoint for retention to delete
        job.manager.save(7, data_position={"step": 7})
    job.manager.keep = 1  # each recorded save deletes the one before it
    for kind, step in (("sync", 8), ("async", 9)):
        _train_one(job)
        dist.barrier()
        with _Recorder() as recorder:
            if kind == "sync":
                job.manager.save(step, data_position={"step": step})
            else:
                job.manager.save_async(step, data_position={"step": step}).wait()
            dist.barrier()  # the other rank's calls are recorded before either stops recording
        out[kind] = recorder.events
    return "done"


@pytest.fixture(scope="module")
def async_saves(tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    return _run_logged(_async_saves, str(root), str(tmp_path_factory.mktemp("logs"))), root


def test_changes_right_after_save_async_returns_do_not_reach_the_checkpoint(async_saves):
    """A9: the cut is staged (copied) before save_async returns."""
    results, root = async_saves
    for r in results:
        assert _get(r, "in flight after the changes"), "the writer should still have been busy"
        assert _get(r, "saved to") == str(step_directory(root, 5))
        assert _get(r, "restored equals the state at save")
        assert _get(r, "data position") == {"step": 5, "epoch": [0]}
        assert _get(r, "blocking seconds") < _get(r, "total seconds")


def test_the_next_save_waits_for_the_one_in_flight(async_saves):
    results, _ = async_saves
    for r in results:
        assert _get(r, "previous done when the next returns") == (True, True)
        assert _get(r, "committed") == [6, 7]  # keep=2


@pytest.mark.parametrize("kind, step", [("sync", 8), ("async", 9)])
def test_durability_order_data_manifest_rename_directory_fsync(async_saves, kind, step):
    """B5."""
    results, root = async_saves
    events = sorted(_get(results[0], kind) + _get(results[1], kind))
    final = str(step_directory(root, step))
    tmp = next(e[2] for e in events if e[1] == "rename" and e[3] == final)

    def when(match):
        times = [e[0] for e in events if match(e)]
        assert times, "expected call not seen"
        return times

    data = when(lambda e: e[1] == "fsync" and Path(e[2]).parent == Path(tmp) and Path(e[2]).name.startswith("rank"))
    assert len(data) == 2  # both ranks' files
    manifest = when(lambda e: e[1] == "fsync" and e[2] == f"{tmp}/manifest.json.tmp")
    manifest_rename = when(lambda e: e[1] == "replace" and e[3] == f"{tmp}/manifest.json")
    directory = when(lambda e: e[1] == "fsync" and e[2] == tmp)
    commit = when(lambda e: e[1] == "rename" and e[3] == final)
    root_fsync = [t for t in when(lambda e: e[1] == "fsync" and e[2] == str(root)) if t > commit[0]]
    # an old checkpoint's deletion: renamed out of sight, or removed in place
    retention = [e[0] for e in events if e[1] in ("rename", "rmtree") and Path(e[2]).name.startswith("step-")]
    assert max(data) < manifest[0] < manifest_rename[0] < directory[0] < commit[0] < root_fsync[0]
    assert retention and min(retention) > root_fsync[0]  # the oldest checkpoint goes only after
