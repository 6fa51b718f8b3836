"""``exact_topk_decode_add``: decode world_size payloads of exact top-k on the compact wire
(one chunk of the whole bucket, a bf16 scale per 64 payload entries) and add them, in row
(rank) order, into the bucket; every implementation against the pure-torch reference
(ChunkLayout.views + one index_add_ per row; the comparison: tests/chunk_kernel_checks.py, the
implementations: tests/kernel_implementations.py). The op is ``chunk_decode_add`` of such a
layout (the CPU kernel: csrc/cpu/compact_decode_add.cpp; Triton: the chunk decoder with group
scales) under a name that says what it is, refusing every other layout.

The payloads are those the hook sends (chunk_kernel_checks.payloads_of: the native encoder,
which test_op_exact_topk_encode.py holds to the reference's bytes), several per bucket (the
error-feedback modes select differently, as ranks do), on the layouts and gradients the
encoder is tested on.
"""
import pytest
import torch
from chunk_kernel_checks import (ALL_MODES, EXACT_CPU_GEOMETRIES, EXACT_SAMPLED, EXACT_SAMPLED_PAIRS,
                                 EXACT_SIXTEEN_BIT_VALUE_CODECS, EXACT_TRITON_EVERY_PAIR_GEOMETRY,
                                 EXACT_TRITON_GEOMETRIES, EXACT_TRITON_GEOMETRY_PAIRS, PAIRS, check_decode_add,
                                 chunk_arguments, encode, exact_layout, exact_sixteen_bit_layout, large_bucket_inputs,
                                 layout_inputs, level_decode_case, misleading_sample_inputs, non_finite_beyond_k_inputs,
                                 pair_mode, payloads_of, sixteen_bit_inputs)
from kernel_cases import chunk_data
from kernel_implementations import (DISPATCH, CpuLevelTests, LevelCase, bits, dtype_id,
                                    implementation_cases, implementations)

from sparsecomm import ops
from sparsecomm.compress import index_codecs
from sparsecomm.compress.chunk_layout import ChunkLayout
from sparsecomm.compress.index_codecs import INDEX_CODECS
from sparsecomm.ops import native, reference

OP = "exact_topk_decode_add"
ENCODER = "exact_topk_encode"
pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|overflow) encountered:RuntimeWarning")


def check_decoding(impl, layout, grad, residual, modes=ALL_MODES, zero_outs=(True, False)):
    """The payloads of ``grad`` in ``modes``, decoded as ranks' payloads into a bucket."""
    gathered = torch.cat(payloads_of(ENCODER, layout, grad, residual, modes))
    for zero_out in zero_outs:
        check_decode_add(impl, OP, layout, gathered, torch.randn(layout.numel), zero_out)


@pytest.mark.parametrize("impl,index_codec,value_codec,geometry,nonfinite", implementation_cases(OP, {
    "cpu": [(i, v, g, nonfinite) for i, v in PAIRS for g in EXACT_CPU_GEOMETRIES for nonfinite in (False, True)]}))
def test_matches_the_reference(impl, index_codec, value_codec, geometry, nonfinite):
    layout = exact_layout(*geometry, index_codec, value_codec)
    check_decoding(impl, layout, *layout_inputs(layout.numel, nonfinite))


@pytest.mark.parametrize("impl,index_codec,value_codec", implementation_cases(OP, {"triton": PAIRS}))
def test_triton_every_codec_pair_matches_the_reference(impl, index_codec, value_codec):
    """Two payloads, with and without NaN/+-Inf, in the pair's error-feedback mode."""
    layout = exact_layout(*EXACT_TRITON_EVERY_PAIR_GEOMETRY, index_codec, value_codec)
    mode = (pair_mode(index_codec, value_codec),)
    rows = [payloads_of(ENCODER, layout, *layout_inputs(layout.numel, nonfinite, seed), mode)[0]
            for nonfinite, seed in ((True, 0), (False, 7))]
    for zero_out in (True, False):
        check_decode_add(impl, OP, layout, torch.cat(rows), torch.randn(layout.numel), zero_out)


@pytest.mark.parametrize("impl", implementations(OP, "triton"))
@pytest.mark.parametrize("geometry", EXACT_TRITON_GEOMETRIES, ids=lambda g: "n={}-d={}".format(*g))
def test_triton_geometries(impl, geometry):
    for index_codec, value_codec in EXACT_TRITON_GEOMETRY_PAIRS:
        layout = exact_layout(*geometry, index_codec, value_codec)
        check_decoding(impl, layout, *layout_inputs(layout.numel, geometry[0] >= 8), (0,), zero_outs=(False,))


