"""Parameter digest and the cross-replica check (reliability.md E1).

Localises: a digest that misses some bit (e.g. hashing values instead of bits, or a
weight that is even and loses the top bits), a digest that depends on something other
than the bits (thread count, order of reduction), the wrong rank being blamed, and a
check that raises on one rank only (which would leave the other hanging).
"""
import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm
from rank_processes import run_on_ranks
from sparsecomm.monitor import BitFlipInjector, CorruptionDetected, ReplicaDigestMonitor, flip_bit, parameter_digest
from sparsecomm.monitor.consensus import suspects
from sparsecomm.monitor.replica_digest import tensors_digest


def _mlp(width=32, out=4):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, out))


# ----- the digest, one process ------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype,bits",
    [
        (torch.float32, [31, 30, 27, 23, 22, 10, 3, 0]),  # sign, exponent (top, mid, low), mantissa
        (torch.float16, list(range(16))),
        (torch.bfloat16, list(range(16))),
        (torch.float64, [63, 62, 52, 51, 0]),
    ],
)
def test_digest_changes_for_every_single_bit_flip(dtype, bits):
    model = _mlp().to(dtype)
    reference = parameter_digest(model)
    params = list(model.parameters())
    seen = {reference}
    for param in (params[0], params[-1]):
        for index in (0, param.numel() // 2, param.numel() - 1):
            for bit in bits:
                with torch.no_grad():
                    flip_bit(param, index, bit)
                digest = parameter_digest(model)
                assert digest != reference, (dtype, index, bit)
                seen.add(digest)
                with torch.no_grad():
                    flip_bit(param, index, bit)
                assert parameter_digest(model) == reference
    # Different faults give different digests too (no collision among these).
    assert len(seen) == 1 + 2 * 3 * len(bits)


def test_digest_of_large_tensor_sees_flips_in_every_block_and_the_tail():
    # 2**22 entries per block and 2**16 per chunk: cover a second block and a partial chunk.
    tensor = torch.randn(2**22 + 2**16 + 5, generator=torch.Generator().manual_seed(0))
    reference = int(tensors_digest([tensor]))
    for index in (0, 2**16 - 1, 2**22, tensor.numel() - 1):
        for bit in (31, 23, 0):
            flip_bit(tensor, index, bit)
            assert int(tensors_digest([tensor])) != reference, (index, bit)
            flip_bit(tensor, index, bit)
    assert int(tensors_digest([tensor])) == reference


def test_digest_is_exact_order_dependent_and_bitwise():
    model = _mlp()
    twin = copy.deepcopy(model)
    assert parameter_digest(model) == parameter_digest(twin)
    # Swapping two entries, or two equal-shaped tensors, keeps the multiset of bits: still detected.
    with torch.no_grad():
        w = twin[0].weight.view(-1)
        w[0], w[1] = w[1].clone(), w[0].clone()
    assert parameter_digest(model) != parameter_digest(twin)
    a, b = torch.randn(5), torch.randn(5)
    assert int(tensors_digest([a, b])) != int(tensors_digest([b, a]))
    # -0.0 == 0.0 as values but not as bits.
    assert int(tensors_digest([torch.tensor([0.0])])) != int(tensors_digest([torch.tensor([-0.0])]))
    # Independent of thread count (integer sums are associative).
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = parameter_digest(model)
    finally:
        torch.set_num_threads(threads)
    assert single == parameter_digest(model)
    # None (a parameter without .grad) is distinct from a zero tensor.
    assert int(tensors_digest([None])) != int(tensors_digest([torch.zeros(1)]))


def _reference_digest(tensors) -> int:
    """The digest as its docstring defines it, computed with numpy's wrapping uint64 arithmetic:
    every tensor's words (4-byte and wider elements as int32 words, 2-byte as int16, 1-byte and
    bool as uint8) sign- or zero-extended into one stream; word j weighs W_(j mod 65536) *
    C_(j div 65536); plus (its number of words + 2) (or -1 + 2 for None) times T_p for tensor p."""
    mask = (1 << 64) - 1
    entry, chunk, tensor = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
    streams, sizes = [], []
    for t in tensors:
        if t is None:
            sizes.append(-1)
            continue
        flat = t.detach().reshape(-1)
        if flat.dtype == torch.bool:
            flat = flat.to(torch.uint8)
        word = {8: torch.int32, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[flat.element_size()]
        streams.append(flat.view(word).numpy().astype(np.int64).astype(np.uint64))  # extends by sign (uint8: zero)
        sizes.append(streams[-1].size)
    words = np.concatenate(streams) if streams else np.zeros(0, dtype=np.uint64)
    j = np.arange(words.size, dtype=np.uint64)
    with np.errstate(over="ignore"):
        w = ((j % np.uint64(65536) + np.uint64(1)) * np.uint64(entry)) | np.uint64(1)
        c = ((j // np.uint64(65536) + np.uint64(1)) * np.uint64(chunk)) | np.uint64(1)
        total = int((words * w * c).sum(dtype=np.uint64))
    for p, size in enumerate(sizes):
        total += ((((p + 1) * tensor) & mask) | 1) * (size + 2)
    total &= mask
    return total - (1 << 64) if total >= 1 << 63 else total


def test_digest_equals_its_definition_for_every_dtype_across_blocks_and_chunk_tails():
    generator = torch.Generator().manual_seed(3)
    cases = [
        [torch.randn(70_000, generator=generator)],  # one chunk and a tail
        [torch.randn(33, generator=generator).to(torch.bfloat16), None, torch.tensor([True, False, True]),
         torch.randn(5, generator=generator, dtype=torch.float64), torch.randn(3, generator=generator).half(),
         torch.zeros(0), torch.randint(0, 256, (7,), generator=generator, dtype=torch.uint8)],
        [torch.randn(2**22 - 5, generator=generator), torch.randn(2**16 + 9, generator=generator).half()],  # 2 blocks
        [],
    ]
    for tensors in cases:
        assert int(tensors_digest(tensors)) == _reference_digest(tensors)


def test_suspect_rule():
    assert suspects([5, 5, 7], [False] * 3) == ((2,), "ranks that differ from the majority")
    assert suspects([5, 7, 7, 7], [False] * 4)[0] == (0,)
    assert suspects([5, 7], [False, False])[0] == (0, 1)  # two ranks: no majority, both named
    assert suspects([5, 7], [False, False], reference_rank=0)[0] == (1,)
    assert suspects([5, 5, 7, 7], [False] * 4)[0] == (0, 1, 2, 3)
    assert suspects([0, 9, 0], [False, False, True])[0] == (2,)  # a local failure outranks values


def test_corruption_detected_pickles_with_its_fields():
    import pickle

    error = pickle.loads(pickle.dumps(CorruptionDetected("replica_digest", 7, (1,), "x")))
    assert (error.check, error.step, error.ranks, error.detail) == ("replica_digest", 7, (1,), "x")
    assert isinstance(error, sparsecomm.SparsecommError) and isinstance(error, Exception)


# ----- E1: a bit flip in one replica's weights, 2 gloo ranks -------------------------------


def _e1_worker(rank, world_size):
    model = _mlp()
    ddp = DDP(model)
    sparsecomm.register_topk_hook(ddp, density=0.05)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    # Exponent flip after step 3's update, then (after a repair) a mantissa flip after step 11.
    exponent = BitFlipInjector("parameter", step=3, rank=1, bit=27, index=7, name="0.weight")
    mantissa = BitFlipInjector("parameter", step=11, rank=1, bit=3, index=2, name="2.bias")
    # every=5: the flips at steps 3 and 11 must be caught at the next checks, 5 and 15.
    any_rank = ReplicaDigestMonitor(ddp, every=5)
    rank0_reference = ReplicaDigestMonitor(ddp, every=5, reference_rank=0)
    generator = torch.Generator().manual_seed(1000 + rank)  # different data on every rank
    detections = []
    for step in range(17):
        x = torch.randn(8, 32, generator=generator)
        optimizer.zero_grad()
        ddp(x).pow(2).mean().backward()
        optimizer.step()
        exponent.maybe_inject_parameters(model, step, rank)
        mantissa.maybe_inject_parameters(model, step, rank)
        monitor = any_rank if step < 10 else rank0_reference
        try:
            monitor.check(step)
        except CorruptionDetected as error:
            detections.append((step, error.check, error.ranks, error.detail))
            # Repair for the next phase: every rank takes rank 0's weights (clean here).
            with torch.no_grad():
                for param in model.parameters():
                    torch.distributed.broadcast(param, src=0)
            monitor.check(step)  # now agrees
    return detections, exponent.injected + mantissa.injected, any_rank.last_verified_step, rank0_reference.last_verified_step


@pytest.mark.timeout(120)
def test_e1_parameter_bit_flip_on_rank1_is_detected_on_all_ranks():
    results = run_on_ranks(_e1_worker)
    (detections0, _, verified0, _), (detections1, injected, _, verified_ref) = results
    assert [i["step"] for i in injected] == [3, 11] and all(i["rank"] == 1 for i in injected)
    assert injected[0]["before"] != injected[0]["after"]
    # Both ranks raise the same error at the same check (nobody is left in a collective).
    assert detections0 == detections1
    (step_a, check_a, ranks_a, detail_a), (step_b, check_b, ranks_b, _) = detections0
    assert (step_a, check_a) == (5, "replica_digest")  # exponent flip after step 3
    assert ranks_a == (0, 1) and "no strict majority" in detail_a  # two ranks: both named
    assert (step_b, check_b) == (15, "replica_digest")  # mantissa flip after step 11
    assert ranks_b == (1,)  # with rank 0 as the reference, rank 1 is named
    assert verified0 == 5 and verified_ref == 15  # the checks after the repair agreed
