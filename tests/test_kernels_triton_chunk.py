"""The Triton chunk kernels (``chunk_encode``, ``chunk_decode_add``) against the reference.

The reference is ChunkLayout.encode of the compensated acc, and ChunkLayout.views + one
index_add_ per row (sparsecomm/ops/reference.py). The Triton kernels must write the same
payload bytes and the same bits of residual, indices and decoded values, and add the same
sums, for every index x value codec pair, grad dtypes float32/bfloat16/float16, every
error-feedback mode, geometries with a short last chunk (k_last < k_full), k = 1, density
1.0, tiny chunks (7 entries, one entry in all), and data with ties, zeros, subnormals and
+-Inf/NaN. NaN is compared NaN-aware where its bits come from float arithmetic or a float
conversion (float value codecs, decoded values, sums: any NaN matches any NaN, as in
tests/test_kernels_triton.py); scales, codes and residuals are compared bit for bit.

Backends as in tests/test_kernels_triton.py (whose :func:`_fresh_backend` this reuses): the
interpreter on CPU tensors (``TRITON_INTERPRET=1`` at a private import of the package), and
compiled kernels on CUDA when a GPU is present, with the oracle on CPU copies. The
interpreter is slow, so sizes are small (at most a few thousand entries) and the codec pairs
are spread over the error-feedback modes instead of crossed with all of them.
"""
import types

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from kernel_cases import FP16_SATURATION, check_fp16_saturation, fp16_saturation_grad  # noqa: E402
from test_kernels_chunk import _data  # noqa: E402
from test_kernels_triton import _assert_same, _fresh_backend, backend  # noqa: E402, F401  (backend: the fixture)

from sparsecomm.compress.chunk_layout import ChunkLayout  # noqa: E402
from sparsecomm.compress.index_codecs import INDEX_CODECS  # noqa: E402
from sparsecomm.compress.value_codecs import FLOAT_CODECS, VALUE_CODECS  # noqa: E402
from sparsecomm.ops import dispatch, native, reference  # noqa: E402

# The interpreter computes every lane with numpy, masked or not (Inf - Inf in unused lanes),
# and the sign scale takes min(2 m, ...) where 2 m may overflow (as the reference does).
pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|overflow) encountered:RuntimeWarning")

PAIRS = [(i, v) for i in INDEX_CODECS for v in VALUE_CODECS]
# (residual present, add_residual, divisor)
EF_MODES = [(True, True, 3.0), (True, False, 1.0), (False, False, 2.0)]
# (numel, chunk_size, density)
GEOMETRIES = [
    (1003, 64, 0.1),  # 16 chunks, the last of 43 entries: k_last 5 < k_full 7
    (777, 100, 0.3),  # chunk size not a power of two: 7-bit chunk indices, a last chunk of 77
    (1500, 256, 0.003),  # k = 1 in every chunk
    (62, 7, 0.5),  # 9 chunks shorter than a byte's worth of sign bits, the last of 6
    (64, 16, 1.0),  # everything sent
    (700, 300, 0.5),  # k = 150: long Rice chunks of r = 0 (unary gaps), the last of 100: k_last 50
    (5000, 4096, 0.01),  # the default chunk size: k 41, the last chunk of 904: k 10
    (1, 2, 0.5),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FLOAT_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}




# --------------------------------------------------------------------------- helpers

def _encode(impl, device, layout, grad, residual, divisor, add_residual):
    r = None if residual is None else residual.clone().to(device)
    payload = torch.full((layout.nbytes,), 0xAB, dtype=torch.uint8, device=device)  # every byte must be written
    g = grad.to(device)
    indices, decoded = impl.chunk_encode(g, r, divisor, add_residual, layout, payload)
    assert torch.equal(g.cpu().view(FLOAT_BITS[g.dtype]), grad.view(FLOAT_BITS[g.dtype])), "grad must not change"
    return payload.cpu(), indices.cpu(), decoded.cpu(), None if r is None else r.cpu()


