"""Density 1 against torch's allreduce_hook, step by step, at any number of ranks.

At density 1 every entry is sent, so the hook must deliver what allreduce_hook does: the
sum of every rank's gradient divided by p. The hook adds the p terms onto zeros in rank
order (its unpack, or the owners' reduce), so its grads must equal that float32 sum bit
for bit. gloo's ring adds the same terms in an order of its own: at 2 ranks one addition,
rounded to nearest and commutative, so the two agree bit for bit; from 3 ranks on
allreduce_hook's sum is held to the exact sum (exact_sums), within what its p - 1 float32
additions may round. No tolerance is needed for the hook itself.
"""
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm
from ddp_models import grads, mlp, rank_data
from exact_sums import sum_rounding_misses


def _gathered(tensor):
    everyone = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, tensor.contiguous())
    return everyone


def compare_with_allreduce(rank, world_size, hook_settings, steps=5):
    """The hook built from ``hook_settings`` (density 1) and allreduce_hook on the same weights
    and data: (steps after the warm-up where the hook's grads are not the rank-order sum;
    steps where they differ from allreduce_hook's; steps where allreduce_hook's miss the
    exact sum by more than its additions may round)."""
    reference, hooked, local = DDP(mlp()), DDP(mlp()), mlp()
    reference.register_comm_hook(None, allreduce_hook)
    state = sparsecomm.register_topk_hook(hooked, **hook_settings)
    not_rank_order, differs, misses = [], [], []
    for step, x in enumerate(rank_data(rank, steps, (8, 32))):
        for model in (reference, hooked, local):
            model.zero_grad()
            model(x).pow(2).mean().backward()
        for ours, theirs, own in zip(grads(hooked.module), grads(reference.module), grads(local)):
            terms = [g / world_size for g in _gathered(own)]  # every rank's, divided first as both hooks do
            expected = torch.zeros_like(own)
            for term in terms:  # rank order, onto zeros
                expected += term
            if step >= state.warmup_steps and not torch.equal(ours, expected):  # the warm-up is allreduced
                not_rank_order.append(step)
            if not torch.equal(ours, theirs):
                differs.append(step)
            if sum_rounding_misses(theirs, terms, torch.float32):
                misses.append(step)
        local.load_state_dict(hooked.module.state_dict())  # no optimizer: the weights stay equal anyway
    return not_rank_order, differs, misses


def assert_density_one_is_allreduce(results, world_size: int) -> None:
    """``results``: every rank's :func:`compare_with_allreduce`."""
    for rank, (not_rank_order, differs, misses) in enumerate(results):
        assert not_rank_order == [], rank
        if world_size == 2:
            assert differs == [], rank
        else:
            assert misses == [], rank
