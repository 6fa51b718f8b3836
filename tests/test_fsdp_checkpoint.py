"""Sharded checkpoints of an HSDP job (sparsecomm.fsdp.checkpoint): model, optimizer and every
rank's residuals through torch.distributed.checkpoint, resumed bit for bit; a checkpoint
refused on another mesh, with changed bytes, or while a collective is in flight. 4 gloo ranks."""
import pytest
import torch

from fsdp_models import loss, mesh_of, model_on
from rank_processes import run_on_ranks

pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore::sparsecomm.DenseFallbackWarning")]

SETTINGS = dict(density=0.1, allow_dense_fallback=False)


def _job(mesh, **settings):
    import sparsecomm

    model = model_on(mesh["shard"])
    state = sparsecomm.register_hsdp_hook(model, mesh, **SETTINGS, **settings)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), state


def _steps(model, optimizer, generator, count):
    for _ in range(count):
        loss(model, torch.randn(4, 8, generator=generator)).backward()
        optimizer.step()
        optimizer.zero_grad()


def _snapshot(model, optimizer, state):
    params = [p.to_local().detach().clone() for p in model.parameters()]
    moments = [s["exp_avg_sq"].to_local().clone() for s in optimizer.state.values()]
    residuals = {k: v.clone() for k, v in state.state_dict().items() if ".residual." in k}
    return params, moments, residuals, state.step


def _resume(rank, world_size, root, budget):
    from sparsecomm.fsdp.checkpoint import load_hsdp_checkpoint, save_hsdp_checkpoint

    mesh = mesh_of(2, 2)
    generator = torch.Generator().manual_seed(100 + rank)
    straight = _job(mesh, budget=budget)
    _steps(*straight[:2], generator, 12)
    expected = _snapshot(*straight)

    generator = torch.Generator().manual_seed(100 + rank)
    first = _job(mesh, budget=budget)
    _steps(*first[:2], generator, 6)
    save_hsdp_checkpoint(root, model=first[0], optimizer=first[1], state=first[2], mesh=mesh, step=6)
    resumed = _job(mesh, budget=budget)  # a fresh job: its weights are the initial ones until the load
    step = load_hsdp_checkpoint(root, model=resumed[0], optimizer=resumed[1], state=resumed[2], mesh=mesh)
    _steps(*resumed[:2], generator, 6)
    return step, expected, _snapshot(*resumed)


# budget="model": each shard's modules have shares of their own (the same on its replicas), all
# under the hook state's one key: a load must give every shard its own.
@pytest.mark.parametrize("budget", ["bucket", "model"])
def test_a_resumed_hsdp_job_continues_bit_for_bit(tmp_path, budget):
    for rank, (step, expected, got) in enumerate(run_on_ranks(_resume, str(tmp_path), budget, world_size=4)):
        assert step == 6
        params, moments, residuals, hook_step = got
        assert hook_step == expected[3] == 12
        assert all(torch.equal(a, b) for a, b in zip(params, expected[0])), f"rank {rank}: weights differ"
        assert all(torch.equal(a, b) for a, b in zip(moments, expected[1])), f"rank {rank}: optimizer differs"
        assert residuals.keys() == expected[2].keys() and len(residuals) == 3
        assert all(torch.equal(residuals[k], expected[2][k]) for k in residuals), f"rank {rank}: residuals differ"


