"""SparseDeltaAverager refuses to sync when the ranks were given different settings: every
rank raises the same ValueError naming the setting and each rank's value, before the sync's
collectives, with the weights as the local step left them (2 and 3 gloo ranks; the last rank
is the odd one)."""
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from rank_processes import run_on_ranks

pytestmark = pytest.mark.timeout(120)

BASE = dict(period=2, density=0.1, chunk_size=64, outer_lr=0.7)
ODD = {"period": 3, "density": 0.2, "outer_lr": 0.1}  # the last rank's value of each setting in turn


def _refusals(rank, world_size):
    from sparsecomm import SparseDeltaAverager

    found = {}
    for name, odd in ODD.items():
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(15, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)))
        averager = SparseDeltaAverager(model, **{**BASE, name: odd if rank == world_size - 1 else BASE[name]})
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(rank)
        for _ in range(averager.period):
            optimizer.zero_grad()
            model(torch.randn(4, 15, generator=generator)).square().mean().backward()
            optimizer.step()
            local = [p.detach().clone() for p in model.parameters()]
            try:
                averager.step()
            except ValueError as error:
                found[name] = (str(error), averager.stats()["syncs"],
                               all(torch.equal(a, p) for a, p in zip(local, model.parameters())))
    return found


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_with_different_settings_all_raise_naming_each_ranks_value(world_size):
    for rank, found in enumerate(run_on_ranks(_refusals, world_size=world_size, timeout=90)):
        assert set(found) == set(ODD), f"rank {rank} raised for {sorted(found)} only"
        for name, (message, syncs, weights_kept) in found.items():
            values = ", ".join(f"rank {r}: {ODD[name] if r == world_size - 1 else BASE[name]!r}"
                               for r in range(world_size))
            assert f"{name} ({values})" in message, f"rank {rank}: {message}"
            assert "different settings" in message and syncs == 0 and weights_kept
