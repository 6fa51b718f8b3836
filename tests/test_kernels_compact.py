"""The native kernels of exact top-k on the compact wire against the reference.

That wire is ``ChunkLayout(numel, numel, density, index_codec, value_codec, scale_group=64)``
(sparsecomm/hooks/wires/__init__.py, payload_layout; the owner exchange's exact parts too): one chunk of
the whole bucket, a bf16 scale per 64 payload entries. ``chunk_encode`` and
``chunk_decode_add`` take it on CPU (csrc/cpu/compact_encode.cpp, compact_decode_add.cpp):
they must write the same payload bytes and the same bits of residual, indices and decoded
values as ChunkLayout.encode of the compensated acc, and add what ChunkLayout.views + one
index_add_ per row add, for every index x value codec pair; on bucket sizes that are and are
not multiples of 64, k that is and is not, buckets of >= 2^20 entries (the sampled one-pass
selection, and its fallback when the sample misleads it), density 1; on data with ties,
zeros, subnormals and +-Inf/NaN (also more of them than k, and all NaN); with and without a
residual, adding it or not, divisor 1 and 3. Every CPU level runs these layouts in
tests/test_kernels_isa.py.
"""
import pytest
import torch
from kernel_cases import check_fp16_saturation, fp16_saturation_grad

from sparsecomm import ops
from sparsecomm.compress.chunk_layout import ChunkLayout
from sparsecomm.compress import index_codecs
from sparsecomm.compress.index_codecs import INDEX_CODECS
from sparsecomm.compress.owner_layout import EXACT_SCALE_GROUP
from sparsecomm.compress.value_codecs import VALUE_CODECS
from sparsecomm.ops import native, reference

LOADED, WHY_NOT = native.load()
pytestmark = pytest.mark.skipif(not LOADED, reason=f"native extension not built: {WHY_NOT}")

INF, NAN = float("inf"), float("nan")
PAIRS = [(i, v) for i in INDEX_CODECS for v in VALUE_CODECS]
# (numel, density): k = ceil(density * numel)
GEOMETRIES = [
    (10_003, 0.01),  # k = 101: neither numel nor k a multiple of 64
    (6400, 0.01),  # k = 64: one whole group
    (1003, 0.3),  # k = 301
    (777, 0.5),  # k = 389, more than the two-pass strategy's first bin holds
    (64, 1.0),  # everything sent
    (1, 0.5),  # one entry
]
SAMPLED = 2**20 + 3  # the selection's sampled one-pass strategy starts at 2^20 entries
SAMPLED_PAIRS = [("rice", "int4"), ("rice", "int2"), ("chunk", "sign"), ("int32", "fp32"), ("rice", "bf16"),
                 ("chunk", "fp8")]


def _layout(n, density, index_codec, value_codec):
    return ChunkLayout(n, n, density, index_codec, value_codec, scale_group=EXACT_SCALE_GROUP)


