"""exchange="shared-mask": a mask every rank derives alike from the synced gradient, one step
ahead; the values there allreduced, no index bytes.

Oracles: the mask every rank used against one worked out here from the reduced buckets the
ranks received (per parameter name: the rate and age memories folded in plain torch, the
priority |rate| x (age + 1), the window by modular arithmetic, the rest by ``torch.topk``:
random gradients, no ties); the reduced bucket against the exact sum of every rank's acc at
the mask (no oracle rounding; within what the allreduce's own additions may round); the
staleness bound on an adversarial priority that never moves; bytes against sizes worked out
by hand at 2 and 4 ranks; conservation by the hook's audit (``verify_conservation``); a
resumed run against the uninterrupted one, bit for bit; density 1 against ``allreduce_hook``.
"""
import math

import pytest
import torch
import torch.distributed as dist

import sparsecomm
from ddp_models import final_parameters, first_sparse_step_bytes, fit_sine, mlp, rank_data
from exact_sums import sum_rounding_misses
from multiprocess import run_on_ranks
from sparsecomm.checkpoint.bucket_rebuild import rebuild_buckets
from sparsecomm.hooks.wires.shared_mask import longest_wait, shared_mask

DENSITY, REFRESH = 0.03, 0.25


def _train_and_observe(rank, world_size, steps=7):
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(mlp(width=40, depth=3), bucket_cap_mb=0.004)
    state = sparsecomm.register_topk_hook(ddp, density=DENSITY, exchange="shared-mask", mask_refresh=REFRESH,
                                          verify_conservation=True)
    seen = []

    def observe(event):
        if event.stage == "packed" and not event.dense:
            seen.append(("packed", event.step, event.bucket_index, event.names, event.numels,
                         event.tensors["acc"].clone(), event.tensors["indices"].clone()))
        elif event.stage == "reduced":
            seen.append(("reduced", event.step, event.bucket_index, event.names, event.numels,
                         event.tensors["reduced"].clone(), None))

    state.add_observer(observe)
    digests = fit_sine(ddp, rank, steps, 40)
    everyone = [None] * world_size
    dist.all_gather_object(everyone, seen)
    return everyone, digests, state.stats()


def _oracle_mask(rate: torch.Tensor, age: torch.Tensor, step: int, k: int) -> torch.Tensor:
    n = rate.numel()
    r = min(k, max(1, math.ceil(REFRESH * k)))
    window = {(step * r + j) % n for j in range(r)}
    priority = rate.abs() * (age + 1)
    priority[sorted(window)] = -1.0
    rest = torch.topk(priority, k - r).indices.tolist()
    return torch.tensor(sorted(window | set(rest)))


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_rank_sends_the_mask_derived_from_the_synced_gradient(world_size):
    results = run_on_ranks(_train_and_observe, world_size=world_size, timeout=180)
    everyone, _, stats = results[0]
    # The oracle's memories per parameter name, from rank 0's reduced buckets (every rank
    # receives the same bits: checked below), folded in step order as the hook folds them.
    rate, age, checked = {}, {}, 0
    sent_at = {}  # (step, bucket) -> the mask
    events = sorted(everyone[0], key=lambda e: (e[1], e[0] != "packed", e[2]))  # per step: packed, then reduced
    for stage, step, bucket, names, numels, tensor, indices in events:
        zeros = [torch.zeros(m) for m in numels]
        flat_rate = torch.cat([rate.get(n, z) for n, z in zip(names, zeros)])
        flat_age = torch.cat([age.get(n, z) for n, z in zip(names, zeros)])
        if stage == "packed":
            k = indices.numel()
            assert k == math.ceil(round(DENSITY * flat_rate.numel(), 6))
            expected = _oracle_mask(flat_rate, flat_age, step, k)
            sent = []
            for rank in range(world_size):
                row = next(e for e in everyone[rank] if e[:3] == ("packed", step, bucket))
                assert torch.equal(row[6], expected), (step, bucket, rank)  # every rank: the same mask
                sent.append(row[5][expected])
            reduced = next(e for e in everyone[0] if e[:3] == ("reduced", step, bucket))[5]
            outside = torch.ones_like(reduced, dtype=torch.bool)
            outside[expected] = False
            assert not bool(reduced[outside].any())
            # gloo's ring adds the p values in an order of its own, each addition rounded to
            # nearest in float32: within gamma_{p-1} of the exact sum (exact_sums).
            assert sum_rounding_misses(reduced[expected], sent, torch.float32) == [], (step, bucket)
            sent_at[step, bucket] = expected
            checked += 1
            continue
        for rank in range(1, world_size):
            other = next(e for e in everyone[rank] if e[:3] == ("reduced", step, bucket))
            assert torch.equal(other[5], tensor), (step, bucket, rank)
        mask = sent_at.get((step, bucket))
        if mask is None:  # a dense step: everything sent
            flat_rate = flat_rate * 0.9 + tensor * 0.1
            flat_age.zero_()
        else:
            flat_rate[mask] = flat_rate[mask] * 0.9 + tensor[mask] / (flat_age[mask] + 1) * 0.1
            flat_age += 1
            flat_age[mask] = 0
        for name, part_rate, part_age in zip(names, flat_rate.split(list(numels)), flat_age.split(list(numels))):
            rate[name], age[name] = part_rate, part_age
    assert checked >= 8
    assert stats["shared_mask_calls"] == stats["sparse_calls"] > 0 and stats["warmup_calls"] > 0
    for step_digests in zip(*(r[1] for r in results)):
        assert all(torch.equal(step_digests[0], d) for d in step_digests[1:])


