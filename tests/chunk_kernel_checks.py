"""Running the encoders and decoders of a chunked payload (``chunk_encode`` /
``chunk_decode_add``, and ``exact_topk_encode`` / ``exact_topk_decode_add``, the same format
with one chunk and a scale per group of entries) on an implementation
(tests/kernel_implementations.py), and comparing with the reference.

The reference is ChunkLayout.encode of the compensated acc, and ChunkLayout.views + one
index_add_ per row (sparsecomm/ops/reference.py). An encoder must write the same payload
bytes and the same bits of residual, indices and decoded values; on the CPU NaN bits included,
elsewhere (GPU arithmetic makes every NaN acc the canonical NaN, x86 keeps the operand's) the
float value codes and decoded values are compared as values, NaN matching NaN, and everything
else byte for byte: the scales, the index region, the codes of the scaled codecs, the zero
padding, indices, and the residual (never NaN). Sums are compared with NaN at the same places
(the bits of NaN + x are unspecified) and all else bitwise.
"""
import torch
from kernel_cases import chunk_data, ef_inputs
from kernel_implementations import DISPATCH, REFERENCE, assert_same, bits, precomputed

from sparsecomm.compress.chunk_layout import ChunkLayout
from sparsecomm.compress.index_codecs import INDEX_CODECS
from sparsecomm.compress.owner_layout import EXACT_SCALE_GROUP
from sparsecomm.compress.value_codecs import FLOAT_CODECS, VALUE_CODECS
from sparsecomm.ops import reference

PAIRS = [(i, v) for i in INDEX_CODECS for v in VALUE_CODECS]
# (divisor, add_residual, residual given): add the residual with divisor 3, overwrite it with
# divisor 1, no residual with divisor 2.
EF_MODES = [(3.0, True, True), (1.0, False, True), (2.0, False, False)]
ALL_MODES = tuple(range(len(EF_MODES)))