def _data(n: int, seed: int, nonfinite: bool) -> torch.Tensor:
    """randn with zeros, exact ties, subnormals, and optionally NaN/+-Inf (also -NaN)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=generator)
    draw = torch.rand(n, generator=generator)
    x[draw < 0.05] = 0.0
    x[(draw >= 0.05) & (draw < 0.07)] = 1.5  # ties with each other, above most of randn
    x[(draw >= 0.07) & (draw < 0.08)] = -1.5
    x[(draw >= 0.08) & (draw < 0.09)] = 1e-40  # subnormal
    x[(draw >= 0.09) & (draw < 0.095)] = -3e-42
    if nonfinite and n >= 8:
        x[[1, n // 2, n // 3, n - 1]] = torch.tensor([NAN, INF, -INF, -NAN])
    return x


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _encode(impl, layout, grad, residual, divisor, add_residual):
    r = None if residual is None else residual.clone()
    payload = torch.full((layout.nbytes,), 0xAB, dtype=torch.uint8)  # garbage: every byte must be written
    indices, decoded = impl.chunk_encode(grad, r, divisor, add_residual, layout, payload)
    return payload, indices, decoded, r


def _assert_same_encode(want, got):
    (p1, i1, d1, r1), (p2, i2, d2, r2) = want, got
    assert torch.equal(p1, p2), "payload bytes differ"
    assert i1.dtype == i2.dtype and torch.equal(i1, i2), "indices differ"
    assert d1.dtype == d2.dtype and torch.equal(_bits(d1), _bits(d2)), "decoded values differ"
    assert (r1 is None) == (r2 is None)
    if r1 is not None:
        assert torch.equal(_bits(r1), _bits(r2)), "residuals differ"


def _assert_same_sum(want, got, message):
    """Sums: NaN at the same places (the bits of NaN + x are unspecified), all else bitwise."""
    nan = torch.isnan(want)
    assert torch.equal(nan, torch.isnan(got)), message
    assert torch.equal(_bits(want[~nan]), _bits(got[~nan])), message


def _check(layout, grad, residual):
    """Encode three ways (add the residual with divisor 3, overwrite it with divisor 1, no
    residual with divisor 2), then decode the three payloads as three ranks' into a bucket."""
    payloads = []
    for divisor, add_residual, r in ((3.0, True, residual), (1.0, False, residual), (2.0, False, None)):
        want = _encode(reference, layout, grad, r, divisor, add_residual)
        got = _encode(native, layout, grad, r, divisor, add_residual)
        _assert_same_encode(want, got)
        payloads.append(want[0])
    gathered = torch.cat(payloads)
    for zero_out in (True, False):
        start = torch.randn(layout.numel + 1)[1:]  # not 64-byte aligned
        want, got = start.clone(), start.clone()
        reference.chunk_decode_add(gathered, layout, want, zero_out)
        native.chunk_decode_add(gathered, layout, got, zero_out)
        _assert_same_sum(want, got, f"decode_add differs (zero_out={zero_out})")


