"""Checkpoints against an adversarial user: failed loads change nothing on any rank, every
error is a CheckpointError naming what is wrong, saves that could never load are not
committed, leftovers of crashed saves are cleaned up, and a corrupt latest checkpoint is
skipped for the newest one that verifies.

Each group of cases runs in one launch of 2 gloo ranks (different data per rank, AdamW,
a LR schedule, dropout, the top-k hook with per-rank residuals): the rank function
corrupts, loads and records, and the tests below check what it recorded.
"""
import hashlib
import json
import os
import pickle
import re
import shutil
import socket
import subprocess
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import sparsecomm.checkpoint.files as checkpoint_files
import sparsecomm.checkpoint.manager as checkpoint_manager
from rank_processes import run_on_ranks
from sparsecomm.checkpoint import CheckpointError, CheckpointManager, committed_steps, step_directory
from sparsecomm.checkpoint.rng import capture_rng
from sparsecomm.hooks import TopKState
from test_checkpoint import _Job, _flip_byte_in_last_tensor, _probe

pytestmark = pytest.mark.timeout(120)


def _digest(obj):
    """A comparable image of a nested state: tensors by dtype, shape and the SHA-256 of their bytes."""
    if isinstance(obj, torch.Tensor):
        data = obj.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return ("tensor", str(obj.dtype), tuple(obj.shape), hashlib.sha256(data).hexdigest())
    if isinstance(obj, dict):
        return {k: _digest(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_digest(v) for v in obj]
    return repr(obj)


class _Log(dict):
    """A rank's results, also pickled to disk after every case: a case that hangs (today's
    code could) loses that case and the ones after it, not the whole launch."""

    def __init__(self, log_dir, rank):
        super().__init__()
        self.path = Path(log_dir) / f"rank{rank}.pkl"

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.path.with_suffix(".tmp").write_bytes(pickle.dumps(dict(self)))
        os.replace(self.path.with_suffix(".tmp"), self.path)


def _attempt(log, key, fn):
    """``log[key] = fn()``, or what it raised."""
    try:
        log[key] = fn()
    except Exception as error:
        log[key] = ("raised", type(error).__name__, str(error)[:500])


def _run_logged(fn, root, log_dir, *args) -> list[dict]:
    try:
        return run_on_ranks(fn, root, log_dir, *args)
    except AssertionError as error:  # a rank hung or crashed: keep what each rank logged
        logs = []
        for rank in range(2):
            path = Path(log_dir) / f"rank{rank}.pkl"
            logs.append(pickle.loads(path.read_bytes()) if path.exists() else {})
            logs[-1]["launch failed"] = str(error)[-1500:]
        return logs


def _error(outcome):
    """An outcome that must be an error: (name, message[, is a CheckpointError])."""
    if outcome == "saved" or outcome[0] == "loaded":
        pytest.fail(f"expected an error, got {outcome!r}")
    return outcome


def _get(result: dict, key):
    if key not in result:
        raised = {k: v for k, v in result.items() if isinstance(v, tuple) and v[:1] == ("raised",)}
        pytest.fail(f"{key!r} was not reached: {result.get('launch failed', 'no launch error')}; steps that "
                    f"raised: {raised}")
    return result[key]


def _fingerprint(job) -> dict:
    """Everything a load may change on a rank, bit for bit."""
    return _digest({
        "model": job.model.state_dict(),
        "optimizer": job.optimizer.state_dict(),
        "scheduler": job.scheduler.state_dict(),
        "hook": job.hook.state_dict() if job.hook is not None else None,
        "rng": capture_rng({"data": job.data}),
    })


def _swap_rank_files(directory: Path) -> None:
    """Swap rank0.pt and rank1.pt and their manifest entries consistently (digests match)."""
    manifest_path = directory / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    a, b = (directory / "rank0.pt").read_bytes(), (directory / "rank1.pt").read_bytes()
    (directory / "rank0.pt").write_bytes(b)
    (directory / "rank1.pt").write_bytes(a)
    files = manifest["files"]
    files["rank0.pt"], files["rank1.pt"] = {**files["rank1.pt"], "rank": 0}, {**files["rank0.pt"], "rank": 1}
    manifest_path.write_text(json.dumps(manifest))


def _set_manifest(value):
    def corrupt(directory: Path) -> None:
        manifest = json.loads((directory / "manifest.json").read_text())
        (directory / "manifest.json").write_text(json.dumps(value(manifest)))
    return corrupt


def _truncate(directory: Path) -> None:
    path = directory / "rank1.pt"
    path.write_bytes(path.read_bytes()[:-100])


# name: (which kind of job loads, from which root, how rank 0 damages step 4 first)
LOAD_CASES = {
    "bit flip on rank 1": ("adamw", "main", lambda d: _flip_byte_in_last_tensor(d / "rank1.pt")),
    "truncated on rank 1": ("adamw", "main", _truncate),
    "rank files swapped": ("adamw", "main", _swap_rank_files),
    "manifest {}": ("adamw", "main", _set_manifest(lambda m: {})),
    "manifest []": ("adamw", "main", _set_manifest(lambda m: [])),
    "manifest files is a list": ("adamw", "main", _set_manifest(lambda m: {**m, "files": list(m["files"])})),
    "manifest world_size a string": ("adamw", "main", _set_manifest(lambda m: {**m, "world_size": "2"})),
    "sgd checkpoint into adamw": ("adamw", "sgd", lambda d: None),
    "another model config": ("wide", "main", lambda d: None),
    "dense rank files swapped": ("dense", "dense", _swap_rank_files),
    # Last: today's code raises a bare KeyError on rank 1 only, and rank 0 then waits.
    "manifest entry without sha256": ("adamw", "main", _set_manifest(
        lambda m: {**m, "files": {**m["files"], "rank1.pt": {"rank": 1, "bytes": 1, "tensors": {}}}})),
}


def _subject(rank, root: Path, kind: str):
    """A fresh job whose live state differs from the step-4 checkpoints (a failed case's
    partial restore, on code that did that, cannot leak into the next case)."""
    job = {"adamw": lambda: _Job(rank, root / "unused"),
           "dense": lambda: _Job(rank, root / "unused", hook=False),
           "wide": lambda: _Job(rank, root / "unused", outputs=5)}[kind]()  # "wide": another model
    job.train(6)
    return job


def _load_faults(rank, world_size, root, log_dir):
    root = Path(root)
    _Job(rank, root / "main").train(4, save_at={4})
    _Job(rank, root / "sgd", optimizer="sgd").train(4, save_at={4})
    _Job(rank, root / "dense", hook=False).train(4, save_at={4})
    results = _Log(log_dir, rank)
    for case, (kind, root_name, damage) in LOAD_CASES.items():
        directory = step_directory(root / root_name, 4)
        if rank == 0:
            shutil.copytree(directory, root / "pristine")
            damage(directory)
        dist.barrier()
        job = _subject(rank, root, kind)
        manager = CheckpointManager(root / root_name, model=job.ddp, optimizer=job.optimizer,
                                    scheduler=job.scheduler, hook_state=job.hook, generators={"data": job.data},
                                    probe=_probe, config_hash="test-config")
        before = _fingerprint(job)
        try:
            manager.load(4)
            outcome = ("loaded", None)
        except Exception as error:  # everything, so a bare KeyError is recorded as such
            outcome = (type(error).__name__, str(error), isinstance(error, CheckpointError))
        results[case] = (outcome, before == _fingerprint(job))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(directory)
            shutil.move(root / "pristine", directory)
        dist.barrier()
    # Guard: the same load of the undamaged checkpoint does change the state, so the
    # fingerprint would have seen a partial restore.
    job = _subject(rank, root, "adamw")
    before = _fingerprint(job)
    manager = CheckpointManager(root / "main", model=job.ddp, optimizer=job.optimizer, scheduler=job.scheduler,
                                hook_state=job.hook, generators={"data": job.data}, probe=_probe,
                                config_hash="test-config")
    results["undamaged"] = (manager.load(4).step, before == _fingerprint(job))
    return dict(results)


@pytest.fixture(scope="module")
def load_faults(tmp_path_factory):
    return _run_logged(_load_faults, str(tmp_path_factory.mktemp("load_faults")), str(tmp_path_factory.mktemp("logs")))


def _outcome(load_faults, case):
    (outcome0, unchanged0), (outcome1, unchanged1) = _get(load_faults[0], case), _get(load_faults[1], case)
    assert outcome0 == outcome1, "every rank raises the same error"
    assert unchanged0 and unchanged1, f"{case}: a failed load changed the state of rank(s) " \
        f"{[r for r, u in enumerate((unchanged0, unchanged1)) if not u]}"
    return _error(outcome0)


@pytest.mark.parametrize("case, kind, names", [
    ("bit flip on rank 1", "CheckpointCorrupt", ["rank 1: ", "rank1.pt: SHA-256 differs from the manifest"]),
    ("truncated on rank 1", "CheckpointCorrupt", ["rank 1: ", "rank1.pt: SHA-256 differs from the manifest"]),
    ("rank files swapped", "CheckpointCorrupt", ["rank 0: ", "rank 1: ", "rank0.pt holds rank 1's state"]),
    ("another model config", "CheckpointMismatch", ["the saved weights do not fit this model", "size mismatch"]),
])
def test_a_load_that_fails_on_some_ranks_changes_nothing_on_any_rank(load_faults, case, kind, names):
    """Item 1: every rank checks everything first on temporaries; all raise the same
    error naming the failing rank(s); model, optimizer, scheduler, hook state and RNGs of
    every rank are unchanged bit for bit."""
    name, message, is_checkpoint_error = _outcome(load_faults, case)
    assert name == kind and is_checkpoint_error, message
    assert all(part in message for part in names), message
    if case.endswith("on rank 1"):
        assert "rank 0: " not in message  # only the failing rank is named
    for rank in range(2):
        assert _get(load_faults[rank], "undamaged") == (4, False)  # guard: a real load changes the state


@pytest.mark.parametrize("case, names", [
    ("manifest {}", ["manifest.json has no 'format'"]),
    ("manifest []", ["manifest.json must hold a JSON object, got a JSON list"]),
    ("manifest files is a list", ["manifest.json: 'files' must be a non-empty object, got list"]),
    ("manifest world_size a string", ["manifest.json: 'world_size' must be an integer >= 1, got str"]),
    ("manifest entry without sha256", ["manifest.json files['rank1.pt'] has no 'sha256'"]),
])
def test_malformed_manifests_raise_checkpoint_errors_naming_path_and_field(load_faults, case, names):
    """Item 3 (F7): a CheckpointCorrupt naming the manifest's path and the field, never a
    bare KeyError or TypeError; nothing changed."""
    name, message, is_checkpoint_error = _outcome(load_faults, case)
    assert name == "CheckpointCorrupt" and is_checkpoint_error, message
    assert "step-00000004/manifest.json" in message and all(part in message for part in names), message


def test_an_optimizer_of_another_kind_is_a_mismatch_and_changes_nothing(load_faults):
    """Item 3: AdamW loading an SGD checkpoint: refused naming both classes, before the
    model (or anything else) is overwritten."""
    name, message, is_checkpoint_error = _outcome(load_faults, "sgd checkpoint into adamw")
    assert name == "CheckpointMismatch" and is_checkpoint_error, message
    assert "'optimizer': ('SGD', 'AdamW')" in message and "rank1.pt" in message, message


def test_a_consistent_swap_of_rank_files_is_refused_by_the_files_own_rank(load_faults):
    """Item 5: digests and manifest entries agree after the swap; only the rank recorded
    inside each file tells (a dense job: no rank-qualified hook keys to catch it)."""
    name, message, is_checkpoint_error = _outcome(load_faults, "dense rank files swapped")
    assert name == "CheckpointCorrupt" and is_checkpoint_error, message
    assert "rank0.pt holds rank 1's state, but is rank 0's file" in message, message
    assert "rank1.pt holds rank 0's state, but is rank 1's file" in message, message


def _fallback(rank, world_size, root):
    root = Path(root)
    job = _Job(rank, root, keep=3)
    job.train(6, save_at={2, 4, 6})
    if rank == 0:
        _flip_byte_in_last_tensor(step_directory(root, 6) / "rank1.pt")
    dist.barrier()
    before = _fingerprint(job)
    try:
        job.manager.load(6)
        explicit = "loaded"
    except CheckpointError as error:
        explicit = str(error)
    explicit_unchanged = before == _fingerprint(job)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = job.manager.load()
    job.step = loaded.data_position["step"]
    seen = committed_steps(root)
    dist.barrier()  # every rank has listed the steps before the save below adds one
    job.train(6, save_at={6})  # recompute the skipped step: it can be saved again
    return {
        "explicit": explicit, "explicit_unchanged": explicit_unchanged,
        "step": loaded.step, "skipped": loaded.skipped, "fell_back": loaded.fell_back,
        "warnings": [str(w.message) for w in caught if "skipped" in str(w.message)],
        "committed_after_load": seen, "committed_after_save": committed_steps(root),
        "aside": sorted(p.name for p in root.iterdir() if p.name.startswith("corrupt-")),
    }


def test_a_corrupt_latest_checkpoint_is_skipped_for_the_newest_that_verifies(tmp_path):
    """Item 5: load() passes over step 6 (corrupt on rank 1) to step 4 with a warning naming
    it and why, flags the fallback, moves step 6 aside; load(6) never falls back. The
    recomputed step 6 is saved again and equals the original bit for bit."""
    results = run_on_ranks(_fallback, str(tmp_path))
    for r in results:
        assert "cannot restore" in r["explicit"] and "step-00000006" in r["explicit"], r["explicit"]
        assert "rank 1: CheckpointCorrupt" in r["explicit"] and r["explicit_unchanged"]
        assert r["step"] == 4 and r["fell_back"] and list(r["skipped"]) == [6]
        assert "rank1.pt: SHA-256 differs from the manifest" in r["skipped"][6]
        assert len(r["warnings"]) == 1 and "step-00000006 skipped, restored step 4 instead" in r["warnings"][0]
        assert r["committed_after_load"] == [2, 4] and r["committed_after_save"] == [2, 4, 6]
        assert r["aside"] == ["corrupt-step-00000006"]
    original = json.loads((tmp_path / "corrupt-step-00000006" / "manifest.json").read_text())
    recomputed = json.loads((step_directory(tmp_path, 6) / "manifest.json").read_text())
    assert recomputed["param_digest"] == original["param_digest"]
    assert recomputed["files"]["rank1.pt"]["tensors"] == original["files"]["rank1.pt"]["tensors"]


# ----- saves ---------------------------------------------------------------------------------

def _stale_names(dead_pid: int, live_pid: int) -> dict[str, bool]:
    """Leftover directory names -> whether the next save must remove them."""
    host = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())  # as the manager names them
    return {
        f".tmp-step-00000003-deadbeef-{dead_pid}-{host}": True,  # a killed save
        f".trash-step-00000002-cafebabe-{dead_pid}-{host}": True,  # a killed deletion
        f".tmp-step-00000009-0badf00d-{live_pid}-{host}": False,  # a live process's save
        f".tmp-step-00000009-0badf00d-{dead_pid}-other_host": False,  # another host's: cannot tell
    }


