"""exchange="shared-index": a rotating leader's selection, broadcast; values allreduced.

Oracles: the index set every rank used against ``torch.topk`` of the leader's own acc (the
leader being rank (step + bucket) mod p); the reduced bucket against the exact sum of
every rank's acc at those indices (no oracle rounding; within what the allreduce's own
additions may round); density 1 against ``allreduce_hook``; bytes against sizes worked
out by hand; conservation by the hook's audit (``verify_conservation``).
"""
import pytest
import torch
import torch.distributed as dist

import sparsecomm
from ddp_models import final_parameters, first_sparse_step_bytes, fit_sine, mlp
from exact_sums import sum_rounding_misses
from rank_processes import run_on_ranks
from sparsecomm.compress.payload_seal import TRAILER_BYTES


def _train_and_observe(rank, world_size, selector, index_codec, value_dtype, steps=6):
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(mlp(width=40, depth=3), bucket_cap_mb=0.004)
    chunking = {"chunk_size": 128} if selector == "chunk" else {}
    state = sparsecomm.register_topk_hook(ddp, density=0.03, selector=selector, index_codec=index_codec,
                                          value_dtype=value_dtype, exchange="shared-index",
                                          verify_conservation=True, budget="bucket", **chunking)  # k worked by hand
    seen = []

    def observe(event):
        if not event.dense and event.stage == "packed":
            seen.append(("packed", event.step, event.bucket_index, event.tensors["acc"].clone(),
                         event.tensors["indices"].clone()))
        elif not event.dense and event.stage == "reduced":
            seen.append(("reduced", event.step, event.bucket_index, event.tensors["reduced"].clone(), None))

    state.add_observer(observe)
    digests = fit_sine(ddp, rank, steps, 40)
    everyone = [None] * world_size
    dist.all_gather_object(everyone, seen)
    return everyone, digests, state.stats()


def _leaders_top(acc: torch.Tensor, selector: str, density: float, chunk: int = 128) -> torch.Tensor:
    """The leader's selection, from torch.topk (random gradients: no ties)."""
    if selector == "exact":
        k = -(-int(density * acc.numel() * 1e9) // int(1e9))  # ceil without float surprises
        return torch.sort(torch.topk(acc.abs(), k).indices).values
    parts = []
    for start in range(0, acc.numel(), chunk):
        piece = acc[start : start + chunk].abs()
        k = -(-int(density * piece.numel() * 1e9) // int(1e9))
        parts.append(torch.sort(torch.topk(piece, k).indices).values + start)
    return torch.cat(parts)


@pytest.mark.parametrize("world_size,selector,index_codec,value_dtype", [
    (2, "exact", "int32", None), (3, "chunk", "rice", None), (4, "chunk", "chunk", torch.bfloat16),
])
def test_every_rank_sends_the_leaders_selection_and_receives_the_sum(world_size, selector, index_codec,
                                                                     value_dtype):
    results = run_on_ranks(_train_and_observe, selector, index_codec, value_dtype, world_size=world_size,
                           timeout=180)
    everyone, _, stats = results[0]
    packed = {}
    for rank, seen in enumerate(everyone):
        for stage, step, bucket, acc, indices in seen:
            if stage == "packed":
                packed.setdefault((step, bucket), {})[rank] = (acc, indices)
    checked = 0
    wire = value_dtype or torch.float32
    for (step, bucket), rows in packed.items():
        leader = (step + bucket) % world_size
        expected_indices = _leaders_top(rows[leader][0], selector, 0.03)
        for rank in range(world_size):
            assert torch.equal(rows[rank][1], expected_indices), (step, bucket, rank)
        sent = [rows[rank][0][expected_indices].to(wire) for rank in range(world_size)]
        outside = torch.ones(rows[0][0].numel(), dtype=torch.bool)
        outside[expected_indices] = False
        for rank, seen in enumerate(everyone):
            reduced = next(t for s, st, b, t, _ in seen if (s, st, b) == ("reduced", step, bucket))
            assert not bool(reduced[outside].any()), (step, bucket, rank)
            if world_size == 2 and value_dtype is None:
                # One addition, rounded to nearest and commutative: gloo's order cannot matter.
                assert torch.equal(reduced[expected_indices], sent[0] + sent[1]), (step, bucket, rank)
            else:
                # gloo's ring adds the p values in an order of its own, each addition rounded
                # to nearest in the wire dtype (bf16: a float32 sum rounded to bf16, the
                # correctly rounded bf16 sum, since float32's 24 bits >= 2 x 8 + 2 make the
                # double rounding innocuous, Figueroa 1995): within gamma_{p-1}(wire) of the
                # exact sum, which is computed without rounding (exact_sums).
                misses = sum_rounding_misses(reduced[expected_indices], sent, wire)
                assert misses == [], (step, bucket, rank, misses[:5])
            checked += 1
    assert checked >= world_size * 8
    leaders = {(step + bucket) % world_size for step, bucket in packed}
    assert leaders == set(range(world_size))  # the leader rotates
    for step_digests in zip(*(r[1] for r in results)):
        assert all(torch.equal(step_digests[0], d) for d in step_digests[1:])
    assert stats["shared_index_calls"] == stats["sparse_calls"] > 0


DENSITY_ONE = {"density": 1.0, "exchange": "shared-index", "allow_dense_fallback": False}


def test_density_one_is_allreduce_bit_for_bit_at_two_ranks():
    shared = run_on_ranks(final_parameters, DENSITY_ONE, world_size=2)
    dense = run_on_ranks(final_parameters, None, world_size=2)
    assert torch.equal(shared[0], dense[0]) and torch.equal(shared[0], shared[1])


def test_bytes_are_one_index_set_and_a_ring_of_values():
    world_size, k = 3, 100  # 1% of 10000
    # budget="bucket": the bytes of the exchange alone (the model budget adds its counts' all-reduce)
    rows = run_on_ranks(first_sparse_step_bytes, {"density": 0.01, "exchange": "shared-index", "budget": "bucket"},
                        world_size=world_size)
    leader = (2 + 0) % world_size  # step 2 (the first after warm-up), bucket 0
    # The index set is sealed (8 bytes); the values allreduce sums one more element, every
    # rank's verdict on its copy of the index set (wire_checksum, docs/wire.md).
    values, index_set = 4 * (k + 1), 4 * k + TRAILER_BYTES
    ring = round(2 * (world_size - 1) * values / world_size)
    for rank, (sent, received) in enumerate(rows):
        assert sent == values + (index_set if rank == leader else 0)
        assert received == ring + (0 if rank == leader else index_set)


@pytest.mark.parametrize("settings,message", [
    ({"value_codec": "int4", "selector": "chunk"}, "float"),
    ({"selector": "sampled"}, "selector 'exact' or 'chunk'"),
    ({"k_scope": "parameter"}, "k_scope='bucket'"),
])
def test_bad_combinations_are_refused_by_name(settings, message):
    with pytest.raises(ValueError, match=message):
        sparsecomm.TopKState(exchange="shared-index", **settings)