@pytest.mark.slow  # CI time on the interpreter; scripts/gpu_check.sh runs it (-m "")
@pytest.mark.parametrize("impl", implementations(OP, "triton"))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("value_codec", EXACT_SIXTEEN_BIT_VALUE_CODECS)
def test_16_bit_gradients_and_buckets(impl, dtype, value_codec):
    layout = exact_sixteen_bit_layout(value_codec)
    gathered = torch.cat(payloads_of(ENCODER, layout, *sixteen_bit_inputs(layout, dtype), (0, 2)))
    for zero_out in (True, False):
        check_decode_add(impl, OP, layout, gathered, torch.randn(layout.numel).to(dtype), zero_out)


@pytest.mark.parametrize("impl", implementations(OP, "cpu"))
@pytest.mark.parametrize("index_codec,value_codec", EXACT_SAMPLED_PAIRS)
def test_large_buckets_match_the_reference(impl, index_codec, value_codec):
    check_decoding(impl, exact_layout(EXACT_SAMPLED, 0.01, index_codec, value_codec), *large_bucket_inputs())


@pytest.mark.parametrize("impl", implementations(OP, "cpu"))
def test_payloads_of_a_misleading_sample(impl):
    check_decoding(impl, exact_layout(EXACT_SAMPLED, 0.01, "rice", "int4"), *misleading_sample_inputs())


@pytest.mark.parametrize("impl", implementations(OP, "cpu"))
@pytest.mark.parametrize("value_codec", ["int4", "fp32", "bf16"])
@pytest.mark.parametrize("count", [3, 300, 10_003], ids=["fewer-than-k", "more-than-k", "all-nan"])
def test_payloads_of_non_finite_entries_beyond_k(impl, value_codec, count):
    check_decoding(impl, exact_layout(10_003, 0.01, "rice", value_codec), *non_finite_beyond_k_inputs(count))


@pytest.mark.parametrize("impl", implementations(OP, "cpu"))
@pytest.mark.parametrize("index_codec", INDEX_CODECS)
def test_a_corrupt_payload_raises_and_writes_nothing_outside_the_bucket(impl, index_codec):
    n = 1000
    layout = exact_layout(n, 0.1, index_codec, "fp32")
    payload = torch.empty(layout.nbytes, dtype=torch.uint8)
    reference.exact_topk_encode(torch.randn(n), None, 1.0, False, layout, payload)
    region = payload[layout.scale_bytes : layout.scale_bytes + layout.index_bytes]
    if index_codec == "int32":
        region[4:8] = torch.tensor([0xFF, 0xFF, 0xFF, 0x7F], dtype=torch.uint8)  # index 2^31 - 1
    elif index_codec == "chunk":
        region[:3] = 0xFF  # the first two 10-bit indices 1023 > n - 1
    else:
        region[:] = 0xFF  # one long unary run: past the region's bits
    backing = torch.zeros(n + 16)
    with pytest.raises(RuntimeError, match="corrupt payload"):
        impl.ops.exact_topk_decode_add(payload, layout, backing[8 : 8 + n])
    assert not backing[:8].any() and not backing[8 + n :].any()


@pytest.mark.parametrize("impl", implementations(OP, "cpu"))
@pytest.mark.parametrize("index_codec", ["int32", "chunk"])
def test_positions_out_of_order_or_repeated_add_what_the_reference_adds(impl, index_codec):
    """A fixed-width index region altered on the way (wire_checksum=False) can list positions
    inside the bucket out of order, or one twice: the reference adds them all (index_add_), and
    so must the kernel, bit for bit; refusing them would make one receiver of an owner exchange
    raise where the others go on. Three rows: one reversed, one with a repeated position (and
    so one missing), one intact; sizes past one index block of the kernel (2^14 entries)."""
    n = 200_003
    layout = exact_layout(n, 0.1, index_codec, "int4")  # k = 20_001: two index blocks
    rows = []
    for seed, alter in ((0, "reverse"), (1, "repeat"), (2, None)):
        payload = torch.empty(layout.nbytes, dtype=torch.uint8)
        reference.exact_topk_encode(chunk_data(n, seed, False), None, 1.0, False, layout, payload)
        region = payload[layout.scale_bytes : layout.scale_bytes + layout.index_bytes]
        indices = index_codecs.decode(index_codec, region, layout.geometry)
        if alter == "reverse":
            indices = indices.flip(0)
        elif alter == "repeat":
            indices[17_000] = indices[3]  # across index blocks
        region.copy_(index_codecs.encode(index_codec, indices, layout.geometry))
        rows.append(payload)
    gathered = torch.cat(rows)
    for zero_out in (True, False):
        start = torch.randn(n)
        want, got = start.clone(), start.clone()
        reference.exact_topk_decode_add(gathered, layout, want, zero_out)
        impl.ops.exact_topk_decode_add(gathered, layout, got, zero_out)
        assert torch.equal(bits(want), bits(got)), f"zero_out={zero_out}"


