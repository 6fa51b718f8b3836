"""selector="chunk" in the hook: chunked top-k with the compact index and value codecs.

Every rank trains on its own data. What is checked against what: the reduced bucket
against the sum, in rank order, of every rank's payload decoded on its own (so exchange
and accumulation are tested, rank mixing included); conservation by the hook's
independent audit (``verify_conservation``); bytes against the layout worked by hand in
test_wire_codecs; settings and checkpoints by their errors.
"""
import pytest
import torch
import torch.distributed as dist

import sparsecomm
from ddp_models import fit_doubling, mlp, rank_data
from rank_processes import run_on_ranks
from sparsecomm.compress.chunk_layout import ChunkLayout
from sparsecomm.compress.payload_seal import TRAILER_BYTES


def _train(rank, world_size, index_codec, value_codec, steps=6):
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(mlp(width=64, depth=3), bucket_cap_mb=0.01)
    state = sparsecomm.register_topk_hook(ddp, density=0.02, selector="chunk", chunk_size=512,
                                          index_codec=index_codec, value_codec=value_codec,
                                          verify_conservation=True, budget="bucket")  # the layout's k, worked by hand
    seen = []

    def observe(event):
        if not event.dense and event.stage == "packed":
            seen.append((event.step, event.bucket_index, event.layout, event.tensors["payload"].clone()))
        elif not event.dense and event.stage == "reduced":
            seen.append((event.step, event.bucket_index, None, event.tensors["reduced"].clone()))

    state.add_observer(observe)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for x in rank_data(rank, steps, (16, 64)):
        loss = torch.nn.functional.mse_loss(ddp(x), 2 * x[:, :4])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    gathered = [None] * world_size
    dist.all_gather_object(gathered, seen)
    saved = state.state_dict()
    refusal = ""
    try:
        sparsecomm.TopKState(density=0.02, selector="chunk", chunk_size=512, index_codec=index_codec,
                             value_codec="int8" if value_codec != "int8" else "int4").load_state_dict(saved)
    except ValueError as error:
        refusal = str(error)
    return gathered, state.stats(), saved["config"], refusal


@pytest.mark.parametrize("index_codec,value_codec", [("rice", "int2"), ("chunk", "int4"), ("int32", "sign"),
                                                     ("rice", "fp8")])
def test_reduced_bucket_is_the_rank_ordered_sum_of_decoded_payloads(index_codec, value_codec):
    results = run_on_ranks(_train, index_codec, value_codec, world_size=3, timeout=180)
    everyone, stats, config, refusal = results[0]
    assert (config["chunk_size"], config["index_codec"], config["value_codec"]) == (512, index_codec, value_codec)
    assert "value_codec" in refusal
    world_size = len(everyone)
    packed = {}
    for rank, seen in enumerate(everyone):
        for step, bucket, layout, tensor in seen:
            if layout is not None:
                packed.setdefault((step, bucket), {})[rank] = (layout, tensor)
    checked = 0
    for rank, seen in enumerate(everyone):
        for step, bucket, layout, reduced in seen:
            if layout is not None:
                continue
            payloads = packed[(step, bucket)]
            assert len({p[1].numel() for p in payloads.values()}) == 1  # one fixed size on every rank
            expected = torch.zeros(reduced.numel())
            for r in range(world_size):  # rank order, onto zeros
                row_layout, payload = payloads[r]
                indices, values = row_layout.decode(payload)
                expected.index_add_(0, indices, values.float())
            assert torch.equal(reduced, expected), (rank, step, bucket)
            checked += 1
    assert checked >= 3 * 4
    # Payloads differ between ranks (each rank has its own data).
    some = next(iter(packed.values()))
    assert not torch.equal(some[0][1], some[1][1])
    last = stats["last_step"]
    assert last["sparse_calls"] > 0 and last["fused_calls"] == 0
    assert last["bytes_received"] == (world_size - 1) * last["bytes_sent"]


def test_bytes_sent_follow_the_layout():
    results = run_on_ranks(_train, "rice", "int2", world_size=2, timeout=180)
    stats = results[0][1]
    last = stats["last_step"]
    # Small buckets (0.01 MB): every bucket's payload is the ChunkLayout of its size, to the byte,
    # and its 8-byte seal (wire_checksum).
    last_packed = [(layout, payload) for step, _, layout, payload in results[0][0][0]
                   if layout is not None and step == last["step"]]
    assert len(last_packed) == last["sparse_calls"] > 1
    assert last["bytes_sent"] == sum(ChunkLayout(layout.numel, 512, 0.02, "rice", "int2").nbytes + TRAILER_BYTES
                                     for layout, _ in last_packed)
    assert last["bytes_sent"] < last["bytes_dense"] / 20


