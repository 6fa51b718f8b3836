"""The core multi-rank invariants at 2, 3 and 4 ranks (two-rank jobs hide sums whose order
or divisor is wrong: 0 + a + b is also a + b, and p - 1 == 1).

- density 1 on the sparse path == the mean of the local gradients, summed in rank order
  (an oracle built from all-gathered local gradients), and torch's allreduce_hook the same
  bit for bit at 2 ranks, within the rounding of its own order of additions from 3 ranks
  on (density_one);
- error feedback conserves mass on every step (verify_conservation, several buckets);
- the replicas are bit-identical after every optimizer step;
- the bytes each rank sent and received are the payload sizes worked out by hand;
- each rank's state round-trips through state_dict(), and another rank's is refused.
"""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm
from sparsecomm import TopKState
from ddp_models import mlp, rank_data
from density_one import assert_density_one_is_allreduce, compare_with_allreduce
from rank_processes import run_on_ranks
from sparsecomm.compress.payload_seal import TRAILER_BYTES

pytestmark = pytest.mark.timeout(240)


def _gathered(tensor):
    everyone = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, tensor.contiguous())
    return everyone


class _BucketSizes:
    """Records the sizes of the buckets of the last step the hook saw."""

    needs_acc = False  # keeps the fused kernel: the byte counts are those of the fast path

    def __init__(self):
        self.last_step, self._step = [], None

    def __call__(self, event):
        if event.stage == "gradient":
            if event.step != self._step:
                self.last_step, self._step = [], event.step
            self.last_step.append(sum(event.numels))


def _conservation_and_replicas(rank, world_size):
    model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(4)])
    torch.manual_seed(0)
    for p in model.parameters():
        nn.init.normal_(p, std=0.05)
    ddp = DDP(model, bucket_cap_mb=0.1)
    # budget='bucket': each bucket sends ceil(0.01 n), as the bytes below are worked out by hand
    state = sparsecomm.register_topk_hook(ddp, density=0.01, verify_conservation=True, budget="bucket")
    state.add_observer(_BucketSizes())
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    diverged_at = []
    for step, x in enumerate(rank_data(rank, 6, (16, 128))):
        optimizer.zero_grad()
        ddp(x).pow(2).mean().backward()
        optimizer.step()
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        if not all(torch.equal(flat, other) for other in _gathered(flat)):
            diverged_at.append(step)
    stats = state.stats()
    return diverged_at, stats, state.observers[0].last_step


def _round_trip(rank, world_size):
    ddp = DDP(mlp())
    state = sparsecomm.register_topk_hook(ddp, density=0.05, selector="sampled")
    for x in rank_data(rank, 4, (8, 32)):
        ddp(x).pow(2).mean().backward()
    saved = state.state_dict()
    everyone = [None] * world_size
    dist.all_gather_object(everyone, saved)
    restored = TopKState(density=0.05, selector="sampled")
    restored.load_state_dict(saved)
    again = restored.state_dict()
    same = saved.keys() == again.keys() and all(
        torch.equal(saved[k], again[k]) for k in saved if isinstance(saved[k], torch.Tensor))
    refusal = ""
    try:
        TopKState(density=0.05, selector="sampled").load_state_dict(everyone[(rank + 1) % world_size])
    except ValueError as error:
        refusal = str(error)
    return same, refusal


def _core_worker(rank, world_size):
    return (compare_with_allreduce(rank, world_size, {"density": 1.0, "allow_dense_fallback": False}),
            _conservation_and_replicas(rank, world_size), _round_trip(rank, world_size))


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_core_invariants(world_size):
    results = run_on_ranks(_core_worker, world_size=world_size, timeout=180)
    assert_density_one_is_allreduce([density_one for density_one, _, _ in results], world_size)
    for rank, (_, (diverged_at, stats, layout), (same, refusal)) in enumerate(results):
        assert diverged_at == []
        assert stats["sparse_calls"] > 0 and stats["steps"] == 6
        # Bytes by hand, for the last step: each bucket of n elements sends
        # k = ceil(0.01 n) int32 + fp32 pairs (8 bytes each, a multiple of 8 already) and its
        # 8-byte seal (wire_checksum), and receives the other p - 1 ranks' payloads of that size.
        last = stats["last_step"]
        assert last["step"] == 5 and last["sparse_calls"] == last["fused_calls"] == len(layout) > 1
        assert last["bytes_sent"] == sum(8 * math.ceil(0.01 * n) + TRAILER_BYTES for n in layout)
        assert last["bytes_received"] == (world_size - 1) * last["bytes_sent"]
        assert last["bytes_dense"] == 4 * sum(layout) == 4 * 4 * (128 * 128 + 128)
        assert same
        assert f"this is rank {rank}" in refusal and f"rank(s) [{(rank + 1) % world_size}]" in refusal