@pytest.mark.parametrize("nonfinite", [False, True], ids=["finite", "nonfinite"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "n={}-d={}".format(*g))
@pytest.mark.parametrize("index_codec,value_codec", PAIRS)
def test_encode_and_decode_add_match_the_reference(index_codec, value_codec, geometry, nonfinite):
    n, density = geometry
    layout = _layout(n, density, index_codec, value_codec)
    _check(layout, _data(n, seed=n, nonfinite=nonfinite), _data(n, seed=n + 1, nonfinite=False) * 0.1)


@pytest.mark.parametrize("index_codec,value_codec", SAMPLED_PAIRS)
def test_large_buckets_match_the_reference(index_codec, value_codec):
    layout = _layout(SAMPLED, 0.01, index_codec, value_codec)
    _check(layout, _data(SAMPLED, seed=5, nonfinite=True), _data(SAMPLED, seed=6, nonfinite=False) * 0.1)


def _sampled_positions(n: int) -> torch.Tensor:
    """The entries the sampled strategy reads (csrc/cpu/sampled_candidates.h: 2048 evenly
    spaced runs of 32)."""
    runs = torch.arange(2048) * (n - 32) // 2047
    return (runs.unsqueeze(1) + torch.arange(32)).flatten()


def test_a_misleading_sample_falls_back_to_the_exact_two_passes():
    # Large values at every sampled entry and nowhere else: the bound admits 65536 entries, more
    # than the slabs hold, so the two-pass strategy runs from the acc the pass left behind.
    n = SAMPLED
    grad = torch.randn(n) * 1e-3
    grad[_sampled_positions(n)] = torch.randn(2048 * 32) + 10.0
    _check(_layout(n, 0.01, "rice", "int4"), grad, torch.randn(n) * 1e-4)


@pytest.mark.parametrize("value_codec", ["int4", "fp32", "bf16"])
@pytest.mark.parametrize("count", [3, 300, 10_003], ids=["fewer-than-k", "more-than-k", "all-nan"])
def test_non_finite_entries_beyond_k(value_codec, count):
    # More Inf/NaN than k: every sent value is non-finite and the unsent ones must leave +0 too.
    n = 10_003
    generator = torch.Generator().manual_seed(count)
    grad = torch.randn(n, generator=generator)
    if count >= n:
        grad.fill_(NAN)
    else:
        grad[torch.randperm(n, generator=generator)[:count]] = torch.tensor([(NAN, INF, -INF)[j % 3]
                                                                            for j in range(count)])
    _check(_layout(n, 0.01, "rice", value_codec), grad, torch.randn(n, generator=generator))


def test_fp16_codec_saturation_conserves_every_finite_acc():
    """kernel_cases.FP16_SATURATION's float32 accs on the fp16 value codec, selected by the
    two passes and, in a bucket of 2^20 + 3, by the sampled one pass: sent + residual == acc
    up to float32's largest."""
    grad, k = fp16_saturation_grad(torch.float32)
    for n in (grad.numel(), SAMPLED):
        acc = torch.cat([grad, torch.randn(n - grad.numel(), generator=torch.Generator().manual_seed(n))])
        layout = _layout(n, k / n, "rice", "fp16")
        assert layout.capacity == k
        for impl in (reference, native):
            _, indices, decoded, residual = _encode(impl, layout, acc, torch.zeros(n), 1.0, True)
            check_fp16_saturation(acc, indices, decoded, residual)


def test_equal_keys_take_the_lowest_indices():
    n = 10_000
    grad = torch.ones(n)
    grad[1::2] = -1.0
    layout = _layout(n, 0.01, "chunk", "int2")
    _, indices, _, _ = _encode(native, layout, grad, None, 1.0, False)
    assert torch.equal(indices, torch.arange(layout.capacity))


@pytest.mark.parametrize("threads", [1, 2])
def test_the_result_does_not_depend_on_the_thread_count(threads):
    layout = _layout(SAMPLED, 0.01, "rice", "int2")
    grad, residual = _data(SAMPLED, 7, False), _data(SAMPLED, 8, False)
    want = _encode(reference, layout, grad, residual, 2.0, True)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _encode(native, layout, grad, residual, 2.0, True)
    finally:
        torch.set_num_threads(before)
    _assert_same_encode(want, got)


def test_dispatch_takes_the_kernel_for_float32_gradients_only():
    layout = _layout(5000, 0.02, "rice", "int4")
    assert ops.dispatch.native_chunk_encode(torch.zeros(5000), layout)
    grad = _data(5000, 3, True).to(torch.bfloat16)  # 16-bit gradients: the reference
    assert not ops.dispatch.native_chunk_encode(grad, layout)
    _assert_same_encode(_encode(reference, layout, grad, grad * 0.5, 2.0, True),
                        _encode(ops.dispatch, layout, grad, grad * 0.5, 2.0, True))
    # Scale groups on a layout of several chunks: no kernel takes it.
    several = ChunkLayout(5000, 1000, 0.02, "rice", "int4", scale_group=64)
    assert not ops.dispatch.native_chunk_encode(torch.zeros(5000), several)


def test_argument_errors():
    layout = _layout(1000, 0.1, "rice", "int8")
    geometry = layout.geometry
    payload = torch.empty(layout.nbytes, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="one chunk of the whole bucket"):
        torch.ops.sparsecomm.chunk_encode(torch.zeros(1000), None, 1.0, False, 500, geometry.k_full, geometry.k_full,
                                          2, 4, 64, payload)
    with pytest.raises(RuntimeError, match="scale_group must be >= 0"):
        torch.ops.sparsecomm.chunk_encode(torch.zeros(1000), None, 1.0, False, 1000, geometry.k_full,
                                          geometry.k_last, 2, 4, -1, payload)
    with pytest.raises(RuntimeError, match="payload must be"):
        native.chunk_encode(torch.zeros(1000), None, 1.0, False, layout, payload[:-8])


@pytest.mark.parametrize("index_codec", INDEX_CODECS)
def test_a_corrupt_payload_raises_and_writes_nothing_outside_the_bucket(index_codec):
    n = 1000
    layout = _layout(n, 0.1, index_codec, "fp32")
    payload = torch.empty(layout.nbytes, dtype=torch.uint8)
    native.chunk_encode(torch.randn(n), None, 1.0, False, layout, payload)
    region = payload[layout.scale_bytes : layout.scale_bytes + layout.index_bytes]
    if index_codec == "int32":
        region[4:8] = torch.tensor([0xFF, 0xFF, 0xFF, 0x7F], dtype=torch.uint8)  # index 2^31 - 1
    elif index_codec == "chunk":
        region[:3] = 0xFF  # the first two 10-bit indices 1023 > n - 1
    else:
        region[:] = 0xFF  # one long unary run: past the region's bits
    backing = torch.zeros(n + 16)
    with pytest.raises(RuntimeError, match="corrupt payload"):
        native.chunk_decode_add(payload, layout, backing[8 : 8 + n])
    assert not backing[:8].any() and not backing[8 + n :].any()


@pytest.mark.parametrize("index_codec", ["int32", "chunk"])
def test_positions_out_of_order_or_repeated_add_what_the_reference_adds(index_codec):
    """A fixed-width index region altered on the way (wire_checksum=False) can list positions
    inside the bucket out of order, or one twice: the reference adds them all (index_add_), and
    so must the kernel, bit for bit; refusing them would make one receiver of an owner exchange
    raise where the others go on. Three rows: one reversed, one with a repeated position (and
    so one missing), one intact; sizes past one index block of the kernel (2^14 entries)."""
    n = 200_003
    layout = _layout(n, 0.1, index_codec, "int4")  # k = 20_001: two index blocks
    rows = []
    for seed, alter in ((0, "reverse"), (1, "repeat"), (2, None)):
        payload = _encode(reference, layout, _data(n, seed, False), None, 1.0, False)[0]
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
        reference.chunk_decode_add(gathered, layout, want, zero_out)
        native.chunk_decode_add(gathered, layout, got, zero_out)
        assert torch.equal(_bits(want), _bits(got)), f"zero_out={zero_out}"


@pytest.mark.parametrize("index_codec,value_codec", [("rice", "int2"), ("int32", "bf16"), ("chunk", "sign")])
def test_opcheck(index_codec, value_codec):
    n = 10_003
    layout = _layout(n, 0.01, index_codec, value_codec)
    geometry = layout.geometry
    codecs = (INDEX_CODECS.index(index_codec), VALUE_CODECS.index(value_codec))
    # Finite data: opcheck compares outputs of repeated runs, and NaN != NaN there.
    grad, residual = _data(n, 0, False), _data(n, 1, False)
    payload = torch.empty(layout.nbytes, dtype=torch.uint8)
    args = (grad, residual, 3.0, True, n, geometry.k_full, geometry.k_last, *codecs, EXACT_SCALE_GROUP, payload)
    torch.library.opcheck(torch.ops.sparsecomm.chunk_encode.default, args)
    torch.ops.sparsecomm.chunk_encode(*args)
    gathered = torch.cat([payload, payload])
    torch.library.opcheck(torch.ops.sparsecomm.chunk_decode_add.default,
                          (gathered, n, geometry.k_full, geometry.k_last, *codecs, EXACT_SCALE_GROUP,
                           torch.zeros(n), True))


def test_the_extension_names_the_codecs_of_the_python_tables(monkeypatch):
    index_names, value_names = torch.ops.sparsecomm.chunk_codecs()
    assert tuple(index_names) == INDEX_CODECS and tuple(value_names) == VALUE_CODECS
    from sparsecomm.compress import value_codecs

    monkeypatch.setattr(value_codecs, "VALUE_CODECS", ("fp32", "bf16", "fp16", "fp8", "int8", "int2", "int4", "sign"))
    with pytest.raises(RuntimeError, match="value codecs .* rebuild the extension"):
        native._check_codec_ids()


# ----- in the hook ------------------------------------------------------------------------


def _train(rank, world_size, kernels, exchange):
    import os

    import sparsecomm
    from ddp_models import fit_doubling, mlp

    os.environ["SPARSECOMM_KERNELS"] = kernels  # read at every dispatch
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(mlp(width=64, depth=3), bucket_cap_mb=0.01)
    state = sparsecomm.register_topk_hook(ddp, density=0.02, index_codec="rice", value_codec="int4",
                                          exchange=exchange, verify_conservation=True,
                                          budget="bucket")  # several buckets: the model budget would not fuse
    return fit_doubling(ddp, rank, 6, 64), state.stats()["last_step"]


@pytest.mark.parametrize("exchange", ["allgather", "owner"])
def test_the_hook_trains_bit_for_bit_like_the_reference(exchange):
    # Exact top-k on the compact wire (and the owner exchange's exact parts): the native
    # kernels replace the reference, and not one bit of the training changes.
    from multiprocess import run_on_ranks

    native_run = run_on_ranks(_train, "auto", exchange, world_size=2, timeout=180)
    plain = run_on_ranks(_train, "reference", exchange, world_size=2, timeout=180)
    for (params_a, last_a), (params_b, last_b) in zip(native_run, plain):
        assert all(torch.equal(a, b) for a, b in zip(params_a, params_b))
        assert last_a["bytes_sent"] == last_b["bytes_sent"]
        if exchange == "allgather":  # the native encoder forms acc itself: the fused path ran
            assert last_a["fused_calls"] == last_a["sparse_calls"] > 0 and last_b["fused_calls"] == 0
