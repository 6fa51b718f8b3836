"""register_topk_hook_accelerate with a real Accelerator: 2 gloo ranks, different data per rank.

One spawned run: the hook runs sparse on the prepared model, save_state writes one hook
file per process, a fresh Accelerator's load_state gives each rank its own residuals back
bit for bit and training goes on sparse, and the wrong inputs are refused.
"""
import os

import pytest
import torch

from multiprocess import run_on_ranks
from integration_checks import assert_sparse_then_restored

STEPS, MORE_STEPS = 6, 2
DENSITY = 0.01


@pytest.fixture(scope="module")
def accelerate():
    return pytest.importorskip("accelerate")


def _prepared(accelerator):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(256, 16, generator=generator)
    # Same dataset everywhere; the prepared loader hands each process a different shard.
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :4].sin()), batch_size=8)
    return (*accelerator.prepare(model, optimizer, loader), model)


def _train(accelerator, model, optimizer, loader, steps):
    batches = iter(loader)
    for _ in range(steps):
        x, y = next(batches)
        optimizer.zero_grad()
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()


def _residuals(state):
    return {k: v for k, v in state.state_dict().items() if ".residual." in k}


def _accelerate_worker(rank, world_size, root):
    # run_on_ranks already joined the gloo group; Accelerate reads these and keeps it.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    from accelerate import Accelerator
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

    from sparsecomm.integrations import register_topk_hook_accelerate

    accelerator = Accelerator(cpu=True)
    model, optimizer, loader, raw_model = _prepared(accelerator)
    state = register_topk_hook_accelerate(accelerator, model, density=DENSITY)
    _train(accelerator, model, optimizer, loader, STEPS)
    accelerator.save_state(root)
    saved, stats = _residuals(state), state.stats()
    errors = {}
    for name, call in [
        ("twice", lambda: register_topk_hook_accelerate(accelerator, model, density=DENSITY)),
        ("unprepared", lambda: register_topk_hook_accelerate(accelerator, raw_model, density=DENSITY)),
    ]:
        try:
            call()
        except (TypeError, ValueError) as error:
            errors[name] = (type(error).__name__, str(error))

    fresh = Accelerator(cpu=True)
    model, optimizer, loader, _ = _prepared(fresh)
    restored_state = register_topk_hook_accelerate(fresh, model, density=DENSITY)
    fresh.load_state(root)
    restored, restored_step = _residuals(restored_state), restored_state.step
    _train(fresh, model, optimizer, loader, MORE_STEPS)

    fp16_kwargs = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)
    fp16 = Accelerator(cpu=True, kwargs_handlers=[fp16_kwargs])
    try:
        register_topk_hook_accelerate(fp16, _prepared(fp16)[0], density=DENSITY)
    except ValueError as error:
        errors["comm_hook"] = ("ValueError", str(error))
    return dict(saved=saved, stats=stats, restored=restored, restored_step=restored_step,
                resumed_stats=restored_state.stats(), errors=errors, distributed_type=str(accelerator.distributed_type))


@pytest.mark.timeout(90)
def test_prepared_model_runs_sparse_and_load_state_restores_each_ranks_residuals(accelerate, tmp_path):
    results = run_on_ranks(_accelerate_worker, str(tmp_path), timeout=80)
    for rank, r in enumerate(results):
        assert r["distributed_type"] == "DistributedType.MULTI_CPU"
        assert_sparse_then_restored(r, rank, steps=STEPS, more_steps=MORE_STEPS, density=DENSITY)
        errors = r["errors"]
        assert errors["twice"][0] == "ValueError"
        assert "already has a communication hook (topk_hook)" in errors["twice"][1]
        assert errors["unprepared"][0] == "TypeError" and "got Sequential" in errors["unprepared"][1]
        assert "comm_hook=DDPCommunicationHookType.FP16" in errors["comm_hook"][1]
    saved0, saved1 = results[0]["saved"], results[1]["saved"]
    for key0, key1 in zip(sorted(saved0), sorted(saved1)):
        assert key0.replace("rank0.", "rank1.") == key1
        assert not torch.equal(saved0[key0], saved1[key1]), f"{key0}: ranks hold the same residual"
    # One file per process, each holding only that process's residuals.
    for rank, saved in enumerate((saved0, saved1)):
        stored = torch.load(tmp_path / f"sparsecomm_topk_0_rank{rank}.pt", weights_only=True)
        assert {k for k in stored if ".residual." in k} == saved.keys()


def test_bad_arguments_are_refused(accelerate):
    from sparsecomm.integrations import register_topk_hook_accelerate

    with pytest.raises(TypeError, match="accelerator must be an accelerate.Accelerator, got str"):
        register_topk_hook_accelerate("accelerator", torch.nn.Linear(1, 1))
