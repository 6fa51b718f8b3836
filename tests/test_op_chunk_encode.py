"""``chunk_encode`` (``selector="chunk"``): fused error feedback + per-chunk top-k + index and
value codecs into one payload, every implementation against the pure-torch reference
(ChunkLayout.encode of the compensated acc; the comparison: tests/chunk_kernel_checks.py,
the implementations: tests/kernel_implementations.py).

For every index x value codec pair, on geometries with a partial last chunk (k_last < k_full),
4096-entry chunks and small ones, chunks over 8192 entries (CUDA: acc re-read from global
memory), density 1 and densities whose k is too large for the CPU kernel's group-maximum
bound, and on data with ties, zeros, subnormals and +-Inf/NaN (kernel_cases.chunk_data). The
Triton interpreter is slow, so it gets small layouts and the codec pairs spread over the
error-feedback modes instead of crossed with all of them. The decoder: test_op_chunk_decode_add.py.
"""
import pytest
import torch
from chunk_kernel_checks import (ALL_MODES, CPU_GEOMETRIES, CUDA_GEOMETRIES, EF_MODES, PAIRS,
                                 TRITON_EVERY_PAIR_GEOMETRY, TRITON_GEOMETRIES, TRITON_GEOMETRY_PAIRS, check_encode,
                                 chunk_arguments, encode, layout_inputs, level_encode_case, pair_mode,
                                 rice_window_inputs, sixteen_bit_inputs, sixteen_bit_layout, triton_geometry_modes)
from kernel_cases import FP16_SATURATION, INF, NAN, check_fp16_saturation, chunk_data, ef_inputs, fp16_saturation_grad
from kernel_implementations import (DISPATCH, NEEDS_NATIVE, REFERENCE, CpuLevelTests, LevelCase,
                                    assert_no_host_synchronisation, assert_same,
                                    assert_the_hook_trains_with_the_kernels_as_with_the_reference,
                                    assert_triton_kernels_compile_for_sm90, bits, capture_in_a_cuda_graph, dtype_id,
                                    implementation_cases, implementations)

from sparsecomm import ops
from sparsecomm.compress.chunk_layout import ChunkLayout
from sparsecomm.compress.index_codecs import INDEX_CODECS
from sparsecomm.compress.value_codecs import VALUE_CODECS
from sparsecomm.ops import native, reference

OP = "chunk_encode"
# The interpreter computes every lane with numpy, masked or not (Inf - Inf in unused lanes),
# and the sign scale takes min(2 m, ...) where 2 m may overflow (as the reference does).
pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|overflow) encountered:RuntimeWarning")


def _triton_cases():
    """Every codec pair on one layout, each pair in its mode (pair_mode); then three pairs on
    every geometry (triton_geometry_modes)."""
    every_pair = [(i, v, TRITON_EVERY_PAIR_GEOMETRY, nonfinite, (pair_mode(i, v),))
                  for i, v in PAIRS for nonfinite in (True, False)]
    geometries = [(i, v, geometry, geometry[0] >= 8, triton_geometry_modes(ChunkLayout(*geometry, i, v)))
                  for geometry in TRITON_GEOMETRIES for i, v in TRITON_GEOMETRY_PAIRS]
    return every_pair + geometries


@pytest.mark.parametrize("impl,index_codec,value_codec,geometry,nonfinite,modes", implementation_cases(OP, {
    "cpu": [(i, v, g, nonfinite, ALL_MODES) for i, v in PAIRS for g in CPU_GEOMETRIES for nonfinite in (False, True)],
    "triton": _triton_cases(),
    "cuda": [(i, v, g, nonfinite, ALL_MODES) for i, v in PAIRS for g in CUDA_GEOMETRIES for nonfinite in (False, True)],
}))
def test_matches_the_reference(impl, index_codec, value_codec, geometry, nonfinite, modes):
    layout = ChunkLayout(*geometry, index_codec, value_codec)
    grad, residual = layout_inputs(layout.numel, nonfinite)
    for mode in modes:
        divisor, add_residual, has_residual = EF_MODES[mode]
        check_encode(impl, OP, layout, grad, residual if has_residual else None, divisor, add_residual)


