"""exchange="owner": every rank owns a range of the bucket's chunks; all-to-all, owner
reduce with second-level error feedback, all-gather of the owners' replies.

Oracles: the split layout against the whole-bucket chunked layout (same entries, same
encoding); the reduced bucket against a simulation of the owners built from every rank's
messages and the pure-torch reference encoder (with its own owner residuals, carried
from step to step); density 1 against ``allreduce_hook``, step by step (density_one);
bytes against sizes worked out from the layouts; both conservation levels by the hook's
audit (and a planted fault that only the owner level can see); checkpoints by training
on from a restored state.
"""
import os

import pytest
import torch
import torch.distributed as dist

import sparsecomm
from ddp_models import fit_sine, mlp, params, rank_data
from density_one import assert_density_one_is_allreduce, compare_with_allreduce
from rank_processes import run_on_ranks
from sparsecomm import ops
from sparsecomm.checkpoint import rebuild_buckets
from sparsecomm.compress.chunk_layout import ChunkLayout
from sparsecomm.compress.payload_seal import TRAILER_BYTES
from sparsecomm.compress.owner_layout import OwnerLayout
from sparsecomm.hooks.wires.base import fold_foreign

CHUNK = 128


# ----- the split (no processes) ------------------------------------------------------------


def test_exact_ranges_are_near_equal_single_chunks():
    layout = OwnerLayout(1003, 0, 0.05, "rice", "int4", 4)
    assert layout.ranges == ((0, 251), (251, 251), (502, 251), (753, 250))
    assert all(part.chunk_size == part.numel == length for part, (_, length) in zip(layout.parts, layout.ranges))
    assert [part.capacity for part in layout.parts] == [13, 13, 13, 13]  # ceil(0.05 x 251), ceil(0.05 x 250)