def _assert_same_payload(layout, want, got, want_decoded):
    """Bytes equal, except the bits of NaN values of a float value codec (any NaN matches)."""
    ignore = torch.zeros(layout.nbytes, dtype=torch.bool)
    if layout.value_codec in FLOAT_CODECS:
        dtype = FLOAT_CODECS[layout.value_codec]
        start = layout.scale_bytes + layout.index_bytes
        nan = torch.isnan(want_decoded).nonzero().flatten()
        got_values = got[start : start + layout.capacity * dtype.itemsize].clone().view(dtype)
        assert bool(torch.isnan(got_values[nan]).all()), "a NaN value was not sent as NaN"
        for byte in range(dtype.itemsize):
            ignore[start + nan * dtype.itemsize + byte] = True
    bad = ((want != got) & ~ignore).nonzero().flatten()
    assert bad.numel() == 0, (f"{bad.numel()} payload bytes differ, first at {bad[:8].tolist()} "
                              f"(scales {layout.scale_bytes}, indices {layout.index_bytes} bytes): "
                              f"{want[bad[:8]].tolist()} vs {got[bad[:8]].tolist()}")


def _check_encode(ops, device, layout, grad, residual, divisor, add_residual):
    want = _encode(reference, torch.device("cpu"), layout, grad, residual, divisor, add_residual)
    got = _encode(ops, device, layout, grad, residual, divisor, add_residual)
    (p1, i1, d1, r1), (p2, i2, d2, r2) = want, got
    assert i1.dtype == i2.dtype == torch.int64 and torch.equal(i1, i2), "indices differ"
    _assert_same(d2, d1, "decoded values")
    _assert_same_payload(layout, p1, p2, d1)
    assert (r1 is None) == (r2 is None)
    if r1 is not None:
        _assert_same(r2, r1, "residual", nan_ok=False)
    return p1


def _check_decode_add(ops, device, layout, gathered, out_dtype, seed=0, zero_outs=(True, False)):
    for zero_out in zero_outs:
        start = torch.randn(layout.numel + 1, generator=torch.Generator().manual_seed(seed))[1:].to(out_dtype)
        want, got = start.clone(), start.clone().to(device)
        reference.chunk_decode_add(gathered, layout, want, zero_out)
        ops.chunk_decode_add(gathered.to(device), layout, got, zero_out)
        _assert_same(got, want, f"decode_add (zero_out={zero_out})")


def _check_layout(ops, device, layout, dtype, nonfinite, modes=EF_MODES, seed=0, scale=1.0):
    n = layout.numel
    grad = (_data(n, seed=n + seed, nonfinite=nonfinite) * scale).to(dtype)
    residual = (_data(n, seed=n + seed + 1, nonfinite=False) * 0.1 * scale).to(dtype)
    payloads = [_check_encode(ops, device, layout, grad, residual if has else None, divisor, add)
                for has, add, divisor in modes]
    return torch.cat(payloads)  # one row per mode: different selections


# --------------------------------------------------------------------------- encode + decode_add

@pytest.mark.parametrize("index_codec,value_codec", PAIRS)
def test_every_codec_pair_matches_the_reference(backend, index_codec, value_codec):
    ops, device = backend
    layout = ChunkLayout(299, 64, 0.1, index_codec, value_codec)  # 5 chunks, the last of 43: k_last 5 < k_full 7
    mode = EF_MODES[PAIRS.index((index_codec, value_codec)) % len(EF_MODES)]
    gathered = torch.cat([_check_layout(ops, device, layout, torch.float32, True, [mode]),
                          _check_layout(ops, device, layout, torch.float32, False, [mode], seed=7)])
    _check_decode_add(ops, device, layout, gathered, torch.float32)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "n={}-c={}-d={}".format(*g))