def _save_then_misuse(rank, world_size, root):
    from sparsecomm.checkpoint import CheckpointCorrupt, CheckpointMismatch, CheckpointRefused
    from sparsecomm.fsdp.checkpoint import load_hsdp_checkpoint, save_hsdp_checkpoint

    mesh = mesh_of(2, 2)
    model, optimizer, state = _job(mesh)
    _steps(model, optimizer, torch.Generator().manual_seed(rank), 4)
    save_hsdp_checkpoint(root, model=model, optimizer=optimizer, state=state, mesh=mesh, step=4)
    messages = {}
    try:
        save_hsdp_checkpoint(root, model=model, optimizer=optimizer, state=state, mesh=mesh, step=4)
    except CheckpointRefused as error:
        messages["overwrite"] = str(error)
    other = mesh_of(1, 4)
    job = _job(other)
    try:
        load_hsdp_checkpoint(root, model=job[0], optimizer=job[1], state=job[2], mesh=other)
    except CheckpointMismatch as error:
        messages["mesh"] = str(error)
    torch.distributed.barrier()
    if rank == 0:  # one flipped byte in one file
        data = sorted(p for p in (root / "step-4").iterdir() if p.suffix == ".distcp")[0]
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x40
        data.write_bytes(bytes(raw))
    torch.distributed.barrier()
    before = [p.to_local().clone() for p in model.parameters()]
    try:
        load_hsdp_checkpoint(root, model=model, optimizer=optimizer, state=state, mesh=mesh)
    except CheckpointCorrupt as error:
        messages["corrupt"] = str(error)
    messages["unchanged"] = all(torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters()))
    return messages


def test_overwrite_another_mesh_and_changed_bytes_are_refused_on_every_rank(tmp_path):
    from pathlib import Path

    for messages in run_on_ranks(_save_then_misuse, Path(tmp_path), world_size=4):
        assert "never overwritten" in messages["overwrite"]
        assert "another mesh" in messages["mesh"] and "[2, 2]" in messages["mesh"] and "[1, 4]" in messages["mesh"]
        assert "SHA-256" in messages["corrupt"] and messages["unchanged"]


def _resume_averager(rank, world_size, root):
    import sparsecomm
    from sparsecomm.fsdp.checkpoint import load_hsdp_checkpoint, save_hsdp_checkpoint

    mesh = mesh_of(2, 2)

    def job():
        model = model_on(mesh["shard"])
        averager = sparsecomm.SparseDeltaAverager(model, mesh=mesh, period=3, density=0.25, chunk_size=64)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2), averager

    def steps(model, optimizer, averager, generator, count):
        for _ in range(count):
            _steps(model, optimizer, generator, 1)
            averager.step()

    def snapshot(model, averager):
        return ([p.to_local().detach().clone() for p in model.parameters()], averager.anchor.clone(),
                averager.error.clone(), averager.optimizer_steps)

    generator = torch.Generator().manual_seed(100 + rank)
    straight = job()
    steps(*straight, generator, 12)
    expected = snapshot(straight[0], straight[2])
    generator = torch.Generator().manual_seed(100 + rank)
    first = job()
    steps(*first, generator, 7)  # a step past a sync: the replicas' local weights differ
    save_hsdp_checkpoint(root, model=first[0], optimizer=first[1], averager=first[2], mesh=mesh, step=7)
    resumed = job()
    load_hsdp_checkpoint(root, model=resumed[0], optimizer=resumed[1], averager=resumed[2], mesh=mesh)
    steps(*resumed, generator, 5)
    return expected, snapshot(resumed[0], resumed[2])


def test_a_resumed_averager_on_a_sharded_model_continues_bit_for_bit(tmp_path):
    for rank, (expected, got) in enumerate(run_on_ranks(_resume_averager, str(tmp_path), world_size=4)):
        assert got[3] == expected[3] == 12
        assert all(torch.equal(a, b) for a, b in zip(got[0], expected[0])), f"rank {rank}: weights differ"
        assert torch.equal(got[1], expected[1]) and torch.equal(got[2], expected[2]), f"rank {rank}: averager"


