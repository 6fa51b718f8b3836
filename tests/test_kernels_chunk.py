"""The native chunked-selection kernels (``chunk_encode``, ``chunk_decode_add``) against the reference.

The reference is ChunkLayout.encode applied to the compensated acc, and ChunkLayout.views +
one index_add_ per row (sparsecomm/ops/reference.py). The kernels must write the same
payload bytes and the same bits of residual, indices and decoded values (NaN bits
included; sums are compared with NaN at the same places, as unpack_add's) for every index
x value codec pair, on geometries that exercise a partial last chunk with k_last < k_full,
4096-entry chunks and small ones, density 1.0 and densities whose k is too large for the
kernel's group-maximum bound, and on data with ties, zeros, subnormals and +-Inf/NaN.
Every CPU level is compared in tests/test_kernels_isa.py; the fused hook path against the
reference hook at the end.
"""
import pytest
import torch
from kernel_cases import check_fp16_saturation, fp16_saturation_grad

from sparsecomm import ops
from sparsecomm.compress.chunk_layout import ChunkLayout
from sparsecomm.compress.index_codecs import INDEX_CODECS
from sparsecomm.compress.value_codecs import VALUE_CODECS
from sparsecomm.ops import native, reference

LOADED, WHY_NOT = native.load()
pytestmark = pytest.mark.skipif(not LOADED, reason=f"native extension not built: {WHY_NOT}")