def test_geometries_match_the_reference(backend, geometry):
    ops, device = backend
    n, chunk_size, density = geometry
    # Sub-byte fields shared by adjacent chunks (chunk indices, int4/int2/sign, Rice codes).
    for index_codec, value_codec in (("chunk", "int2"), ("rice", "sign"), ("int32", "int4")):
        layout = ChunkLayout(n, chunk_size, density, index_codec, value_codec)
        modes = EF_MODES[:1] if layout.geometry.k_full > 100 else EF_MODES[:2]  # the interpreter walks Rice codes
        gathered = _check_layout(ops, device, layout, torch.float32, nonfinite=n >= 8, modes=modes)
        # Sums onto the bucket's values; zero_out=True only zeroes the bucket first and then runs
        # the same kernels (both values run in the other tests).
        _check_decode_add(ops, device, layout, gathered, torch.float32, zero_outs=(False,))


@pytest.mark.slow  # CI time on the interpreter; scripts/gpu_check.sh runs it (-m "")
@pytest.mark.parametrize("dtype", DTYPES[1:], ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("value_codec", VALUE_CODECS)
def test_16_bit_gradients_match_the_reference(backend, dtype, value_codec):
    """bf16/fp16 acc: compensation in the gradient's dtype, saturation (fp16 values of bf16
    gradients), the residual of a decoded value rounded to T, 16-bit buckets."""
    ops, device = backend
    index_codec = INDEX_CODECS[VALUE_CODECS.index(value_codec) % len(INDEX_CODECS)]
    layout = ChunkLayout(377, 100, 0.3, index_codec, value_codec)  # 4 chunks, the last of 77: k_last 24 < 30
    scale = 1e4 if dtype == torch.bfloat16 else 1.0  # bf16 values beyond fp16's range
    gathered = _check_layout(ops, device, layout, dtype, True, EF_MODES[:1] + EF_MODES[2:], scale=scale)
    _check_decode_add(ops, device, layout, gathered, dtype)


@pytest.mark.parametrize("out_dtype", DTYPES[1:], ids=lambda d: str(d).replace("torch.", ""))
def test_decode_add_into_16_bit_buckets_from_float32_payloads(backend, out_dtype):
    ops, device = backend
    for value_codec in ("fp32", "bf16", "fp16", "int4"):
        layout = ChunkLayout(1003, 64, 0.1, "chunk", value_codec)
        rows = []
        for seed in range(3):
            payload = torch.empty(layout.nbytes, dtype=torch.uint8)
            reference.chunk_encode(_data(1003, seed, seed == 1) * 100, None, 1.0, False, layout, payload)
            rows.append(payload)
        _check_decode_add(ops, device, layout, torch.cat(rows), out_dtype)


def test_decode_add_reads_sealed_rows(backend):
    """Payloads farther apart than their size (each followed by its 8-byte seal on the wire):
    a [rows, nbytes] view with a longer row stride decodes as back-to-back ones do."""
    ops, device = backend
    for index_codec in ("int32", "rice"):
        layout = ChunkLayout(299, 64, 0.1, index_codec, "int4")
        sealed = torch.full((3, layout.nbytes + 8), 0xEE, dtype=torch.uint8)
        for seed in range(3):
            reference.chunk_encode(_data(299, seed, False), None, 1.0, False, layout, sealed[seed, : layout.nbytes])
        want, got = torch.zeros(299), torch.full((299,), 5.0, device=device)
        reference.chunk_decode_add(sealed[:, : layout.nbytes].reshape(-1), layout, want, True)
        ops.chunk_decode_add(sealed.to(device)[:, : layout.nbytes], layout, got, True)
        _assert_same(got, want, f"decode_add of sealed rows ({index_codec})")


def test_ties_take_the_lowest_indices(backend):
    ops, device = backend
    layout = ChunkLayout(3 * 256, 256, 0.05, "chunk", "fp32")
    grad = torch.zeros(3 * 256)
    grad[256:512] = -2.0  # one chunk all ties, one all zeros, one of two tie classes
    grad[512::2] = 1.0
    grad[513::2] = -1.0
    _check_encode(ops, device, layout, grad, None, 1.0, False)
    indices = _encode(ops, device, layout, grad, None, 1.0, False)[1]
    k = layout.geometry.k_full
    assert torch.equal(indices, torch.cat([torch.arange(k), 256 + torch.arange(k), 512 + torch.arange(k)]))


def test_non_finite_chunks_and_saturation(backend):
    """A chunk whose selection holds a NaN (scale NaN), one with only +-Inf (scale +Inf), one
    all-NaN, values beyond fp16 and bf16; the finite entries of those chunks stay in the residual."""
    ops, device = backend
    grad = torch.randn(400, generator=torch.Generator().manual_seed(3))
    grad[5] = float("nan")
    grad[100:103] = torch.tensor([float("inf"), -float("inf"), 7e4])
    grad[200:300] = float("nan")
    grad[300:304] = torch.tensor([3.3896e38, -3.4e38, 65520.0, -1e6])
    residual = torch.randn(400, generator=torch.Generator().manual_seed(4))
    for value_codec in VALUE_CODECS:
        layout = ChunkLayout(400, 100, 0.05, "chunk", value_codec)
        _check_encode(ops, device, layout, grad, residual, 1.0, True)


@pytest.mark.parametrize("dtype", list(FP16_SATURATION), ids=lambda d: str(d).replace("torch.", ""))
def test_fp16_codec_saturation_conserves_every_finite_acc(backend, dtype):
    """kernel_cases.FP16_SATURATION on the fp16 value codec, one chunk and exact top-k on the
    compact wire: each acc goes out as its hand-worked value, and sent + residual == acc."""
    ops, device = backend
    acc, k = fp16_saturation_grad(dtype)
    n = acc.numel()
    for layout in (ChunkLayout(n, n, k / n, "chunk", "fp16"), ChunkLayout(n, n, k / n, "rice", "fp16", scale_group=64)):
        assert layout.capacity == k
        residual = torch.zeros(n, dtype=dtype, device=device)
        payload = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
        indices, decoded = ops.chunk_encode(acc.to(device), residual, 1.0, True, layout, payload)
        check_fp16_saturation(acc, indices, decoded, residual)


def test_rice_codes_longer_than_one_window(backend):
    """A chunk whose selection sits at its end: a first gap of 921 with r = 3, a unary run of
    115 ones (longer than the decoder's 64-bit window); the next chunk's at its start (gaps 0)."""
    ops, device = backend
    grad = torch.randn(2048, generator=torch.Generator().manual_seed(5)) * 0.01
    grad[1024 - 103 : 1024] = 5.0
    grad[1024 : 1024 + 103] = -5.0
    layout = ChunkLayout(2048, 1024, 0.1, "rice", "int2")
    gathered = _check_encode(ops, device, layout, grad, torch.zeros(2048), 1.0, True)
    _check_decode_add(ops, device, layout, gathered, torch.float32)


# --------------------------------------------------------------------------- errors, no sync, compiles

def test_rejects_bad_arguments(backend):
    ops, device = backend
    layout = ChunkLayout(1000, 100, 0.1, "chunk", "int8")
    grad = torch.zeros(1000, device=device)
    payload = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="payload must be"):
        ops.chunk_encode(grad, None, 1.0, False, layout, payload[:-8])
    with pytest.raises(ValueError, match="needs a residual"):
        ops.chunk_encode(grad, None, 1.0, True, layout, payload)
    with pytest.raises(ValueError, match="grad dtype"):
        ops.chunk_encode(grad.double(), None, 1.0, False, layout, payload)
    with pytest.raises(ValueError, match="layout is for"):
        ops.chunk_encode(grad[:999], None, 1.0, False, layout, payload)
    with pytest.raises(ValueError, match="scale_group"):
        ops.chunk_encode(grad, None, 1.0, False, ChunkLayout(1000, 100, 0.1, "chunk", "int8", scale_group=4),
                         payload)
    with pytest.raises(ValueError, match="gathered must be"):
        ops.chunk_decode_add(payload[:-1], layout, grad)
    assert ops.chunk_unsupported(ChunkLayout(20_000, 16384, 0.01, "rice", "int4")) is not None
    assert ops.chunk_unsupported(layout) is None