@pytest.mark.parametrize("kwargs,named", [
    ({"selector": "sampled", "index_codec": "rice"}, "index_codec"),
    ({"selector": "random", "value_codec": "int2"}, "value_codec"),
    ({"index_codec": "rice", "k_scope": "parameter"}, "k_scope"),
    ({"selector": "chunk", "chunk_size": 1}, "chunk_size"),
    ({"selector": "chunk", "chunk_size": 70000}, "chunk_size"),
    ({"selector": "chunk", "k_scope": "parameter"}, "k_scope"),
    ({"selector": "chunk", "value_codec": "int4", "value_dtype": torch.float16}, "value_dtype"),
    ({"value_codec": "bf16", "value_dtype": torch.float16}, "value_codec"),
    ({"selector": "chunk", "value_codec": "int3"}, "value_codec"),
    ({"selector": "chunk", "index_codec": "gzip"}, "index_codec"),
    ({"chunk_size": 1024}, "chunk_size"),
])
def test_settings_are_refused_with_the_argument_named(kwargs, named):
    with pytest.raises((ValueError, TypeError), match=named):
        sparsecomm.TopKState(**kwargs)


def test_float_value_codec_is_the_value_dtype():
    assert sparsecomm.TopKState(value_codec="bf16").config.value_dtype == torch.bfloat16
    state = sparsecomm.TopKState(selector="chunk", value_codec="fp16")
    assert state.config.value_dtype == torch.float16 and state.config.value_codec is None


def test_checkpoints_of_other_selectors_do_not_name_the_wire():
    assert "index_codec" not in sparsecomm.TopKState().config.checkpoint_dict()


# ----- monitors read chunked payloads through their layout ---------------------------------


def _chunk_event(layout, acc):
    from sparsecomm.hooks.state.events import HookEvent

    payload = torch.empty(layout.nbytes, dtype=torch.uint8)
    indices, decoded = layout.encode(acc, None, payload)
    event = HookEvent("packed", 5, 0, 0, ("w",), (acc.numel(),), False,
                      {"acc": acc, "residual": None, "indices": indices, "payload": payload, "values": decoded},
                      layout)
    return event, payload, indices


def test_finite_guard_decodes_a_chunk_payload_whose_scale_was_corrupted():
    from sparsecomm.monitor import FiniteGuard, NonFiniteError

    layout = ChunkLayout(64, 16, 0.25, "rice", "int4")
    event, payload, indices = _chunk_event(layout, torch.linspace(-1, 1, 64))
    FiniteGuard()(event)  # clean: silent
    payload[2:4] = torch.tensor([0x7FC0], dtype=torch.int16).view(torch.uint8)  # chunk 1's bf16 scale -> NaN
    with pytest.raises(NonFiniteError) as caught:
        FiniteGuard()(event)
    assert caught.value.tensor == "payload" and 16 <= caught.value.element < 32


def test_payload_injector_flips_one_packed_code_of_a_chunk_payload():
    from sparsecomm.monitor.fault_injector import BitFlipInjector

    layout = ChunkLayout(64, 16, 0.25, "chunk", "int4")
    acc = torch.linspace(-1, 1, 64)
    event, payload, indices = _chunk_event(layout, acc)
    clean = payload.clone()
    BitFlipInjector("payload", step=5, rank=None, bit=5, index=1)(event)  # bit 5 of the byte holding codes 0, 1
    changed = (payload != clean).nonzero().flatten().tolist()
    assert changed == [layout.scale_bytes + layout.index_bytes]  # the value region's first byte, nothing else
    clean_indices, clean_values = layout.decode(clean)
    hit_indices, hit_values = layout.decode(payload)
    assert torch.equal(hit_indices, clean_indices)
    assert (hit_values != clean_values).nonzero().flatten().tolist() == [1]


# ----- exact top-k on the compact wire ------------------------------------------------------


def _train_exact(rank, world_size, index_codec, value_codec, momentum):
    ddp = torch.nn.parallel.DistributedDataParallel(mlp(width=48, depth=3), bucket_cap_mb=0.02)
    state = sparsecomm.register_topk_hook(ddp, density=0.03, index_codec=index_codec, value_codec=value_codec,
                                          momentum=momentum, verify_conservation=True, budget="bucket")
    return fit_doubling(ddp, rank, 8, 48), state.stats()["last_step"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_exact_topk_on_the_rice_wire_trains_bit_for_bit_like_int32(world_size):
    # Same selection, same fp32 values: only the index encoding differs, so training must not.
    plain = run_on_ranks(_train_exact, "int32", None, 0.9, world_size=world_size, timeout=180)
    rice = run_on_ranks(_train_exact, "rice", "fp32", 0.9, world_size=world_size, timeout=180)
    for (params_a, last_a), (params_b, last_b) in zip(plain, rice):
        assert all(torch.equal(a, b) for a, b in zip(params_a, params_b))
        assert last_a["elements_sent"] == last_b["elements_sent"]
        assert last_b["bytes_sent"] < 0.7 * last_a["bytes_sent"]  # 4 + 4 bytes -> ~1.1 + 4 bytes per entry


def test_exact_topk_with_quantized_values_conserves_under_momentum():
    # verify_conservation audits every sparse call against an independent recomputation.
    results = run_on_ranks(_train_exact, "rice", "int4", 0.9, world_size=2, timeout=180)
    params = [r[0] for r in results]
    assert all(torch.equal(a, b) for a, b in zip(*params))  # replicas agree
    last = results[0][1]
    assert last["sparse_calls"] >= 1 and last["bytes_sent"] < last["bytes_dense"] / 15