@pytest.mark.slow  # CI time on the interpreter; scripts/gpu_check.sh runs it (-m "")
@pytest.mark.parametrize("impl", implementations(OP, "triton"))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("value_codec", VALUE_CODECS)
def test_16_bit_gradients_match_the_reference(impl, dtype, value_codec):
    """bf16/fp16 acc: compensation in the gradient's dtype, saturation (fp16 values of bf16
    gradients), the residual of a decoded value rounded to the gradient's dtype."""
    layout = sixteen_bit_layout(value_codec)
    grad, residual = sixteen_bit_inputs(layout, dtype)
    for divisor, add_residual, has_residual in (EF_MODES[0], EF_MODES[2]):
        check_encode(impl, OP, layout, grad, residual if has_residual else None, divisor, add_residual)


@pytest.mark.parametrize("impl", implementations(OP, "cpu", "triton"))
def test_non_finite_chunks_and_saturation(impl):
    """A chunk whose selection holds a NaN (scale NaN), one with only +-Inf (scale +Inf), one
    all-NaN, values beyond fp16 and bf16; the finite entries of those chunks stay in the residual."""
    grad = torch.randn(400, generator=torch.Generator().manual_seed(3))
    grad[5] = NAN
    grad[100:103] = torch.tensor([INF, -INF, 7e4])
    grad[200:300] = NAN
    grad[300:304] = torch.tensor([3.3896e38, -3.4e38, 65520.0, -1e6])
    residual = torch.randn(400, generator=torch.Generator().manual_seed(4))
    for value_codec in VALUE_CODECS:
        check_encode(impl, OP, ChunkLayout(400, 100, 0.05, "chunk", value_codec), grad, residual, 1.0, True)


@pytest.mark.parametrize("impl", implementations(OP, "cpu", "triton"))
def test_rice_codes_longer_than_one_window(impl):
    """Rice codes longer than the decoder's 64-bit window (chunk_kernel_checks.rice_window_inputs)."""
    check_encode(impl, OP, ChunkLayout(2048, 1024, 0.1, "rice", "int2"), *rice_window_inputs(), 1.0, True)


SATURATION_DTYPES = {"reference": (torch.float32,), "cpu": (torch.float32,),  # the native kernels' dtype
                     "triton": tuple(FP16_SATURATION), "cuda": (torch.float32,)}


@pytest.mark.parametrize("impl,dtype", implementation_cases(OP, {
    family: [(dtype,) for dtype in dtypes] for family, dtypes in SATURATION_DTYPES.items()}))
def test_fp16_codec_saturation_conserves_every_finite_acc(impl, dtype):
    """kernel_cases.FP16_SATURATION on the fp16 value codec, in one chunk: each acc goes out as
    its hand-worked value, and sent + residual == acc up to float32's largest. Every CPU level:
    TestEveryCpuLevel."""
    acc, k = fp16_saturation_grad(dtype)
    n = acc.numel()
    layout = ChunkLayout(n, n, k / n, "chunk", "fp16")
    assert layout.capacity == k
    _, indices, decoded, residual = encode(impl, OP, layout, acc, torch.zeros(n, dtype=dtype), 1.0, True)
    check_fp16_saturation(acc, indices, decoded, residual)


@pytest.mark.parametrize("impl,chunk_size,density", implementation_cases(OP, {
    "cpu": [(4096, 0.01)], "triton": [(256, 0.05)], "cuda": [(4096, 0.01)]}))
def test_chunks_of_equal_keys_take_the_lowest_indices(impl, chunk_size, density):
    c = chunk_size
    layout = ChunkLayout(3 * c, c, density, "chunk", "fp32")
    grad = torch.zeros(3 * c)
    grad[c : 2 * c] = -2.0  # one chunk all ties, one all zeros, one of two tie classes
    grad[2 * c :: 2] = 1.0
    grad[2 * c + 1 :: 2] = -1.0
    (_, indices, _, _), _ = check_encode(impl, OP, layout, grad, None, 1.0, False)
    k = layout.geometry.k_full
    assert torch.equal(indices, torch.cat([torch.arange(k), c + torch.arange(k), 2 * c + torch.arange(k)]))