INF, NAN = float("inf"), float("nan")
# (numel, chunk_size, density)
GEOMETRIES = [
    (10_003, 4096, 0.01),  # 3 chunks, the last of 1811 entries: k_last 19 < k_full 41
    (3 * 4096, 4096, 0.01),  # whole chunks only
    (70_001, 65_536, 0.001),  # the largest chunk
    (1003, 64, 0.1),
    (777, 100, 0.3),
    (300, 7, 0.5),  # chunks shorter than one vector
    (64, 16, 1.0),  # everything sent
    (5000, 4096, 0.5),  # k = 2048: beyond the group bound, exact selection over the whole chunk
    (1, 2, 0.5),
]
PAIRS = [(i, v) for i in INDEX_CODECS for v in VALUE_CODECS]


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
    if n >= 4200:
        x[4096:4200] = 0.0  # a run of zeros inside the second chunk
    if nonfinite and n >= 8:
        x[[1, n // 2, n // 3, n - 1]] = torch.tensor([NAN, INF, -INF, -NAN])
    return x


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _assert_same_sum(want, got, message):
    """Sums: NaN at the same places (the bits of NaN + x are unspecified), all else bitwise."""
    nan = torch.isnan(want)
    assert torch.equal(nan, torch.isnan(got)), message
    assert torch.equal(_bits(want[~nan]), _bits(got[~nan])), message


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


@pytest.mark.parametrize("nonfinite", [False, True], ids=["finite", "nonfinite"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "n={}-c={}-d={}".format(*g))
@pytest.mark.parametrize("index_codec,value_codec", PAIRS)
def test_encode_and_decode_add_match_the_reference(index_codec, value_codec, geometry, nonfinite):
    n, chunk_size, density = geometry
    layout = ChunkLayout(n, chunk_size, density, index_codec, value_codec)
    grad = _data(n, seed=n, nonfinite=nonfinite)
    residual = _data(n, seed=n + 1, nonfinite=False) * 0.1
    payloads = []
    for divisor, add_residual, r in ((3.0, True, residual), (1.0, False, residual), (2.0, False, None)):
        want = _encode(reference, layout, grad, r, divisor, add_residual)
        got = _encode(native, layout, grad, r, divisor, add_residual)
        _assert_same_encode(want, got)
        payloads.append(want[0])
    gathered = torch.cat(payloads)  # three ranks with different selections
    for zero_out in (True, False):
        start = torch.randn(n + 1)[1:]  # not 64-byte aligned
        want, got = start.clone(), start.clone()
        reference.chunk_decode_add(gathered, layout, want, zero_out)
        native.chunk_decode_add(gathered, layout, got, zero_out)
        _assert_same_sum(want, got, f"decode_add differs (zero_out={zero_out})")


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("value_codec", ["fp32", "bf16", "fp16", "int4"])
def test_decode_add_into_16_bit_buckets(value_codec, out_dtype):
    layout = ChunkLayout(10_003, 4096, 0.01, "rice", value_codec)
    rows = []
    for seed in range(2):
        payload = torch.empty(layout.nbytes, dtype=torch.uint8)
        reference.chunk_encode(_data(10_003, seed, False) * 100, None, 1.0, False, layout, payload)
        rows.append(payload)
    gathered = torch.cat(rows)
    want, got = torch.zeros(10_003, dtype=out_dtype), torch.ones(10_003, dtype=out_dtype)
    reference.chunk_decode_add(gathered, layout, want, True)
    native.chunk_decode_add(gathered, layout, got, True)
    _assert_same_sum(want, got, "decode_add differs")


def test_fp16_codec_saturation_conserves_every_finite_acc():
    """kernel_cases.FP16_SATURATION's float32 accs (the kernel's dtype) on the fp16 value
    codec: sent + residual == acc up to float32's largest. Every CPU level: test_kernels_isa.py."""
    grad, k = fp16_saturation_grad(torch.float32)
    n = grad.numel()
    layout = ChunkLayout(n, n, k / n, "chunk", "fp16")
    assert layout.capacity == k
    for impl in (reference, native):
        _, indices, decoded, residual = _encode(impl, layout, grad, torch.zeros(n), 1.0, True)
        check_fp16_saturation(grad, indices, decoded, residual)


def test_chunks_of_equal_keys_take_the_lowest_indices():
    layout = ChunkLayout(3 * 4096, 4096, 0.01, "chunk", "fp32")
    grad = torch.zeros(3 * 4096)
    grad[4096:8192] = -2.0  # one chunk all ties, one all zeros, one of two tie classes
    grad[8192::2] = 1.0
    grad[8193::2] = -1.0
    _, indices, _, _ = _encode(native, layout, grad, None, 1.0, False)
    k = layout.geometry.k_full
    want = torch.cat([torch.arange(k), 4096 + torch.arange(k), 8192 + torch.arange(k)])
    assert torch.equal(indices, want)


def test_dispatch_takes_the_reference_where_the_kernel_does_not_apply():
    layout = ChunkLayout(5000, 1024, 0.02, "rice", "int4")
    assert ops.dispatch.native_chunk_encode(torch.zeros(5000), layout)
    grad = _data(5000, 3, True).to(torch.bfloat16)  # 16-bit gradients: the reference
    assert not ops.dispatch.native_chunk_encode(grad, layout)
    want = _encode(reference, layout, grad, grad * 0.5, 2.0, True)
    got = _encode(ops.dispatch, layout, grad, grad * 0.5, 2.0, True)
    _assert_same_encode(want, got)


def test_argument_errors():
    layout = ChunkLayout(1000, 100, 0.1, "chunk", "int8")
    geometry = layout.geometry
    payload = torch.empty(layout.nbytes, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="payload must be"):
        native.chunk_encode(torch.zeros(1000), None, 1.0, False, layout, payload[:-8])
    with pytest.raises(RuntimeError, match="float32"):
        native.chunk_encode(torch.zeros(1000, dtype=torch.float16), None, 1.0, False, layout, payload)
    with pytest.raises(RuntimeError, match="needs a residual"):
        native.chunk_encode(torch.zeros(1000), None, 1.0, True, layout, payload)
    with pytest.raises(RuntimeError, match="value_codec"):
        torch.ops.sparsecomm.chunk_encode(torch.zeros(1000), None, 1.0, False, 100, geometry.k_full,
                                          geometry.k_last, 1, 8, 0, payload)
    with pytest.raises(RuntimeError, match="gathered must be"):
        native.chunk_decode_add(payload[:-1], layout, torch.zeros(1000))


def test_a_corrupt_payload_raises_and_writes_nothing_outside_the_bucket():
    layout = ChunkLayout(1000, 100, 0.1, "int32", "fp32")
    payload = torch.empty(layout.nbytes, dtype=torch.uint8)
    native.chunk_encode(torch.randn(1000), None, 1.0, False, layout, payload)
    payload[:4] = torch.tensor([0xFF, 0xFF, 0xFF, 0x7F], dtype=torch.uint8)  # index 2^31 - 1
    with pytest.raises(RuntimeError, match="corrupt payload"):
        native.chunk_decode_add(payload, layout, torch.zeros(1000))


@pytest.mark.parametrize("index_codec,value_codec", [("rice", "int2"), ("int32", "bf16"), ("chunk", "sign")])
def test_opcheck(index_codec, value_codec):
    layout = ChunkLayout(10_003, 4096, 0.01, index_codec, value_codec)
    geometry = layout.geometry
    codecs = (INDEX_CODECS.index(index_codec), VALUE_CODECS.index(value_codec))
    # Finite data: opcheck compares outputs of repeated runs, and NaN != NaN there.
    grad, residual = _data(10_003, 0, False), _data(10_003, 1, False)
    payload = torch.empty(layout.nbytes, dtype=torch.uint8)
    args = (grad, residual, 3.0, True, 4096, geometry.k_full, geometry.k_last, *codecs, 0, payload)
    torch.library.opcheck(torch.ops.sparsecomm.chunk_encode.default, args)
    torch.ops.sparsecomm.chunk_encode(*args)
    gathered = torch.cat([payload, payload])
    torch.library.opcheck(torch.ops.sparsecomm.chunk_decode_add.default,
                          (gathered, 4096, geometry.k_full, geometry.k_last, *codecs, 0, torch.zeros(10_003), True))


# ----- in the hook ------------------------------------------------------------------------


def _train(rank, world_size, kernels, value_codec):
    import os

    import sparsecomm
    from ddp_models import fit_doubling, mlp

    os.environ["SPARSECOMM_KERNELS"] = kernels  # read at every dispatch
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(mlp(width=64, depth=3), bucket_cap_mb=0.01)
    state = sparsecomm.register_topk_hook(ddp, density=0.02, selector="chunk", chunk_size=512,
                                          index_codec="rice", value_codec=value_codec, verify_conservation=True,
                                          budget="bucket")  # several buckets: the model budget would not fuse
    return fit_doubling(ddp, rank, 6, 64), state.stats()["last_step"]


@pytest.mark.parametrize("value_codec", ["int4", "fp32"])
def test_the_fused_hook_path_trains_bit_for_bit_like_the_reference(value_codec):
    # The native encoder forms acc itself (no compensation pass): fused_calls counts it; the
    # hook's own conservation audit (verify_conservation) checks every call.
    from multiprocess import run_on_ranks

    fused = run_on_ranks(_train, "auto", value_codec, world_size=2, timeout=180)
    plain = run_on_ranks(_train, "reference", value_codec, world_size=2, timeout=180)
    for (params_a, last_a), (params_b, last_b) in zip(fused, plain):
        assert all(torch.equal(a, b) for a, b in zip(params_a, params_b))
        assert last_a["fused_calls"] == last_a["sparse_calls"] > 0 and last_b["fused_calls"] == 0
        assert last_a["bytes_sent"] == last_b["bytes_sent"]