def test_a_corrupt_payload_writes_nothing_outside_its_chunks(backend):
    ops, device = backend
    for index_codec in ("int32", "chunk", "rice"):
        layout = ChunkLayout(1000, 100, 0.1, index_codec, "fp32")
        payload = torch.empty(layout.nbytes, dtype=torch.uint8)
        reference.chunk_encode(torch.randn(1000), None, 1.0, False, layout, payload)
        payload[: layout.index_bytes] = 0xFF  # int32: index -1; chunk: 127 >= 100; rice: all ones
        out = torch.zeros(1002, device=device)
        ops.chunk_decode_add(payload.to(device), layout, out[1:-1])
        assert int(torch.count_nonzero(out)) == 0, index_codec  # every entry dropped, none outside


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (sync debug mode)")
def test_no_host_synchronisation_on_cuda():
    ops = _fresh_backend(interpret=False)
    device = torch.device("cuda")
    grad, residual = torch.randn(100_000, device=device), torch.zeros(100_000, device=device)
    layouts = [ChunkLayout(100_000, 4096, 0.01, i, v) for i, v in (("rice", "int4"), ("chunk", "bf16"))]
    payloads = [torch.empty(layout.nbytes, dtype=torch.uint8, device=device) for layout in layouts]
    for layout, payload in zip(layouts, payloads):  # warm up: compilation may synchronise
        ops.chunk_encode(grad, residual, 2.0, True, layout, payload)
        ops.chunk_decode_add(torch.cat([payload, payload]), layout, grad.clone())
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for layout, payload in zip(layouts, payloads):
            ops.chunk_encode(grad, residual, 2.0, True, layout, payload)
            ops.chunk_decode_add(torch.cat([payload, payload]), layout, grad.clone(), False)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()