def test_no_entry_waits_longer_than_the_window_allows():
    """The adversary: priorities that never change, so the top entries win every step. Every
    entry must still be in the mask at least once in every longest_wait + 1 steps."""
    for numel, k, refresh in ((1000, 30, 0.25), (997, 7, 0.1), (64, 64, 0.5), (5000, 1, 0.25)):
        score = torch.linspace(1.0, 2.0, numel)
        wait = longest_wait(numel, k, refresh)
        last_sent = torch.full((numel,), -1)
        for step in range(3 * (wait + 1)):
            mask = shared_mask(score, step, k, refresh)
            assert mask.numel() == k and torch.equal(mask, torch.sort(torch.unique(mask)).values)
            assert int((step - last_sent).max()) <= wait + 1, (numel, k, refresh, step)
            last_sent[mask] = step
        # The bound is tight for the window alone: ceil(numel / r) steps tile the bucket.
        r = min(k, max(1, math.ceil(refresh * k)))
        assert wait == math.ceil(numel / r) - 1


@pytest.mark.parametrize("world_size", [2, 4])
def test_bytes_are_a_ring_of_values_and_no_index(world_size):
    k = 100  # 1% of 10000, fp32 values, nothing else (no index, no checksum: a sum is no one's payload)
    ring = round(2 * (world_size - 1) * 4 * k / world_size)
    rows = run_on_ranks(first_sparse_step_bytes, {"density": 0.01, "exchange": "shared-mask"}, world_size=world_size)
    assert rows == [(4 * k, ring)] * world_size


def _resumed(rank, world_size, split):
    """6 steps of AdamW under the hook; with ``split``, a fresh model, optimizer and state
    loaded from a checkpoint taken after ``split`` steps run the rest. The fresh DDP model
    rebuilds its buckets first (``rebuild_buckets``, as the checkpoint manager does): a mask
    over a bucket depends on where each parameter lies in it, as bucket-scope top-k does."""

    def build():
        torch.manual_seed(0)
        ddp = torch.nn.parallel.DistributedDataParallel(mlp(width=24, depth=2), bucket_cap_mb=0.002)
        state = sparsecomm.register_topk_hook(ddp, density=DENSITY, exchange="shared-mask")
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=0.01), state

    def loss(ddp, x):
        return torch.nn.functional.mse_loss(ddp(x), torch.sin(x[:, :4]))

    ddp, optimizer, state = build()
    batches = rank_data(rank, 6, (8, 24))
    for step, x in enumerate(batches):
        if step == split:
            saved = (ddp.module.state_dict(), optimizer.state_dict(), state.state_dict())
            ddp, optimizer, state = build()
            ddp.module.load_state_dict(saved[0])
            optimizer.load_state_dict(saved[1])
            state.load_state_dict(saved[2])
            rebuild_buckets(ddp, state, lambda: (loss(ddp, x) * 0).backward())
        optimizer.zero_grad()
        loss(ddp, x).backward()
        optimizer.step()
    saved = state.state_dict()
    every_parameter = all(sorted(k.split(f".{kind}.")[1] for k in saved if f".{kind}." in k) == sorted(state.names.shapes)
                          for kind in ("mask_rate", "mask_age"))
    return torch.cat([p.detach().flatten() for p in ddp.parameters()]), every_parameter


def test_a_resumed_run_trains_as_the_uninterrupted_one():
    straight = run_on_ranks(_resumed, None, world_size=2)
    resumed = run_on_ranks(_resumed, 4, world_size=2)
    for (a, every_parameter_scored), (b, _) in zip(straight, resumed):
        assert torch.equal(a, b)
        assert every_parameter_scored  # the checkpoint holds a rate and an age for every parameter


def test_density_one_is_allreduce_bit_for_bit_at_two_ranks():
    settings = {"density": 1.0, "exchange": "shared-mask", "allow_dense_fallback": False}
    shared = run_on_ranks(final_parameters, settings, world_size=2)
    dense = run_on_ranks(final_parameters, None, world_size=2)
    assert torch.equal(shared[0], dense[0]) and torch.equal(shared[0], shared[1])


@pytest.mark.parametrize("settings,message", [
    ({"exchange": "shared-mask", "selector": "chunk"}, "selector='exact'"),
    ({"exchange": "shared-mask", "value_codec": "int4"}, "float wire"),
    ({"exchange": "shared-mask", "k_scope": "parameter"}, "k_scope='bucket'"),
    ({"mask_refresh": 0.5}, "mask_refresh=0.5 is a setting of exchange='shared-mask'"),
    ({"exchange": "shared-mask", "mask_refresh": 0.0}, "mask_refresh"),
    ({"exchange": "shared-mask", "mask_refresh": 1.5}, "mask_refresh"),
])
def test_bad_combinations_are_refused_by_name(settings, message):
    with pytest.raises(ValueError, match=message):
        sparsecomm.TopKState(**settings)