# (numel, chunk_size, density) of the chunked layouts each family is tested on.
CPU_GEOMETRIES = [
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
CUDA_GEOMETRIES = [
    (10_003, 4096, 0.01),   # 3 chunks, the last of 1811 entries: k_last 19 < k_full 41
    (10_003, 4096, 1e-5),   # k = 1 everywhere
    (70_001, 65_536, 0.001),  # the largest chunk (not cached), last chunk 4465 entries
    (30_000, 12_288, 0.2),  # not cached, k > one emit tile
    (5000, 4096, 0.5),      # k = 2048: a whole emit tile of ties and selections
    (1003, 64, 0.1),
    (300, 7, 0.5),          # chunks shorter than a warp; 3-bit chunk indices
    (64, 16, 1.0),          # everything sent
    (1, 2, 0.5),
]
# The Triton interpreter is slow: small layouts, and the codec pairs spread over the
# error-feedback modes instead of crossed with all of them (triton_cases).
TRITON_EVERY_PAIR_GEOMETRY = (299, 64, 0.1)  # 5 chunks, the last of 43: k_last 5 < k_full 7
TRITON_GEOMETRIES = [
    (1003, 64, 0.1),  # 16 chunks, the last of 43 entries: k_last 5 < k_full 7
    (777, 100, 0.3),  # chunk size not a power of two: 7-bit chunk indices, a last chunk of 77
    (1500, 256, 0.003),  # k = 1 in every chunk
    (62, 7, 0.5),  # 9 chunks shorter than a byte's worth of sign bits, the last of 6
    (64, 16, 1.0),  # everything sent
    (700, 300, 0.5),  # k = 150: long Rice chunks of r = 0 (unary gaps), the last of 100: k_last 50
    (5000, 4096, 0.01),  # the default chunk size: k 41, the last chunk of 904: k 10
    (1, 2, 0.5),
]
# Sub-byte fields shared by adjacent chunks (chunk indices, int4/int2/sign, Rice codes).
TRITON_GEOMETRY_PAIRS = [("chunk", "int2"), ("rice", "sign"), ("int32", "int4")]


def pair_mode(index_codec, value_codec) -> int:
    """The error-feedback mode a codec pair runs in on the interpreter (pairs spread over modes)."""
    return PAIRS.index((index_codec, value_codec)) % len(EF_MODES)


def triton_geometry_modes(layout) -> tuple:
    """The modes of a layout of TRITON_GEOMETRIES: the first, or the first two where k_full
    <= 100 (the interpreter walks Rice codes one by one)."""
    return (0,) if layout.geometry.k_full > 100 else (0, 1)


def layout_inputs(n, nonfinite, seed=0):
    """The gradient and residual of a layout's tests (kernel_cases.chunk_data)."""
    return chunk_data(n, seed=n + seed, nonfinite=nonfinite), chunk_data(n, seed=n + seed + 1, nonfinite=False) * 0.1


def sixteen_bit_layout(value_codec):
    """4 chunks, the last of 77: k_last 24 < 30; each value codec with an index codec of its own."""
    return ChunkLayout(377, 100, 0.3, INDEX_CODECS[VALUE_CODECS.index(value_codec) % len(INDEX_CODECS)], value_codec)


def sixteen_bit_inputs(layout, dtype):
    """bf16/fp16 gradient and residual with NaN/+-Inf; bf16 values beyond fp16's range."""
    scale = 1e4 if dtype == torch.bfloat16 else 1.0
    grad, residual = layout_inputs(layout.numel, True)
    return (grad * scale).to(dtype), (residual * scale).to(dtype)


def rice_window_inputs():
    """A chunk whose selection sits at its end: a first gap of 921 with r = 3, a unary run of
    115 ones (longer than the decoder's 64-bit window); the next chunk's at its start (gaps 0):
    for ChunkLayout(2048, 1024, 0.1, "rice", "int2")."""
    grad = torch.randn(2048, generator=torch.Generator().manual_seed(5)) * 0.01
    grad[1024 - 103 : 1024] = 5.0
    grad[1024 : 1024 + 103] = -5.0
    return grad, torch.zeros(2048)


# --------------------------------------------------------------------------- exact top-k on the compact wire
#
# ChunkLayout(numel, numel, density, codecs, scale_group=64): one chunk of the whole bucket, a
# bf16 scale per 64 payload entries (exact_topk_encode, exact_topk_decode_add).

EXACT_SAMPLED = 2**20 + 3  # the selection's sampled one-pass strategy starts at 2^20 entries
EXACT_SAMPLED_PAIRS = [("rice", "int4"), ("rice", "int2"), ("chunk", "sign"), ("int32", "fp32"), ("rice", "bf16"),
                       ("chunk", "fp8")]
# (numel, density): k = ceil(density * numel)
EXACT_CPU_GEOMETRIES = [
    (10_003, 0.01),  # k = 101: neither numel nor k a multiple of 64
    (6400, 0.01),  # k = 64: one whole group
    (1003, 0.3),  # k = 301
    (777, 0.5),  # k = 389, more than the two-pass strategy's first bin holds
    (64, 1.0),  # everything sent
    (1, 0.5),  # one entry
]
# The interpreter: every pair on 1003 entries at 10% (k = 101: neither a multiple of 64), in the
# pair's mode; three pairs on a few geometries in the first mode.
EXACT_TRITON_EVERY_PAIR_GEOMETRY = (1003, 0.1)
EXACT_TRITON_GEOMETRIES = [(64, 1.0), (1, 0.5), (700, 0.5)]
EXACT_TRITON_GEOMETRY_PAIRS = [("chunk", "int2"), ("rice", "sign"), ("int32", "fp8")]
EXACT_SIXTEEN_BIT_VALUE_CODECS = ["bf16", "fp16", "int4", "sign"]


def exact_layout(n, density, index_codec, value_codec):
    """The layout of exact top-k on the compact wire for a bucket of ``n`` entries."""
    return ChunkLayout(n, n, density, index_codec, value_codec, scale_group=EXACT_SCALE_GROUP)


def exact_sixteen_bit_layout(value_codec):
    return exact_layout(377, 0.3, "rice", value_codec)  # k = 114


def large_bucket_inputs():
    """The gradient (with NaN/+-Inf) and residual of a bucket of EXACT_SAMPLED entries."""
    return chunk_data(EXACT_SAMPLED, seed=5, nonfinite=True), chunk_data(EXACT_SAMPLED, seed=6, nonfinite=False) * 0.1


def sampled_positions(n: int) -> torch.Tensor:
    """The entries the sampled strategy reads (csrc/cpu/sampled_candidates.h: 2048 evenly
    spaced runs of 32)."""
    runs = torch.arange(2048) * (n - 32) // 2047
    return (runs.unsqueeze(1) + torch.arange(32)).flatten()


def misleading_sample_inputs():
    """Large values at every sampled entry of a bucket of EXACT_SAMPLED entries and nowhere
    else: at 1% the bound admits 65536 entries, more than the slabs hold, so the two-pass
    strategy runs from the acc the pass left behind."""
    generator = torch.Generator().manual_seed(13)
    grad = torch.randn(EXACT_SAMPLED, generator=generator) * 1e-3
    grad[sampled_positions(EXACT_SAMPLED)] = torch.randn(2048 * 32, generator=generator) + 10.0
    return grad, torch.randn(EXACT_SAMPLED, generator=generator) * 1e-4


def non_finite_beyond_k_inputs(count):
    """10,003 entries with ``count`` Inf/NaN (at 1%: fewer or more than k = 101, or all NaN)."""
    n = 10_003
    generator = torch.Generator().manual_seed(count)
    grad = torch.randn(n, generator=generator)
    if count >= n:
        grad.fill_(float("nan"))
    else:
        grad[torch.randperm(n, generator=generator)[:count]] = torch.tensor(
            [(float("nan"), float("inf"), -float("inf"))[j % 3] for j in range(count)])
    return grad, torch.randn(n, generator=generator)


def chunk_arguments(layout):
    """The chunk operators' layout arguments (chunk_size, k_full, k_last, codec ids, scale_group)."""
    g = layout.geometry
    return (layout.chunk_size, g.k_full, g.k_last, INDEX_CODECS.index(layout.index_codec),
            VALUE_CODECS.index(layout.value_codec), layout.scale_group)


def encode(impl, op, layout, grad, residual, divisor, add_residual, payload_offset=0):
    """``impl``'s ``op`` (chunk_encode or exact_topk_encode) on copies of the inputs on its
    device, the payload a view ``payload_offset`` bytes into a buffer of garbage (every byte
    must be written, none outside the view): (payload, indices, decoded, residual) on the CPU.
    grad must not change."""
    device = impl.device
    g = grad.to(device, copy=True)
    r = None if residual is None else residual.to(device, copy=True)
    buffer = torch.full((layout.nbytes + payload_offset + 8,), 0xAB, dtype=torch.uint8, device=device)
    payload = buffer[payload_offset : payload_offset + layout.nbytes]
    indices, decoded = getattr(impl.ops, op)(g, r, divisor, add_residual, layout, payload)
    assert torch.equal(bits(g.cpu()), bits(grad)), "grad must not change"
    outside = torch.cat([buffer[:payload_offset], buffer[payload_offset + layout.nbytes:]])
    assert bool((outside == 0xAB).all()), "wrote outside the payload"
    assert indices.device == decoded.device == g.device
    return payload.cpu(), indices.cpu(), decoded.cpu(), None if r is None else r.cpu()


def assert_same_encoding(impl, layout, got, want) -> None:
    """``got`` (impl's (payload, indices, decoded, residual)) == ``want`` (the reference's)."""
    (p1, i1, d1, r1), (p2, i2, d2, r2) = got, want
    if impl.nan_bits:
        assert torch.equal(p1, p2), "payload bytes differ"
    else:
        value_start = layout.scale_bytes + layout.index_bytes
        value_end = value_start + layout.value_bytes
        assert_same(p1[:value_start], p2[:value_start], "payload: scales and index region")
        assert_same(p1[value_end:], p2[value_end:], "payload: zero padding")
        dtype = FLOAT_CODECS.get(layout.value_codec, torch.uint8)
        assert_same(p1[value_start:value_end].clone().view(dtype), p2[value_start:value_end].clone().view(dtype),
                    "payload: values")
    assert i1.dtype == i2.dtype == torch.int64 and torch.equal(i1, i2), "indices differ"
    assert d1.dtype == d2.dtype, "decoded dtypes differ"
    if impl.nan_bits:
        assert torch.equal(bits(d1), bits(d2)), "decoded values differ"
    else:
        assert_same(d1, d2, "decoded values")
    assert (r1 is None) == (r2 is None)
    if r1 is not None:
        if impl.nan_bits:
            assert torch.equal(bits(r1), bits(r2)), "residuals differ"
        else:
            assert_same(r1, r2, "residual", nan_ok=False)


def check_encode(impl, op, layout, grad, residual, divisor, add_residual, payload_offset=0, want=None):
    """``impl``'s encoding == the reference's (or ``want``, computed by another oracle). Returns (got, want)."""
    if want is None:
        want = encode(REFERENCE, op, layout, grad, residual, divisor, add_residual)
    got = encode(impl, op, layout, grad, residual, divisor, add_residual, payload_offset)
    assert_same_encoding(impl, layout, got, want)
    return got, want


def payloads_of(op, layout, grad, residual, modes=ALL_MODES) -> list[torch.Tensor]:
    """The payloads of ``grad`` in the error-feedback ``modes`` (EF_MODES indices): different
    selections, as different ranks send. Encoded as the hook encodes (sparsecomm.ops.dispatch:
    the native kernel where it applies, the reference elsewhere), whose bytes the encoders'
    tests hold to the reference's: the decoders' tests then spend no time in the reference's
    torch.topk."""
    return [encode(DISPATCH, op, layout, grad, residual if EF_MODES[mode][2] else None, *EF_MODES[mode][:2])[0]
            for mode in modes]


def check_decode_add(impl, op, layout, gathered, start, zero_out) -> None:
    """``impl``'s ``op`` (chunk_decode_add or exact_topk_decode_add) of ``gathered`` onto
    ``start`` (zeroed first with ``zero_out``) == the reference's. On the CPU the bucket is not
    64-byte aligned: the streaming stores' head and tail run."""
    want = start.clone()
    getattr(reference, op)(gathered, layout, want, zero_out)
    shift = 1 if impl.device.type == "cpu" else 0
    got = torch.empty(start.numel() + shift, dtype=start.dtype, device=impl.device)[shift:]
    got.copy_(start)
    getattr(impl.ops, op)(gathered.to(impl.device), layout, got, zero_out)
    assert_same(got, want, f"{op} (zero_out={zero_out})")


# --------------------------------------------------------------------------- every CPU level


def level_payload(layout, seed):
    """The reference's payload of ``layout`` for the gradient of ``seed`` (with NaN/+-Inf),
    encoded once by the parent and handed to every CPU level's process."""
    def compute():
        grad, residual = ef_inputs(layout.numel, torch.float32, seed=seed, kind="nonfinite")
        payload = torch.empty(layout.nbytes, dtype=torch.uint8)
        reference.chunk_encode(grad, residual, 2.0, True, layout, payload)
        return payload
    key = (f"{layout.numel} {layout.chunk_size} {layout.density} {layout.index_codec} {layout.value_codec} "
           f"{layout.scale_group} {seed}")
    return precomputed(key, compute)


def level_encode_case(op, grad, residual, divisor, add_residual, layout):
    """A CPU level case (kernel_implementations.LevelCase.run): ``op`` (chunk_encode or
    exact_topk_encode) into a payload of garbage: (payload, indices, decoded[, residual])."""
    def run(impl_ops):
        r = None if residual is None else residual.clone()
        payload = torch.full((layout.nbytes,), 0xAB, dtype=torch.uint8)
        indices, decoded = getattr(impl_ops, op)(grad, r, divisor, add_residual, layout, payload)
        return [payload, indices, decoded] + ([] if r is None else [r])
    return run


def level_decode_case(op, layout, world_size, seed, gap=0):
    """A CPU level case (kernel_implementations.LevelCase.run): ``op`` of world_size payloads of
    ``layout`` onto a bucket that is not 64-byte aligned; with ``gap``, payloads farther apart
    than their size (sealed, each followed by its trailer)."""
    rows = []
    for rank in range(world_size):
        payload = torch.empty(layout.nbytes + gap, dtype=torch.uint8)
        payload[: layout.nbytes] = level_payload(layout, seed + rank)
        rows.append(payload)
    gathered = torch.stack(rows)[:, : layout.nbytes] if gap else torch.cat(rows)

    def run(impl_ops):
        out = torch.randn(layout.numel + 1)[1:]
        getattr(impl_ops, op)(gathered, layout, out, True)
        return [out]
    return run