def test_kernels_compile_for_sm90_without_a_gpu():
    """A few variants of every chunk kernel through Triton's whole CUDA pipeline (to cubin)."""
    import triton
    from triton.compiler import ASTSource

    try:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except Exception as error:  # pragma: no cover - a Triton without the NVIDIA backend
        pytest.skip(f"Triton's NVIDIA backend is unavailable: {error}")
    ops = _fresh_backend(interpret=False)
    encode, decode = ops.chunk_encode.__globals__, ops.chunk_decode_add.__globals__
    i32, f32 = "i32", "fp32"
    select = dict(payload_ptr="*u8", idx_out_ptr="*i64", vcode_ptr="*i32", icode_ptr="*i32", n=i32, divisor=f32,
                  chunk_size=i32, chunks=i32, k_full=i32, k_last=i32)
    pack = dict(payload_ptr="*u8", icode_ptr="*i32", vcode_ptr="*i32", start_ptr="*i64", gap_ptr="*i32",
                index_start=i32, value_start=i32, value_end=i32, nbytes=i32, capacity=i32, chunks=i32, k_full=i32,
                r_full=i32, r_last=i32, search_steps=i32)
    add = dict(row_ptr="*u8", index_ptr="*i32", chunk_size=i32, chunks=i32, last_length=i32, k_full=i32,
               capacity=i32, scale_group=i32, index_start=i32, value_start=i32, value_end=i32)
    compact = encode["compact_encode"].__globals__
    group = dict(idx_ptr="*i32", val_ptr="*fp32", payload_ptr="*u8", idx_out_ptr="*i64", vcode_ptr="*i32",
                 capacity=i32, scale_group=i32)
    specs = [
        (encode["_select_kernel"], dict(g_ptr="*fp32", r_ptr="*fp32", dec_out_ptr="*fp32", **select),
         dict(HAS_RESIDUAL=True, ADD_RESIDUAL=True, INDEX_CODEC=2, VALUE_CODEC=7, LIMIT=0.0, BLOCK=8192), 16),
        (encode["_select_kernel"], dict(g_ptr="*bf16", r_ptr="*bf16", dec_out_ptr="*fp16", **select),
         dict(HAS_RESIDUAL=True, ADD_RESIDUAL=False, INDEX_CODEC=1, VALUE_CODEC=2, LIMIT=65504.0, BLOCK=4096), 16),
        (encode["_select_kernel"], dict(g_ptr="*fp16", r_ptr="*fp16", dec_out_ptr="*fp32", **select),
         dict(HAS_RESIDUAL=False, ADD_RESIDUAL=False, INDEX_CODEC=0, VALUE_CODEC=3, LIMIT=0.0, BLOCK=128), 4),
        (encode["_rice_starts_kernel"], dict(icode_ptr="*i32", start_ptr="*i64", gap_ptr="*i32", chunks=i32,
                                             k_full=i32, k_last=i32, r_full=i32, r_last=i32, bits_full=i32),
         dict(KBLOCK=64), 4),
        (encode["pack_kernel"], pack, dict(INDEX_CODEC=2, INDEX_BITS=1, VALUE_BITS=4, BLOCK=1024), 4),
        (encode["pack_kernel"], pack, dict(INDEX_CODEC=1, INDEX_BITS=12, VALUE_BITS=1, BLOCK=1024), 4),
        (encode["pack_kernel"], pack, dict(INDEX_CODEC=1, INDEX_BITS=27, VALUE_BITS=2, BLOCK=1024), 4),
        (compact["_group_kernel"], dict(group, r_ptr="*fp32", dec_out_ptr="*fp32"),
         dict(HAS_RESIDUAL=True, VALUE_CODEC=5, LIMIT=0.0, GROUP=64), 4),
        (compact["_group_kernel"], dict(group, r_ptr="*bf16", dec_out_ptr="*fp16"),
         dict(HAS_RESIDUAL=True, VALUE_CODEC=2, LIMIT=65504.0, GROUP=64), 4),
        (decode["_rice_decode_kernel"], dict(gathered_ptr="*u8", index_ptr="*i32", row_stride=i32, index_start=i32,
                                             index_bytes=i32, chunk_size=i32, chunks=i32, last_length=i32,
                                             k_full=i32, k_last=i32, r_full=i32, r_last=i32, bits_full=i32,
                                             bits_last=i32, capacity=i32), {}, 1),
        (decode["_add_row_kernel"], dict(out_ptr="*bf16", **add),
         dict(INDEX_CODEC=2, INDEX_BITS=1, VALUE_CODEC=3, VALUE_BITS=8, BLOCK=1024), 4),
        (decode["_add_row_kernel"], dict(out_ptr="*fp32", **add),
         dict(INDEX_CODEC=1, INDEX_BITS=7, VALUE_CODEC=1, VALUE_BITS=16, BLOCK=1024), 4),
    ]
    target = GPUTarget("cuda", 90, 32)
    for kernel, signature_types, constexprs, num_warps in specs:
        signature = {name: signature_types.get(name, "constexpr") for name in kernel.arg_names}
        assert set(signature) == set(signature_types) | set(constexprs), (kernel.__name__, signature)
        compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=target,
                                  options={"num_warps": num_warps, "enable_fp_fusion": False})
        ptx = compiled.asm["ptx"]
        assert "div.full" not in ptx and "div.approx" not in ptx, f"{kernel.__name__}: inexact division"
        assert ".ftz" not in ptx, f"{kernel.__name__}: flushes subnormals"