@pytest.mark.parametrize("impl", implementations(OP, "cpu", "cuda"))
@pytest.mark.parametrize("index_codec,value_codec", [("rice", "int2"), ("chunk", "fp32"), ("int32", "sign")])
@pytest.mark.parametrize("payload_offset", [1, 2, 3])
def test_into_an_unaligned_payload(impl, index_codec, value_codec, payload_offset):
    """A payload view at an odd byte offset (not 4-byte aligned): nothing written outside the view."""
    layout = ChunkLayout(10_003, 4096, 0.01, index_codec, value_codec)
    grad = chunk_data(10_003, 5, True)
    check_encode(impl, OP, layout, grad, grad * 0.25, 3.0, True, payload_offset=payload_offset)


@pytest.mark.parametrize("impl", implementations(OP, "cuda"))
@pytest.mark.parametrize("value_codec", ["fp32", "int4", "sign", "fp8"])
@pytest.mark.parametrize("index_codec", INDEX_CODECS)
def test_cuda_large_bucket_matches_the_cpu_kernel(impl, index_codec, value_codec):
    """2^24 + 1 entries (4097 chunks of 4096, the last of 1 entry): compared with the native
    CPU kernel (bit-identical to the reference, test_matches_the_reference), which is faster."""
    n = 2**24 + 1
    layout = ChunkLayout(n, 4096, 0.01, index_codec, value_codec)
    grad, residual = chunk_data(n, 7, True), chunk_data(n, 8, False) * 0.1
    r = residual.clone()
    payload = torch.empty(layout.nbytes, dtype=torch.uint8)
    indices, decoded = native.chunk_encode(grad, r, 3.0, True, layout, payload)
    check_encode(impl, OP, layout, grad, residual, 3.0, True, want=(payload, indices, decoded, r))


@pytest.mark.parametrize("impl", implementations(OP, "cuda"))
def test_cuda_is_deterministic(impl):
    layout = ChunkLayout(300_000, 4096, 0.01, "rice", "int4")
    grad, residual = ef_inputs(300_000, torch.float32, seed=3, kind="ties")
    first = encode(impl, OP, layout, grad, residual, 3.0, True)
    second = encode(impl, OP, layout, grad, residual, 3.0, True)
    for a, b, what in zip(first, second, ("payload", "indices", "decoded", "residual")):
        assert_same(a, b, f"{what}, run to run")


@pytest.mark.parametrize("impl", implementations(OP, "cpu"))
def test_cpu_argument_errors(impl):
    layout = ChunkLayout(1000, 100, 0.1, "chunk", "int8")
    geometry = layout.geometry
    payload = torch.empty(layout.nbytes, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="payload must be"):
        impl.ops.chunk_encode(torch.zeros(1000), None, 1.0, False, layout, payload[:-8])
    with pytest.raises(RuntimeError, match="float32"):
        impl.ops.chunk_encode(torch.zeros(1000, dtype=torch.float16), None, 1.0, False, layout, payload)
    with pytest.raises(RuntimeError, match="needs a residual"):
        impl.ops.chunk_encode(torch.zeros(1000), None, 1.0, True, layout, payload)
    with pytest.raises(RuntimeError, match="value_codec"):
        torch.ops.sparsecomm.chunk_encode(torch.zeros(1000), None, 1.0, False, 100, geometry.k_full,
                                          geometry.k_last, 1, 8, 0, payload)


