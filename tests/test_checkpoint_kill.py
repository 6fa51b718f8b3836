"""B1: SIGKILL one rank at each stage of a save (2 gloo ranks, different data per rank, the
top-k hook with per-rank residuals; checkpoints at steps 2 and 4, the save of step 6 is
the one killed).

Until the commit (the rename of a directory holding every rank file and the manifest)
"latest" must stay the previous complete checkpoint, and no partial directory may ever be
selected; after it, the new one. The next load removes what the killed save left behind,
and the resumed run must equal the uninterrupted one bit for bit.
"""
import os
import signal
import time
from pathlib import Path

import pytest
import torch.distributed as dist

import sparsecomm.checkpoint.files as checkpoint_files
import sparsecomm.checkpoint.manager as checkpoint_manager
from rank_processes import run_on_ranks, run_on_ranks_allowing_deaths
from sparsecomm.checkpoint import CheckpointError, committed_steps
from test_checkpoint import _Job

pytestmark = pytest.mark.timeout(240)


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def _patch(name, make):
    """Replace ``name`` wherever the manager may look it up (today's imports it by name)."""
    for module in (checkpoint_files, checkpoint_manager):
        if hasattr(module, name):
            setattr(module, name, make(getattr(module, name)))


def _kill_before_data(original):
    def write(path, data):
        if Path(path).name.startswith("rank"):
            _die()
        return original(path, data)
    return write


def _kill_mid_data(original):
    def write(path, data):
        if Path(path).name.startswith("rank"):
            with open(path, "wb") as f:  # half the file reaches the disk
                f.write(data[: len(data) // 2])
                f.flush()
                os.fsync(f.fileno())
            _die()
        return original(path, data)
    return write


def _kill_before_manifest(original):
    def write(path, payload):
        if Path(path).name == "manifest.json":
            _die()
        return original(path, payload)
    return write


def _kill_before_rename(original):
    def commit(tmp_dir, final_dir):
        _die()
    return commit


def _kill_after_commit(original):
    def commit(tmp_dir, final_dir):
        original(tmp_dir, final_dir)
        _die()
    return commit


# stage: (killed rank, function patched, how, step "latest" must name afterwards)
STAGES = {
    "before data write": (1, "write_durably", _kill_before_data, 4),
    "mid data write": (0, "write_durably", _kill_mid_data, 4),
    "after data, before manifest": (0, "write_json_durably", _kill_before_manifest, 4),
    "after manifest, before rename": (0, "commit_directory", _kill_before_rename, 4),
    "after commit": (0, "commit_directory", _kill_after_commit, 6),
}


def _train_and_die(rank, world_size, root, stage):
    killed, name, make, _ = STAGES[stage]
    job = _Job(rank, root)
    job.train(6, save_at={2, 4})
    if rank == killed:
        _patch(name, make)
    started = time.monotonic()
    try:
        job.manager.save(6, data_position={"step": 6})
        return "saved", time.monotonic() - started
    except Exception as error:
        return (type(error).__name__, isinstance(error, CheckpointError), str(error)[:300]), time.monotonic() - started


def _debris(root: Path) -> dict:
    return {p.name: sorted(q.name for q in p.iterdir()) for p in root.iterdir() if p.name.startswith(".")}


def _resume_all(rank, world_size, roots, reference_root):
    reference = _Job(rank, reference_root)
    out = {"reference": (reference.train(8, save_at={2, 4, 6, 8}), reference.params(), reference.residuals())}
    for stage, root in roots.items():
        root = Path(root)
        before = (committed_steps(root), _debris(root))
        dist.barrier()  # every rank has looked before rank 0's load cleans up
        job = _Job(rank, root)
        loaded = job.manager.load()
        job.step = loaded.data_position["step"]
        losses = job.train(8, save_at={6, 8})  # the lost step 6 is saved again
        dist.barrier()
        out[stage] = (before, loaded.step, losses, job.params(), job.residuals(), committed_steps(root), _debris(root))
    return out


@pytest.fixture(scope="module")
def killed_saves(tmp_path_factory):
    roots, survivors = {}, {}
    for stage in STAGES:
        root = tmp_path_factory.mktemp("kill")
        roots[stage] = str(root)
        survivors[stage] = run_on_ranks_allowing_deaths(_train_and_die, str(root), stage)
    resumed = run_on_ranks(_resume_all, roots, str(tmp_path_factory.mktemp("reference")), timeout=120)
    return survivors, resumed


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_save_killed_at_any_stage_leaves_the_previous_checkpoint_and_resumes_bit_for_bit(killed_saves, stage):
    survivors, resumed = killed_saves
    killed, _, _, latest = STAGES[stage]
    exit_code, result = survivors[stage][killed]
    assert exit_code == -signal.SIGKILL and result is None, "the rank was killed at that stage"
    for rank in range(2):
        (committed, debris), step, losses, params, residuals, committed_after, debris_after = resumed[rank][stage]
        reference_losses, reference_params, reference_residuals = resumed[rank]["reference"]
        # Only a complete, renamed directory is a checkpoint: a partial one is never selected.
        assert committed == ([2, 4] if latest == 4 else [2, 4, 6]) and step == latest
        if killed == 0 and latest == 4:  # the dead rank 0 could not clean up: debris was there
            assert debris and all(name.startswith(".tmp-step-00000006") for name in debris), debris
        assert debris_after == {}, "the next load removes a killed save's temporary directory"
        assert committed_after == [6, 8]
        assert losses == reference_losses[step:]
        assert all(a.equal(b) for a, b in zip(params, reference_params))
        assert residuals.keys() == reference_residuals.keys()
        assert all(residuals[k].equal(reference_residuals[k]) for k in residuals)
    # The survivor was not left hanging: it raised a CheckpointError, promptly.
    _, (outcome, seconds) = survivors[stage][1 - killed]
    assert outcome != "saved" and outcome[1], outcome
    assert seconds < 30