def _misfits(rank, world_size, root):
    """A hook state saved at density 0.1 loaded into a hook at 0.2, and an averager's saved at
    period 3 into one at period 2: refused on every rank before the weights, the optimizer
    state or the memories change."""
    import sparsecomm
    from sparsecomm.checkpoint import CheckpointMismatch
    from sparsecomm.fsdp.checkpoint import load_hsdp_checkpoint, save_hsdp_checkpoint

    mesh = mesh_of(2, 1)
    model, optimizer, state = _job(mesh)
    _steps(model, optimizer, torch.Generator().manual_seed(rank), 3)
    save_hsdp_checkpoint(root / "hook", model=model, optimizer=optimizer, state=state, mesh=mesh, step=3)
    other = model_on(mesh["shard"])
    other_state = sparsecomm.register_hsdp_hook(other, mesh, **{**SETTINGS, "density": 0.2})
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=1e-2)
    _steps(other, other_optimizer, torch.Generator().manual_seed(50 + rank), 2)
    before = _snapshot(other, other_optimizer, other_state)
    messages = {}
    try:
        load_hsdp_checkpoint(root / "hook", model=other, optimizer=other_optimizer, state=other_state, mesh=mesh)
    except CheckpointMismatch as error:
        messages["hook"] = str(error)
    after = _snapshot(other, other_optimizer, other_state)
    unchanged = {"hook": all(torch.equal(a, b) for a, b in zip(before[0] + before[1], after[0] + after[1]))
                 and before[2].keys() == after[2].keys() and all(torch.equal(before[2][k], after[2][k]) for k in before[2])
                 and before[3] == after[3]}

    def averaged(period):
        model = model_on(mesh["shard"])
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2), sparsecomm.SparseDeltaAverager(
            model, mesh=mesh, period=period, density=0.25, chunk_size=64)

    model, optimizer, averager = averaged(3)
    _steps(model, optimizer, torch.Generator().manual_seed(rank), 1)
    averager.step()
    save_hsdp_checkpoint(root / "averager", model=model, optimizer=optimizer, averager=averager, mesh=mesh, step=1)
    model, optimizer, averager = averaged(2)
    _steps(model, optimizer, torch.Generator().manual_seed(50 + rank), 1)
    weights = [p.to_local().clone() for p in model.parameters()]
    moments = [s["exp_avg"].to_local().clone() for s in optimizer.state.values()]
    try:
        load_hsdp_checkpoint(root / "averager", model=model, optimizer=optimizer, averager=averager, mesh=mesh)
    except CheckpointMismatch as error:
        messages["averager"] = str(error)
    unchanged["averager"] = (all(torch.equal(a, p.to_local()) for a, p in zip(weights, model.parameters()))
                             and all(torch.equal(a, s["exp_avg"].to_local())
                                     for a, s in zip(moments, optimizer.state.values()))
                             and averager.optimizer_steps == 0)
    return messages, unchanged


def test_a_saved_state_that_does_not_fit_is_refused_before_anything_is_overwritten(tmp_path):
    from pathlib import Path

    for rank, (messages, unchanged) in enumerate(run_on_ranks(_misfits, Path(tmp_path), world_size=2)):
        assert "density" in messages.get("hook", "") and "0.1" in messages["hook"] and "0.2" in messages["hook"], \
            f"rank {rank}: {messages}"
        assert "rank 0:" in messages["hook"] and "rank 1:" in messages["hook"]  # every rank's reason, on each
        assert "period" in messages.get("averager", "") and "(3, 2)" in messages["averager"], f"rank {rank}: {messages}"
        assert unchanged == {"hook": True, "averager": True}, f"rank {rank}: {unchanged}"


def _failed_saves(rank, world_size, root):
    """A dangling link planted at step-9 before the save; one that appears at step-10 between
    the check and the rename (rank 0 commits). Both fail on every rank, naming the path."""
    import os

    import sparsecomm.fsdp.checkpoint as hsdp_checkpoint
    from sparsecomm.checkpoint import CheckpointRefused

    mesh = mesh_of(2, 1)
    model, optimizer, state = _job(mesh)
    _steps(model, optimizer, torch.Generator().manual_seed(rank), 2)
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        os.symlink("NOWHERE", root / "step-9")
    torch.distributed.barrier()
    messages = {}
    try:
        hsdp_checkpoint.save_hsdp_checkpoint(root, model=model, optimizer=optimizer, state=state, mesh=mesh, step=9)
    except CheckpointRefused as error:
        messages["planted"] = str(error)
    real_commit = hsdp_checkpoint.commit_directory

    def commit_after_a_link_appeared(tmp_dir, final_dir):
        os.symlink("NOWHERE", final_dir)
        real_commit(tmp_dir, final_dir)

    hsdp_checkpoint.commit_directory = commit_after_a_link_appeared
    try:
        hsdp_checkpoint.save_hsdp_checkpoint(root, model=model, optimizer=optimizer, state=state, mesh=mesh, step=10)
    except CheckpointRefused as error:
        messages["raced"] = str(error)
    finally:
        hsdp_checkpoint.commit_directory = real_commit
    torch.distributed.barrier()
    return messages, sorted(p.name for p in root.iterdir()), [os.readlink(root / n) for n in ("step-9", "step-10")]