@pytest.mark.parametrize("impl", implementations(OP, "triton"))
def test_triton_rejects_bad_arguments(impl):
    layout = ChunkLayout(1000, 100, 0.1, "chunk", "int8")
    grad = torch.zeros(1000, device=impl.device)
    payload = torch.empty(layout.nbytes, dtype=torch.uint8, device=impl.device)
    with pytest.raises(ValueError, match="payload must be"):
        impl.ops.chunk_encode(grad, None, 1.0, False, layout, payload[:-8])
    with pytest.raises(ValueError, match="needs a residual"):
        impl.ops.chunk_encode(grad, None, 1.0, True, layout, payload)
    with pytest.raises(ValueError, match="grad dtype"):
        impl.ops.chunk_encode(grad.double(), None, 1.0, False, layout, payload)
    with pytest.raises(ValueError, match="layout is for"):
        impl.ops.chunk_encode(grad[:999], None, 1.0, False, layout, payload)
    with pytest.raises(ValueError, match="scale_group"):
        impl.ops.chunk_encode(grad, None, 1.0, False, ChunkLayout(1000, 100, 0.1, "chunk", "int8", scale_group=4),
                              payload)
    assert impl.ops.chunk_unsupported(ChunkLayout(20_000, 16384, 0.01, "rice", "int4")) is not None
    assert impl.ops.chunk_unsupported(layout) is None


@pytest.mark.parametrize("impl", implementations(OP, "cuda"))
def test_cuda_rejects_bad_arguments(impl):
    layout = ChunkLayout(1000, 100, 0.1, "chunk", "int8")
    args = chunk_arguments(layout)
    grad = torch.zeros(1000, device=impl.device)
    payload = torch.empty(layout.nbytes, dtype=torch.uint8, device=impl.device)
    encode_op = torch.ops.sparsecomm.chunk_encode
    with pytest.raises(RuntimeError, match="payload must be"):
        encode_op(grad, None, 1.0, False, *args, payload[:-8])
    with pytest.raises(RuntimeError, match="float32"):
        encode_op(grad.half(), None, 1.0, False, *args, payload)
    with pytest.raises(RuntimeError, match="needs a residual"):
        encode_op(grad, None, 1.0, True, *args, payload)
    with pytest.raises(RuntimeError, match="may not alias"):
        encode_op(grad, grad, 1.0, True, *args, payload)
    with pytest.raises(RuntimeError, match="divisor"):
        encode_op(grad, None, 0.0, False, *args, payload)
    with pytest.raises(RuntimeError, match="value_codec"):
        encode_op(grad, None, 1.0, False, *args[:4], 8, payload)
    with pytest.raises(RuntimeError, match="k_full"):
        encode_op(grad, None, 1.0, False, 100, 101, 1, 1, 4, payload)
    with pytest.raises(RuntimeError, match="chunk_size"):
        encode_op(grad, None, 1.0, False, 1, 1, 1, 1, 4, payload)
    with pytest.raises(RuntimeError, match="device"):
        encode_op(grad, None, 1.0, False, *args, payload.cpu())


@pytest.mark.parametrize("impl,index_codec,value_codec", implementation_cases(OP, {
    "cpu": [("rice", "int2"), ("int32", "bf16"), ("chunk", "sign")],
    "cuda": [("rice", "int2"), ("int32", "bf16"), ("chunk", "sign"), ("rice", "fp16")]}))
def test_opcheck(impl, index_codec, value_codec):
    layout = ChunkLayout(10_003, 4096, 0.01, index_codec, value_codec)
    # Finite data: opcheck compares outputs of repeated runs, and NaN != NaN there.
    grad, residual = (x.to(impl.device) for x in (chunk_data(10_003, 0, False), chunk_data(10_003, 1, False)))
    payload = torch.empty(layout.nbytes, dtype=torch.uint8, device=impl.device)
    torch.library.opcheck(torch.ops.sparsecomm.chunk_encode.default,
                          (grad, residual, 3.0, True, *chunk_arguments(layout), payload))


@pytest.mark.parametrize("impl", implementations(OP, "cpu"))
def test_dispatch_takes_the_reference_where_the_kernel_does_not_apply(impl):
    layout = ChunkLayout(5000, 1024, 0.02, "rice", "int4")
    assert ops.dispatch.native_chunk_encode(torch.zeros(5000), layout)
    grad = chunk_data(5000, 3, True).to(torch.bfloat16)  # 16-bit gradients: the reference
    assert not ops.dispatch.native_chunk_encode(grad, layout)
    want = encode(REFERENCE, OP, layout, grad, grad * 0.5, 2.0, True)
    got = encode(DISPATCH, OP, layout, grad, grad * 0.5, 2.0, True)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(want, got))