def _raise_on_rank_files(original):
    def write(path, data):
        if Path(path).name.startswith("rank"):
            raise OSError(28, "No space left on device (injected)")
        return original(path, data)
    return write


def _failing_save(manager, step, *, asynchronous=False):
    started = time.monotonic()
    try:
        if asynchronous:
            manager.save_async(step, data_position={"step": step}).wait()
        else:
            manager.save(step, data_position={"step": step})
        outcome = "saved"
    except Exception as error:
        outcome = (type(error).__name__, str(error), isinstance(error, CheckpointError))
    return outcome, time.monotonic() - started


def _file_digests(directory: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def _manager(job, root, keep=1):
    """Another manager of ``job``'s live state, on ``root``."""
    return CheckpointManager(root, model=job.ddp, optimizer=job.optimizer, scheduler=job.scheduler,
                             hook_state=job.hook, generators={"data": job.data}, probe=_probe,
                             config_hash="test-config", keep=keep)


def _save(manager, step, position=None):
    try:
        manager.save(step, data_position=position or {"step": step})
        return "saved"
    except Exception as error:
        return type(error).__name__, str(error)


def _save_faults(rank, world_size, root, log_dir):
    root = Path(root)
    out = _Log(log_dir, rank)
    job = _Job(rank, root / "numpy", keep=1)
    job.train(5, save_at={4})
    # Item 2: a NumPy integer saves with torch.save but never loads with weights_only.
    out["numpy"] = _save(job.manager, 5, {"step": np.int64(5)})
    out["numpy committed"] = committed_steps(root / "numpy")
    out["numpy leftovers"] = sorted(p.name for p in (root / "numpy").iterdir() if p.name.startswith("."))
    # Item 4: a NaN probe loss is reported as such.
    job.train(6)
    nan = _manager(job, root / "nan")
    nan.probe = lambda module: float("nan")
    out["nan probe"] = _save(nan, 6)
    # Item 4: a step directory without a manifest (a crashed save) and stale temporaries.
    debris, stale = root / "debris", {}
    if rank == 0:
        dead = subprocess.Popen(["true"])
        dead.wait()
        stale = _stale_names(dead.pid, os.getppid())  # the test process lives
        for name in stale:
            (debris / name).mkdir(parents=True)
            (debris / name / "rank0.pt").write_bytes(b"x" * 1000)
        step_directory(debris, 6).mkdir()
        (step_directory(debris, 6) / "rank0.pt").write_bytes(b"half a file")
    dist.barrier()
    out["manifestless save"] = _save(_manager(job, debris), 6)
    out["manifestless"] = (committed_steps(debris), sorted(p.name for p in step_directory(debris, 6).iterdir()))
    out["stale"] = {name: (removed, (debris / name).exists()) for name, removed in stale.items()}
    # Item 4: with keep=1, saving step 3 after step 6 is refused; step 6 survives.
    _attempt(out, "older setup", lambda: _save(_manager(job, root / "older"), 6))
    older = _Job(rank, root / "older", keep=1)
    older.train(3)
    out["older"] = _save(older.manager, 3)
    out["older committed"] = committed_steps(root / "older")
    dist.barrier()
    # B2: a storage writer that fails on rank 1 only, synchronously and in the background,
    # and a rank whose state cannot be captured.
    writer = _manager(job, root / "writer")
    _attempt(out, "writer setup", lambda: _save(writer, 6))
    job.train(8)
    before = _file_digests(step_directory(root / "writer", 6))
    # wherever the manager looks the writer up (today's manager imports it by name)
    writers = {m: m.write_durably for m in (checkpoint_files, checkpoint_manager) if hasattr(m, "write_durably")}
    if rank == 1:
        for module, original in writers.items():
            module.write_durably = _raise_on_rank_files(original)
    out["writer sync"] = _failing_save(writer, 8)
    out["writer async"] = _failing_save(writer, 8, asynchronous=True)
    for module, original in writers.items():
        module.write_durably = original
    if rank == 1:
        TopKState.state_dict = _raise_state_dict
    out["capture"] = _failing_save(writer, 8)
    TopKState.state_dict = _STATE_DICT
    out["after writer"] = (committed_steps(root / "writer"), _file_digests(step_directory(root / "writer", 6)) == before,
                           sorted(p.name for p in (root / "writer").iterdir() if p.name.startswith(".tmp")))
    fresh = _Job(rank, root / "writer", keep=1)
    _attempt(out, "loadable", lambda: fresh.manager.load().step)
    return dict(out)


def _raise_state_dict(self):
    raise RuntimeError("state_dict failed (injected)")


_STATE_DICT = TopKState.state_dict


@pytest.fixture(scope="module")
def save_faults(tmp_path_factory):
    return _run_logged(_save_faults, str(tmp_path_factory.mktemp("save_faults")), str(tmp_path_factory.mktemp("logs")))


def test_a_save_that_would_never_load_is_not_committed(save_faults):
    """Item 2: the file is read back with load's own loader (weights_only) before the commit."""
    for r in save_faults:
        kind, message = _error(_get(r, "numpy"))
        assert kind == "CheckpointCorrupt", message
        assert "data_position/step holds a numpy.int64" in message and "rank0.pt would never load" in message
        assert _get(r, "numpy committed") == [4] and _get(r, "numpy leftovers") == []


def test_a_nan_probe_loss_is_reported_as_not_finite(save_faults):
    """Item 4: not as "probe loss differs across ranks" (NaN != NaN)."""
    for r in save_faults:
        kind, message = _error(_get(r, "nan probe"))
        assert kind == "CheckpointCorrupt" and "probe loss is not finite: {0: nan, 1: nan}" in message, message


def test_a_step_directory_without_manifest_does_not_block_its_step(save_faults):
    """Item 4: a crashed save's step directory is debris: the next save of that step
    replaces it (a committed one is still never overwritten)."""
    for r in save_faults:
        assert _get(r, "manifestless save") == "saved"
        assert _get(r, "manifestless") == ([6], ["manifest.json", "rank0.pt", "rank1.pt"])


def test_stale_temporary_directories_of_dead_processes_are_removed(save_faults):
    """Item 4: leftovers of a killed save or deletion go; a live process's and another
    host's stay."""
    stale = _get(save_faults[0], "stale")  # rank 0 made them and rank 0 cleans up
    assert len(stale) == 4
    for name, (removed, exists) in stale.items():
        assert exists != removed, name


def test_saving_an_older_step_than_the_newest_is_refused(save_faults):
    """Item 4: keep=1, step 3 after step 6: refused on every rank, step 6 kept (B4)."""
    for r in save_faults:
        kind, message = _error(_get(r, "older"))
        assert kind == "CheckpointRefused", message
        assert "step 3 is older than the newest checkpoint" in message and "(step 6)" in message
        assert _get(r, "older committed") == [6]


@pytest.mark.parametrize("case, names", [
    ("writer sync", ["rank 1: writing ", "rank1.pt: OSError: [Errno 28] No space left on device (injected)"]),
    ("writer async", ["rank 1: writing ", "rank1.pt: OSError: [Errno 28] No space left on device (injected)"]),
    ("capture", ["rank 1: capturing the state of step 8: RuntimeError: state_dict failed (injected)"]),
])
def test_a_storage_writer_failing_on_one_rank_reaches_every_rank(save_faults, case, names):
    """B2: the error (naming rank and path) reaches every rank quickly (no hang), there is
    no commit marker and no temporary left, the previous checkpoint is untouched and loads."""
    for r in save_faults:
        outcome, seconds = _get(r, case)
        kind, message, is_checkpoint_error = _error(outcome)
        assert kind == "CheckpointCorrupt" and is_checkpoint_error, message
        assert "checkpoint at step 8 not committed" in message and all(n in message for n in names), message
        assert "rank 0: " not in message and seconds < 15
        assert _get(r, "after writer") == ([6], True, []) and _get(r, "loadable") == 6


def test_a_link_planted_where_a_checkpoint_file_goes_is_refused_not_written_through(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("someone else's file")
    for name, write in [("rank0.pt", lambda path: checkpoint_files.write_durably(path, b"checkpoint bytes")),
                        ("manifest.json.tmp",  # the manifest's temporary name
                         lambda path: checkpoint_files.write_json_durably(path.with_name("manifest.json"), {"a": 1}))]:
        planted = tmp_path / name
        planted.symlink_to(victim)
        with pytest.raises(OSError, match=f"{re.escape(str(planted))} is a symbolic link"):
            write(planted)
        assert victim.read_text() == "someone else's file" and planted.is_symlink()
    checkpoint_files.write_durably(tmp_path / "plain.pt", b"checkpoint bytes")  # a plain file is written as ever
    assert (tmp_path / "plain.pt").read_bytes() == b"checkpoint bytes"