@pytest.mark.parametrize("numel,world_size", [(1000, 3), (1024, 8), (300, 8), (129, 2), (5000, 4)])
def test_ranges_are_balanced_chunk_aligned_and_cover_the_bucket(numel, world_size):
    layout = OwnerLayout(numel, CHUNK, 0.05, "chunk", "int4", world_size)
    chunks = -(-numel // CHUNK)
    position = 0
    owned_chunks = []
    for start, length in layout.ranges:
        assert start == position and start % CHUNK == 0 or length == 0
        position += length
        owned_chunks.append(-(-length // CHUNK))
    assert position == numel
    assert sum(owned_chunks) == chunks and max(owned_chunks) - min(owned_chunks) <= 1
    assert [p is None for p in layout.parts] == [length == 0 for _, length in layout.ranges]


@pytest.mark.parametrize("index_codec,value_codec", [("rice", "int2"), ("chunk", "fp8"), ("int32", "fp32")])
def test_splitting_changes_the_messages_not_the_selection(index_codec, value_codec):
    generator = torch.Generator().manual_seed(3)
    acc = torch.randn(1000, generator=generator)
    whole = ChunkLayout(1000, CHUNK, 0.05, index_codec, value_codec)
    split = OwnerLayout(1000, CHUNK, 0.05, index_codec, value_codec, 3)
    whole_residual, split_residual = torch.empty(1000), torch.empty(1000)
    whole_indices, whole_values = whole.encode(acc, whole_residual, torch.empty(whole.nbytes, dtype=torch.uint8))
    send = torch.empty(split.nbytes, dtype=torch.uint8)
    split_indices, split_values = split.encode(acc, split_residual, send)
    assert torch.equal(split_indices, whole_indices) and torch.equal(split_values, whole_values)
    assert torch.equal(split_residual, whole_residual)
    decoded_indices, decoded_values = split.decode(send)
    assert torch.equal(decoded_indices, whole_indices) and torch.equal(decoded_values, whole_values)
    assert split.capacity == whole.capacity
    # Each message is a payload of its own: the kernel dispatch decodes it like any other.
    for owner, part in enumerate(split.parts):
        start, length = split.ranges[owner]
        out = torch.zeros(length)
        ops.dispatch.chunk_decode_add(split.part_of(send, owner), part, out)
        expected = torch.zeros(1000).index_put_((whole_indices,), whole_values.float())[start : start + length]
        assert torch.equal(out, expected)


def test_value_byte_offset_points_into_the_owners_message():
    split = OwnerLayout(1000, CHUNK, 0.05, "chunk", "int8", 3)
    position = split.parts[0].capacity + 2  # the third entry of owner 1's message
    assert split.value_byte_offset(position) == split.part_offsets[1] + split.parts[1].value_byte_offset(2)
    with pytest.raises(IndexError):
        split.value_byte_offset(split.capacity)


def test_fold_moves_what_a_rank_no_longer_owns_into_its_worker_residual():
    memory = torch.arange(10, dtype=torch.float32)
    residual = torch.ones(10)
    fold_foreign(memory, residual, (4, 3))
    assert memory.tolist() == [0, 0, 0, 0, 4, 5, 6, 0, 0, 0]
    assert residual.tolist() == [1, 2, 3, 4, 1, 1, 1, 8, 9, 10]


# ----- refusals (construction: before any collective) ------------------------------------


@pytest.mark.parametrize("settings,message", [
    ({"exchange": "ring"}, "exchange"),
    ({"exchange": "owner", "selector": "sampled"}, "selector 'exact'"),
    ({"exchange": "owner", "selector": "random"}, "selector 'exact'"),
])
def test_bad_combinations_are_refused_by_name(settings, message):
    with pytest.raises(ValueError, match=message):
        sparsecomm.TopKState(**settings)


# ----- under DDP --------------------------------------------------------------------------


def _train_and_observe(rank, world_size, index_codec, value_codec, selector="chunk", steps=7):
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(mlp(width=48, depth=3), bucket_cap_mb=0.005)
    chunking = {"chunk_size": CHUNK} if selector == "chunk" else {}
    state = sparsecomm.register_topk_hook(ddp, density=0.05, selector=selector, index_codec=index_codec,
                                          value_codec=value_codec, exchange="owner", verify_conservation=True,
                                          budget="bucket", **chunking)  # the layout's k, worked by hand
    seen = []

    def observe(event):
        if not event.dense and event.stage in ("packed", "reduced"):
            tensor = event.tensors["payload" if event.stage == "packed" else "reduced"].clone()
            seen.append((event.stage, event.step, event.bucket_index, event.layout, tensor))

    state.add_observer(observe)
    digests = fit_sine(ddp, rank, steps, 48)
    everyone = [None] * world_size
    dist.all_gather_object(everyone, seen)
    return everyone, digests, state.stats()


def _simulated_owners(everyone, world_size):
    """The reduced buckets an owner following the reference would deliver: per step and
    bucket, sum every rank's message for the range (rank order, onto zeros), add the owner
    residual the simulation carries, and encode with the reference ChunkLayout."""
    messages, owner_residuals, expected = {}, {}, {}
    for rank, seen in enumerate(everyone):
        for stage, step, bucket, layout, tensor in seen:
            if stage == "packed":
                messages.setdefault((step, bucket), {})[rank] = (layout, tensor)
    for step, bucket in sorted(messages):
        rows = messages[(step, bucket)]
        layout = rows[0][0]
        assert all(row[0] == layout for row in rows.values()) and len(rows) == world_size
        reduced = torch.zeros(layout.numel)
        for owner, part in enumerate(layout.parts):
            if part is None:
                continue
            start, length = layout.ranges[owner]
            total = torch.zeros(length)
            for r in range(world_size):
                indices, values = part.decode(layout.part_of(rows[r][1], owner))
                total.index_add_(0, indices, values.float())
            memory = owner_residuals.setdefault((bucket, owner), torch.zeros(length))
            acc = total + memory
            indices, values = part.encode(acc, memory, torch.empty(part.nbytes, dtype=torch.uint8))
            reduced[start : start + length].index_put_((indices,), values.float())
        expected[(step, bucket)] = reduced
    return expected


@pytest.mark.parametrize("world_size,index_codec,value_codec,selector", [
    (2, "rice", "int2", "chunk"), (3, "chunk", "int4", "chunk"), (4, "int32", "fp32", "chunk"),
    (8, "rice", "sign", "chunk"), (3, "rice", "int4", "exact"), (2, "int32", None, "exact"),
])
def test_reduced_buckets_are_what_reference_owners_deliver(world_size, index_codec, value_codec, selector):
    results = run_on_ranks(_train_and_observe, index_codec, value_codec, selector, world_size=world_size,
                           timeout=240)
    everyone, _, stats = results[0]
    expected = _simulated_owners(everyone, world_size)
    checked = 0
    for rank, seen in enumerate(everyone):
        for stage, step, bucket, _, reduced in seen:
            if stage == "reduced":
                assert torch.equal(reduced, expected[(step, bucket)]), (rank, step, bucket)
                checked += 1
    assert checked == world_size * len(expected) and len(expected) >= 5 * 2
    # Every rank trained on its own data, and the replicas never drifted apart.
    first = [message for stage, _, _, _, message in everyone[0] if stage == "packed"]
    second = [message for stage, _, _, _, message in everyone[1] if stage == "packed"]
    assert any(not torch.equal(a, b) for a, b in zip(first, second))
    for step_digests in zip(*(r[1] for r in results)):
        assert all(torch.equal(step_digests[0], d) for d in step_digests[1:])
    assert stats["owner_calls"] == stats["sparse_calls"] > 0


def _bytes_per_step(rank, world_size, exchange):
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(256, 256, bias=False), bucket_cap_mb=25)
    state = sparsecomm.register_topk_hook(ddp, density=0.01, selector="chunk", chunk_size=CHUNK,
                                          index_codec="chunk", value_codec="int4", exchange=exchange,
                                          warmup_steps=2, budget="bucket")  # the layout's bytes, worked by hand
    for x in rank_data(rank, 3, (4, 256)):
        ddp(x).square().sum().backward()
    last = state.stats()["last_step"]
    return last["bytes_sent"], last["bytes_received"]


def test_bytes_are_the_layout_sizes_and_do_not_grow_with_ranks():
    world_size, numel = 8, 256 * 256
    owner = run_on_ranks(_bytes_per_step, "owner", world_size=world_size, timeout=240)
    gather = run_on_ranks(_bytes_per_step, "allgather", world_size=world_size, timeout=240)
    layout = OwnerLayout(numel, CHUNK, 0.01, "chunk", "int4", world_size)
    whole = ChunkLayout(numel, CHUNK, 0.01, "chunk", "int4").nbytes + TRAILER_BYTES  # every payload sealed
    for rank, (sent, received) in enumerate(owner):
        # p - 1 messages out and in, one reply out and p - 1 in, each with its 8-byte seal.
        mine, slot = layout.part_nbytes[rank] + TRAILER_BYTES, layout.slot_nbytes + TRAILER_BYTES
        assert sent == layout.nbytes + (world_size - 1) * TRAILER_BYTES - layout.part_nbytes[rank] + slot
        assert received == (world_size - 1) * (mine + slot)
    assert all(row == ((whole, (world_size - 1) * whole)) for row in gather)
    # 512 chunks over 8 owners: each receives 2 x 7/8 of a selection, the all-gather 7 (0.25x).
    assert max(received for _, received in owner) <= 0.26 * gather[0][1]


DENSITY_ONE = {"density": 1.0, "selector": "chunk", "chunk_size": CHUNK, "value_codec": "fp32",
               "exchange": "owner", "allow_dense_fallback": False}


@pytest.mark.parametrize("world_size", [2, 3])
def test_density_one_is_allreduce_step_by_step(world_size):
    # Each step on the same weights: the owners' rank-order sum, and allreduce_hook's within
    # the rounding of its own order of additions (density_one).
    results = run_on_ranks(compare_with_allreduce, DENSITY_ONE, world_size=world_size, timeout=120)
    assert_density_one_is_allreduce(results, world_size)


def _faulty_owner_encode(rank, world_size):
    """A chunk encoder that loses a bit of the owner residual (only in the owner's call:
    divisor 1 with a residual to add) must be caught by the owner-level audit."""
    reference = ops.reference.chunk_encode

    def faulty(grad, residual, divisor, add_residual, layout, payload):
        out = reference(grad, residual, divisor, add_residual, layout, payload)
        if add_residual and divisor == 1.0 and residual.numel():
            residual[0] += 1.0
        return out

    ops.dispatch.register_kernel("chunk_encode", "cpu", faulty)
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(mlp(width=16, depth=2), bucket_cap_mb=25)
    sparsecomm.register_topk_hook(ddp, density=0.1, selector="chunk", chunk_size=CHUNK, exchange="owner",
                                  value_codec="int8", verify_conservation=True)
    try:
        for x in rank_data(rank, 4, (8, 16)):
            ddp(x).square().sum().backward()
    except sparsecomm.ConservationError as error:
        return str(error)
    return ""


def test_owner_level_audit_catches_a_lost_owner_residual():
    messages = run_on_ranks(_faulty_owner_encode, world_size=2)
    assert any("owner level" in message for message in messages), messages


def _checkpointed(rank, world_size, path, resume):
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(mlp(width=32, depth=2), bucket_cap_mb=0.002)
    state = sparsecomm.register_topk_hook(ddp, density=0.05, selector="chunk", chunk_size=CHUNK,
                                          index_codec="rice", value_codec="int4", exchange="owner")
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    batches = list(rank_data(rank, 9, (8, 32)))
    start = 0
    if resume:
        saved = torch.load(os.path.join(path, f"rank{rank}.pt"), weights_only=False)
        ddp.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        state.load_state_dict(saved["hook"])
        # A new DDP model starts from its first-iteration buckets: learn the rebuilt ones
        # first, so the chunks and the owners' ranges are those the state was saved with.
        rebuild_buckets(ddp, state, lambda: ddp(batches[0]).sum().backward())
        start = 5
    owned = None
    for step in range(start, len(batches)):
        x = batches[step]
        loss = torch.nn.functional.mse_loss(ddp(x), x[:, :4].sin())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == 4 and not resume:
            hook = state.state_dict()
            owned = {k: v for k, v in hook.items() if ".owner_residual." in k}
            torch.save({"model": ddp.module.state_dict(), "optimizer": optimizer.state_dict(), "hook": hook},
                       os.path.join(path, f"rank{rank}.pt"))
    return torch.cat([p.detach().flatten() for p in params(ddp)]), owned


def test_training_on_from_a_checkpoint_restores_owner_residuals_bit_for_bit(tmp_path):
    straight = run_on_ranks(_checkpointed, str(tmp_path), False, world_size=3, timeout=180)
    resumed = run_on_ranks(_checkpointed, str(tmp_path), True, world_size=3, timeout=180)
    for (final, owned), (again, _) in zip(straight, resumed):
        assert torch.equal(final, again)
        assert owned and any(bool(t.ne(0).any()) for t in owned.values())
    # Each rank's owner residual is non-zero only on what it owns: the ranks' sets are disjoint.
    supports = [torch.cat([t.ne(0) for _, t in sorted(owned.items())]) for _, owned in straight]
    assert not bool((supports[0] & supports[1]).any()) and not bool((supports[1] & supports[2]).any())


def _load_into(rank, world_size, state_dict, exchange):
    state = sparsecomm.TopKState(density=0.05, selector="chunk", exchange=exchange)
    state.load_state_dict(state_dict)


def test_owner_residuals_are_refused_by_a_state_without_owners():
    owner_config = sparsecomm.TopKState(density=0.05, selector="chunk", exchange="owner").config.checkpoint_dict()
    plain_config = sparsecomm.TopKState(density=0.05, selector="chunk").config.checkpoint_dict()
    assert owner_config["exchange"] == "owner" and "exchange" not in plain_config
    saved = {"format": 1, "world_size": 1, "step": 3, "config": plain_config,
             "rank0.residual.w": torch.zeros(4), "rank0.owner_residual.w": torch.zeros(4)}
    with pytest.raises(AssertionError, match="owner residuals but this TopKState does not use exchange='owner'"):
        run_on_ranks(_load_into, saved, "allgather", world_size=1)
    # The same dict with the owner config loads into an owner state.
    run_on_ranks(_load_into, dict(saved, config=owner_config), "owner", world_size=1)