@pytest.mark.parametrize("impl", implementations(OP, "triton")[1:])
def test_triton_no_host_synchronisation(impl):
    grad, residual = torch.randn(100_000, device=impl.device), torch.zeros(100_000, device=impl.device)
    for index_codec, value_codec in (("rice", "int4"), ("chunk", "bf16")):
        layout = ChunkLayout(100_000, 4096, 0.01, index_codec, value_codec)
        payload = torch.empty(layout.nbytes, dtype=torch.uint8, device=impl.device)
        assert_no_host_synchronisation(lambda: impl.ops.chunk_encode(grad, residual, 2.0, True, layout, payload))


@pytest.mark.parametrize("impl", implementations(OP, "cuda"))
def test_cuda_encode_and_decode_capture_in_a_cuda_graph(impl):
    """No host synchronisation: chunk_encode, and chunk_decode_add of its payload, capture in
    a CUDA graph, and replays are exact."""
    n = 1 << 20
    layout = ChunkLayout(n, 4096, 0.01, "rice", "int4")
    args = chunk_arguments(layout)
    gen = torch.Generator().manual_seed(0)
    start_residual = (torch.randn(n, generator=gen) * 0.1)
    grad = torch.randn(n, generator=gen).to(impl.device)
    residual = start_residual.to(impl.device)
    payload = torch.empty(layout.nbytes, dtype=torch.uint8, device=impl.device)
    gathered = torch.empty(2 * layout.nbytes, dtype=torch.uint8, device=impl.device)
    out = torch.empty(n, device=impl.device)

    def step():
        indices, decoded = torch.ops.sparsecomm.chunk_encode(grad, residual, 3.0, True, *args, payload)
        gathered[: layout.nbytes].copy_(payload)
        gathered[layout.nbytes:].copy_(payload)
        torch.ops.sparsecomm.chunk_decode_add(gathered, *args, out, True)
        return indices, decoded

    graph, (indices, decoded) = capture_in_a_cuda_graph(step)
    for seed in (1, 2):
        new_grad = torch.randn(n, generator=torch.Generator().manual_seed(seed))
        grad.copy_(new_grad)
        residual.copy_(start_residual)
        graph.replay()
        torch.cuda.synchronize()
        want_payload, want_indices, want_decoded, want_residual = encode(REFERENCE, OP, layout, new_grad,
                                                                         start_residual, 3.0, True)
        assert_same(payload, want_payload, "graph replay: payload")
        assert_same(indices, want_indices, "graph replay: indices")
        assert_same(decoded, want_decoded, "graph replay: decoded")
        assert_same(residual, want_residual, "graph replay: residual", nan_ok=False)
        want_out = torch.empty(n)
        reference.chunk_decode_add(torch.cat([want_payload, want_payload]), layout, want_out, True)
        assert_same(out, want_out, "graph replay: decode_add")