@pytest.mark.parametrize("impl", implementations(OP, "cpu"))
@pytest.mark.parametrize("index_codec,value_codec", [("rice", "int2"), ("int32", "bf16"), ("chunk", "sign")])
def test_opcheck(impl, index_codec, value_codec):
    n = 10_003
    layout = exact_layout(n, 0.01, index_codec, value_codec)
    args = chunk_arguments(layout)
    # Finite data: opcheck compares outputs of repeated runs, and NaN != NaN there.
    payload = torch.empty(layout.nbytes, dtype=torch.uint8)
    torch.ops.sparsecomm.chunk_encode(chunk_data(n, 0, False), chunk_data(n, 1, False), 3.0, True, *args, payload)
    torch.library.opcheck(torch.ops.sparsecomm.chunk_decode_add.default,
                          (torch.cat([payload, payload]), *args, torch.zeros(n), True))


# --------------------------------------------------------------------------- the op's name, and the choice


@pytest.mark.parametrize("impl", implementations(OP, "reference", "cpu", "triton") + [pytest.param(DISPATCH,
                                                                                                  id="dispatch")])
def test_every_other_layout_is_refused(impl):
    chunked = ChunkLayout(1000, 100, 0.1, "rice", "int4")
    gathered = torch.zeros(chunked.nbytes, dtype=torch.uint8, device=impl.device)
    with pytest.raises(ValueError, match="exact_topk_decode_add: the layout must be one chunk"):
        impl.ops.exact_topk_decode_add(gathered, chunked, torch.zeros(1000, device=impl.device))


@pytest.mark.parametrize("impl", implementations(OP, "cpu", "triton"))
def test_chunk_decode_add_of_the_layout_is_this_op(impl):
    """chunk_decode_add, what the hook calls, takes these layouts too, with the same sums."""
    layout = exact_layout(10_003, 0.01, "rice", "int4")
    gathered = torch.cat(payloads_of(ENCODER, layout, *layout_inputs(10_003, True))).to(impl.device)
    sums = []
    for op in (OP, "chunk_decode_add"):
        out = torch.ones(10_003, device=impl.device)
        getattr(impl.ops, op)(gathered, layout, out, False)
        sums.append(out.cpu())
    assert torch.equal(bits(sums[0]), bits(sums[1]))


@pytest.mark.parametrize("impl", implementations(OP, "cpu"))
def test_dispatch_takes_the_kernel(impl):
    layout = exact_layout(5000, 0.02, "rice", "int4")
    out = torch.zeros(5000, dtype=torch.bfloat16)  # every bucket dtype
    assert ops.dispatch._chunk_implementation("chunk_decode_add", out, layout) is native.exact_topk_decode_add
    gathered = encode(DISPATCH, ENCODER, layout, chunk_data(5000, 3, True), None, 1.0, False)[0]
    want, got = out.clone(), out.clone()
    reference.exact_topk_decode_add(gathered, layout, want, True)
    ops.dispatch.exact_topk_decode_add(gathered, layout, got, True)
    assert torch.equal(bits(want), bits(got))


# --------------------------------------------------------------------------- every CPU level


def cpu_level_cases() -> dict[str, LevelCase]:
    """Every codec pair on 10,003 entries and three pairs on 2^20 + 3 (two payloads each)."""
    cases = {}
    for n, density, pairs in ((10_003, 0.01, PAIRS), (EXACT_SAMPLED, 0.01, [("rice", "int4"), ("rice", "int2"),
                                                                             ("chunk", "sign")])):
        for index_codec, value_codec in pairs:
            layout = exact_layout(n, density, index_codec, value_codec)
            cases[f"exact_topk_decode_add n={n} density={density} {index_codec}+{value_codec}"] = LevelCase(
                level_decode_case(OP, layout, 2, seed=n))
    return cases


class TestEveryCpuLevel(CpuLevelTests):
    cases = cpu_level_cases
