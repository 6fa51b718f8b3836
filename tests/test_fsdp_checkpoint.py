"""Sharded checkpoints of an HSDP job (sparsecomm.fsdp.checkpoint): model, optimizer and every
rank's residuals through torch.distributed.checkpoint, resumed bit for bit; a checkpoint
refused on another mesh, with changed bytes, or while a collective is in flight. 4 gloo ranks."""
import pytest
import torch

from fsdp_models import loss, mesh_of, model_on
from multiprocess import run_on_ranks

pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore::sparsecomm.DenseFallbackWarning")]

SETTINGS = dict(density=0.1, allow_dense_fallback=False)


def _job(mesh):
    import sparsecomm

    model = model_on(mesh["shard"])
    state = sparsecomm.register_hsdp_hook(model, mesh, **SETTINGS)
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


def _resume(rank, world_size, root):
    from sparsecomm.fsdp.checkpoint import load_hsdp_checkpoint, save_hsdp_checkpoint

    mesh = mesh_of(2, 2)
    generator = torch.Generator().manual_seed(100 + rank)
    straight = _job(mesh)
    _steps(*straight[:2], generator, 12)
    expected = _snapshot(*straight)

    generator = torch.Generator().manual_seed(100 + rank)
    first = _job(mesh)
    _steps(*first[:2], generator, 6)
    save_hsdp_checkpoint(root, model=first[0], optimizer=first[1], state=first[2], mesh=mesh, step=6)
    resumed = _job(mesh)  # a fresh job: its weights are the initial ones until the load
    step = load_hsdp_checkpoint(root, model=resumed[0], optimizer=resumed[1], state=resumed[2], mesh=mesh)
    _steps(*resumed[:2], generator, 6)
    return step, expected, _snapshot(*resumed)


def test_a_resumed_hsdp_job_continues_bit_for_bit(tmp_path):
    for rank, (step, expected, got) in enumerate(run_on_ranks(_resume, str(tmp_path), world_size=4)):
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