# --------------------------------------------------------------------------- exact top-k on the compact wire

def _compact(n, density, index_codec, value_codec):
    return ChunkLayout(n, n, density, index_codec, value_codec, scale_group=64)


@pytest.mark.parametrize("index_codec,value_codec", PAIRS)
def test_compact_wire_every_codec_pair_matches_the_reference(backend, index_codec, value_codec):
    """One chunk of the whole bucket, a scale per 64 payload entries (compact_encode.py): 1003
    entries at 10% (k = 101: neither a multiple of 64), ties, zeros, subnormals, +-Inf/NaN."""
    ops, device = backend
    layout = _compact(1003, 0.1, index_codec, value_codec)
    mode = EF_MODES[PAIRS.index((index_codec, value_codec)) % len(EF_MODES)]
    gathered = torch.cat([_check_layout(ops, device, layout, torch.float32, True, [mode]),
                          _check_layout(ops, device, layout, torch.float32, False, [mode], seed=7)])
    _check_decode_add(ops, device, layout, gathered, torch.float32)


@pytest.mark.slow  # CI time on the interpreter; scripts/gpu_check.sh runs it (-m "")
@pytest.mark.parametrize("dtype", DTYPES[1:], ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("value_codec", ["bf16", "fp16", "int4", "sign"])
def test_compact_wire_16_bit_gradients_match_the_reference(backend, dtype, value_codec):
    ops, device = backend
    layout = _compact(377, 0.3, "rice", value_codec)  # k = 114
    scale = 1e4 if dtype == torch.bfloat16 else 1.0
    gathered = _check_layout(ops, device, layout, dtype, True, EF_MODES[:1] + EF_MODES[2:], scale=scale)
    _check_decode_add(ops, device, layout, gathered, dtype)


@pytest.mark.parametrize("geometry", [(64, 1.0), (1, 0.5), (700, 0.5)], ids=lambda g: "n={}-d={}".format(*g))
def test_compact_wire_geometries_and_ties(backend, geometry):
    ops, device = backend
    n, density = geometry
    for index_codec, value_codec in (("chunk", "int2"), ("rice", "sign"), ("int32", "fp8")):
        layout = _compact(n, density, index_codec, value_codec)
        _check_decode_add(ops, device, layout, _check_layout(ops, device, layout, torch.float32, n >= 8, EF_MODES[:1]),
                          torch.float32, zero_outs=(False,))
    grad = torch.ones(700)
    grad[1::2] = -1.0  # all ties: the lowest indices
    indices = _encode(ops, device, _compact(700, 0.1, "chunk", "int4"), grad, None, 1.0, False)[1]
    assert torch.equal(indices, torch.arange(70))


# --------------------------------------------------------------------------- dispatch

def _cuda_like(dtype=torch.float32):
    """What _chunk_implementation reads of a tensor: its device type and dtype."""
    return types.SimpleNamespace(device=types.SimpleNamespace(type="cuda"), dtype=dtype)


@pytest.fixture
def fake_cuda(monkeypatch):
    """The dispatch as on a CUDA machine: Triton usable, a native CUDA kernel when asked."""
    from sparsecomm.ops import triton as triton_ops

    monkeypatch.delenv(native.KERNELS_ENV, raising=False)
    monkeypatch.setattr(triton_ops, "available", lambda device_type="cuda": (True, ""))
    state = {"native_cuda": False}
    monkeypatch.setattr(native, "load", lambda: (True, ""))
    monkeypatch.setattr(native, "has_kernel", lambda op, key: key == "CPU" or state["native_cuda"])
    return triton_ops, state


def test_dispatch_on_cuda(fake_cuda, monkeypatch):
    triton_ops, state = fake_cuda
    layout = ChunkLayout(10_000, 4096, 0.01, "rice", "int4")
    pick = dispatch._chunk_implementation
    # No native CUDA kernel: Triton, for 16-bit gradients too; the decode likewise.
    assert pick("chunk_encode", _cuda_like(), layout) is triton_ops.chunk_encode
    assert pick("chunk_encode", _cuda_like(torch.bfloat16), layout) is triton_ops.chunk_encode
    assert pick("chunk_decode_add", _cuda_like(torch.float16), layout) is triton_ops.chunk_decode_add
    # What the Triton kernels do not take: the reference.
    assert pick("chunk_encode", _cuda_like(), ChunkLayout(40_000, 16384, 0.01, "rice", "int4")) \
        is reference.chunk_encode
    assert pick("chunk_encode", _cuda_like(), ChunkLayout(10_000, 4096, 0.01, "rice", "int4", scale_group=64)) \
        is reference.chunk_encode
    # Exact top-k on the compact wire (a scale_group, one chunk): Triton (compact_encode.py).
    compact = ChunkLayout(10_000, 10_000, 0.01, "rice", "int4", scale_group=64)
    assert pick("chunk_encode", _cuda_like(torch.float16), compact) is triton_ops.chunk_encode
    assert pick("chunk_decode_add", _cuda_like(), compact) is triton_ops.chunk_decode_add
    assert pick("chunk_encode", _cuda_like(torch.float64), layout) is reference.chunk_encode
    # A native CUDA kernel wins (float32 gradients), unless SPARSECOMM_KERNELS=triton.
    state["native_cuda"] = True
    assert pick("chunk_encode", _cuda_like(), layout) is native.chunk_encode
    assert pick("chunk_decode_add", _cuda_like(torch.bfloat16), layout) is native.chunk_decode_add
    assert pick("chunk_encode", _cuda_like(torch.bfloat16), layout) is triton_ops.chunk_encode
    assert pick("chunk_encode", _cuda_like(), ChunkLayout(70_000, 65536, 0.01, "rice", "int4")) \
        is native.chunk_encode
    assert pick("chunk_encode", _cuda_like(), compact) is triton_ops.chunk_encode  # no CUDA kernel takes it
    monkeypatch.setenv(native.KERNELS_ENV, "triton")
    assert pick("chunk_encode", _cuda_like(), layout) is triton_ops.chunk_encode
    monkeypatch.setenv(native.KERNELS_ENV, "native")
    assert pick("chunk_encode", _cuda_like(), layout) is native.chunk_encode
    monkeypatch.setenv(native.KERNELS_ENV, "reference")
    assert pick("chunk_encode", _cuda_like(), layout) is reference.chunk_encode
    assert pick("chunk_decode_add", _cuda_like(), layout) is reference.chunk_decode_add
    assert not dispatch.native_chunk_encode(_cuda_like(), layout)
    # Neither: native required raises, auto warns once and takes the reference.
    state["native_cuda"] = False
    monkeypatch.setenv(native.KERNELS_ENV, "native")
    with pytest.raises(RuntimeError, match="SPARSECOMM_KERNELS=native"):
        pick("chunk_encode", _cuda_like(), layout)
    monkeypatch.delenv(native.KERNELS_ENV)
    assert dispatch.native_chunk_encode(_cuda_like(), layout)  # Triton is a kernel
    monkeypatch.setattr(triton_ops, "available", lambda device_type="cuda": (False, "no triton (test)"))
    native.warn_unavailable.cache_clear()
    with pytest.warns(native.NativeKernelsUnavailableWarning, match="no triton"):
        assert pick("chunk_encode", _cuda_like(), layout) is reference.chunk_encode
        assert not dispatch.native_chunk_encode(_cuda_like(), layout)
    native.warn_unavailable.cache_clear()


@pytest.mark.skipif(not native.load()[0], reason=f"native extension not built: {native.load()[1]}")
def test_dispatch_on_cpu_keeps_the_native_kernels(monkeypatch):
    monkeypatch.delenv(native.KERNELS_ENV, raising=False)
    layout = ChunkLayout(5000, 1024, 0.02, "rice", "int4")
    grad = torch.zeros(5000)
    assert dispatch._chunk_implementation("chunk_encode", grad, layout) is native.chunk_encode
    assert dispatch._chunk_implementation("chunk_decode_add", grad, layout) is native.chunk_decode_add
    assert dispatch.native_chunk_encode(grad, layout)
    assert not dispatch.native_chunk_encode(grad.bfloat16(), layout)  # 16-bit: the reference on CPU
    monkeypatch.setenv(native.KERNELS_ENV, "triton")  # Triton never runs on CPU tensors
    assert dispatch._chunk_implementation("chunk_encode", grad, layout) is native.chunk_encode
    monkeypatch.setenv(native.KERNELS_ENV, "reference")
    assert dispatch._chunk_implementation("chunk_encode", grad, layout) is reference.chunk_encode
    assert not dispatch.native_chunk_encode(grad, layout)