def _sm90_specs(triton_ops):
    """A few variants of every kernel of the chunk encoder (select, Rice starts, byte packing)."""
    encode_kernels = triton_ops.chunk_encode.__globals__
    i32, f32 = "i32", "fp32"
    select = dict(payload_ptr="*u8", idx_out_ptr="*i64", vcode_ptr="*i32", icode_ptr="*i32", n=i32, divisor=f32,
                  chunk_size=i32, chunks=i32, k_full=i32, k_last=i32)
    pack = dict(payload_ptr="*u8", icode_ptr="*i32", vcode_ptr="*i32", start_ptr="*i64", gap_ptr="*i32",
                index_start=i32, value_start=i32, value_end=i32, nbytes=i32, capacity=i32, chunks=i32, k_full=i32,
                r_full=i32, r_last=i32, search_steps=i32)
    return [
        (encode_kernels["_select_kernel"], dict(g_ptr="*fp32", r_ptr="*fp32", dec_out_ptr="*fp32", **select),
         dict(HAS_RESIDUAL=True, ADD_RESIDUAL=True, INDEX_CODEC=2, VALUE_CODEC=7, LIMIT=0.0, BLOCK=8192), 16),
        (encode_kernels["_select_kernel"], dict(g_ptr="*bf16", r_ptr="*bf16", dec_out_ptr="*fp16", **select),
         dict(HAS_RESIDUAL=True, ADD_RESIDUAL=False, INDEX_CODEC=1, VALUE_CODEC=2, LIMIT=65504.0, BLOCK=4096), 16),
        (encode_kernels["_select_kernel"], dict(g_ptr="*fp16", r_ptr="*fp16", dec_out_ptr="*fp32", **select),
         dict(HAS_RESIDUAL=False, ADD_RESIDUAL=False, INDEX_CODEC=0, VALUE_CODEC=3, LIMIT=0.0, BLOCK=128), 4),
        (encode_kernels["_rice_starts_kernel"], dict(icode_ptr="*i32", start_ptr="*i64", gap_ptr="*i32", chunks=i32,
                                                     k_full=i32, k_last=i32, r_full=i32, r_last=i32, bits_full=i32),
         dict(KBLOCK=64), 4),
        (encode_kernels["pack_kernel"], pack, dict(INDEX_CODEC=2, INDEX_BITS=1, VALUE_BITS=4, BLOCK=1024), 4),
        (encode_kernels["pack_kernel"], pack, dict(INDEX_CODEC=1, INDEX_BITS=12, VALUE_BITS=1, BLOCK=1024), 4),
        (encode_kernels["pack_kernel"], pack, dict(INDEX_CODEC=1, INDEX_BITS=27, VALUE_BITS=2, BLOCK=1024), 4),
    ]


def test_triton_kernels_compile_for_sm90_without_a_gpu():
    assert_triton_kernels_compile_for_sm90(_sm90_specs)


# --------------------------------------------------------------------------- in the hook


@NEEDS_NATIVE
@pytest.mark.parametrize("value_codec", ["int4", "fp32"])
def test_the_fused_hook_path_trains_bit_for_bit_like_the_reference(value_codec):
    # The native encoder forms acc itself (no compensation pass): fused_calls counts it.
    stats = assert_the_hook_trains_with_the_kernels_as_with_the_reference(
        dict(selector="chunk", chunk_size=512, index_codec="rice", value_codec=value_codec))
    for with_kernels, reference_only in stats:
        assert with_kernels["fused_calls"] == with_kernels["sparse_calls"] > 0 and reference_only["fused_calls"] == 0


# --------------------------------------------------------------------------- every CPU level


def cpu_level_cases() -> dict[str, LevelCase]:
    """Every codec pair on three geometries (3 chunks with a short last one; chunks of 100 at
    30%; the largest chunk), NaN and +-Inf among the values; and kernel_cases.FP16_SATURATION's
    float32 accs on the fp16 codec in one chunk, also checked against the hand-worked values."""
    cases = {}
    for n, chunk_size, density in ((10_003, 4096, 0.01), (1003, 100, 0.3), (65_537, 65_536, 0.002)):
        grad, residual = ef_inputs(n, torch.float32, seed=n + 3, kind="nonfinite")
        for index_codec, value_codec in PAIRS:
            layout = ChunkLayout(n, chunk_size, density, index_codec, value_codec)
            what = f"n={n} chunk_size={chunk_size} density={density} {index_codec}+{value_codec}"
            for divisor, add_residual, r in ((3.0, True, residual), (2.0, False, None)):
                cases[f"chunk_encode {what} residual={r is not None}"] = LevelCase(
                    level_encode_case(OP, grad, r, divisor, add_residual, layout))
    acc, k = fp16_saturation_grad(torch.float32)
    n = acc.numel()

    def check(outputs):
        _, indices, values, residual = outputs
        check_fp16_saturation(acc, indices, values, residual)

    cases[f"fp16 saturation chunk_encode n={n}"] = LevelCase(
        level_encode_case(OP, acc, torch.zeros(n), 1.0, True, ChunkLayout(n, n, k / n, "rice", "fp16")), check=check)
    return cases


class TestEveryCpuLevel(CpuLevelTests):
    cases = cpu_level_cases