def test_a_save_that_fails_on_one_rank_fails_on_every_rank_and_leaves_no_temporary_directory(tmp_path):
    from pathlib import Path

    root = Path(tmp_path) / "ckpt"
    for rank, (messages, names, links) in enumerate(run_on_ranks(_failed_saves, root, world_size=2)):
        assert f"{root / 'step-9'} exists already" in messages.get("planted", ""), f"rank {rank}: {messages}"
        assert f"committing {root / 'step-10'} failed" in messages.get("raced", ""), f"rank {rank}: {messages}"
        assert names == ["step-10", "step-9"] and links == ["NOWHERE", "NOWHERE"]  # no .tmp-step-*, links kept


def _odd_folders(rank, world_size, root):
    """Beside an intact step-6: folders named with digits that are not ASCII (their manifests
    copied from step-6), then malformed manifests in step-7."""
    import shutil

    from sparsecomm.checkpoint import CheckpointCorrupt
    from sparsecomm.fsdp.checkpoint import latest_hsdp_step, load_hsdp_checkpoint, save_hsdp_checkpoint

    mesh = mesh_of(2, 1)
    model, optimizer, state = _job(mesh)
    _steps(model, optimizer, torch.Generator().manual_seed(rank), 2)
    save_hsdp_checkpoint(root, model=model, optimizer=optimizer, state=state, mesh=mesh, step=6)
    if rank == 0:
        for name in ("step-\u00b2", "step-\u0669\u0669", "step-06"):  # superscript two, Arabic-Indic 99, a leading 0
            shutil.copytree(root / "step-6", root / name)
    torch.distributed.barrier()
    found = {"latest": latest_hsdp_step(root),
             "loaded": load_hsdp_checkpoint(root, model=model, optimizer=optimizer, state=state, mesh=mesh)}
    for case, manifest in (("list", "[]"), ("incomplete", '{"format": "sparsecomm-hsdp-checkpoint-1", "step": 7}'),
                           ("mesh a string", '{"format": "sparsecomm-hsdp-checkpoint-1", "step": 7, '
                                             '"world_size": 2, "mesh": "2x1", "files": {}}')):
        torch.distributed.barrier()
        if rank == 0:
            shutil.rmtree(root / "step-7", ignore_errors=True)
            shutil.copytree(root / "step-6", root / "step-7")
            (root / "step-7" / "manifest.json").write_text(manifest)
        torch.distributed.barrier()
        try:
            load_hsdp_checkpoint(root, model=model, optimizer=optimizer, state=state, mesh=mesh, step=7)
        except CheckpointCorrupt as error:
            found[case] = str(error)
    return found


def test_only_ascii_step_folders_count_and_a_malformed_manifest_is_corrupt(tmp_path):
    from pathlib import Path

    for rank, found in enumerate(run_on_ranks(_odd_folders, Path(tmp_path), world_size=2)):
        assert found["latest"] == 6 and found["loaded"] == 6, f"rank {rank}: {found}"
        assert "must hold a JSON object, got a JSON list" in found.get("list", ""), f"rank {rank}: {found}"
        assert "has no 'world_size'" in found.get("incomplete", ""), f"rank {rank}: {found}"
        assert "'mesh' must be an object" in found.get("mesh a string", ""), f"rank {rank}: {found}"
