"""Shared pieces of the Triton chunk kernels (``chunk_encode``, ``chunk_decode_add``).

The value and index codecs of a chunked payload one entry at a time, bit for bit as
:mod:`sparsecomm.compress.value_codecs`, :mod:`~sparsecomm.compress.index_codecs` and
:mod:`~sparsecomm.compress.bitpack` write them (the same rules as csrc/cpu/chunk_codecs.h):
bfloat16 scales rounded up or down by integer bit operations, float8 e4m3fn rounding
(torch's ``c10`` conversion: round to nearest even, subnormals by one float add),
round-half-even of the int codecs by the 1.5 * 2^23 trick, and x86's NaN rule for
``level * scale`` written out (a NaN scale is the result).

Codec ids are the positions of the names in ``INDEX_CODECS`` and ``VALUE_CODECS`` (as the
native ops take them); they are ``tl.constexpr`` in every kernel, so each layout compiles
to straight-line code for its pair of codecs.

:func:`layout_numbers` computes, on the host, every number of a :class:`ChunkLayout` the
kernels need (no device tensor is read: the grids and arguments follow from the layout).
"""
import dataclasses

import torch
import triton
import triton.language as tl

from sparsecomm.compress import bitpack, index_codecs, value_codecs
from sparsecomm.ops.triton import radix

# Codec ids (csrc/cpu/chunk_format.h); constexpr, so that jit functions may read them.
INDEX_INT32, INDEX_CHUNK, INDEX_RICE = (tl.constexpr(i) for i in range(3))
FP32, BF16, FP16, FP8, INT8, INT4, INT2, SIGN = (tl.constexpr(i) for i in range(8))
# Largest chunk kernel 1 holds in one block (one program per chunk); larger chunks: the reference.
MAX_CHUNK_SIZE = 8192
SUPPORTED_INDEX_CODECS = ("int32", "chunk", "rice")

# tl.max / tl.min are jit functions of triton.language.standard (see radix.py for why the
# kernels call none); their combine functions are reused as tl.reduce's, which also gives
# the interpreter its numpy fast path.
_MAX_COMBINE = getattr(getattr(tl, "standard", None), "_elementwise_max", None)
_MIN_COMBINE = getattr(getattr(tl, "standard", None), "_elementwise_min", None)
if _MAX_COMBINE is None:  # pragma: no cover - a Triton without it: correct, just slower to interpret
    @triton.jit
    def _MAX_COMBINE(a, b):
        return tl.maximum(a, b)
if _MIN_COMBINE is None:  # pragma: no cover
    @triton.jit
    def _MIN_COMBINE(a, b):
        return tl.minimum(a, b)


@dataclasses.dataclass(frozen=True)
class LayoutNumbers:
    """The numbers of a ChunkLayout, as the kernels take them."""

    numel: int
    chunk_size: int
    chunks: int
    last_length: int
    k_full: int
    k_last: int
    capacity: int
    index_codec: int
    value_codec: int
    index_bits: int  # field width of the int32 / chunk codecs (0: rice)
    value_bits: int
    scaled: bool
    rice_r_full: int
    rice_r_last: int
    rice_bits_full: int
    rice_bits_last: int
    index_start: int
    value_start: int
    value_end: int
    nbytes: int


def layout_numbers(layout) -> LayoutNumbers:
    geometry = layout.geometry
    index_codec = index_codecs.INDEX_CODECS.index(layout.index_codec)
    value_codec = value_codecs.VALUE_CODECS.index(layout.value_codec)
    (r_full, bits_full), (r_last, bits_last) = index_codecs.rice_chunk_bits(geometry)
    index_bits = {0: 32, 1: index_codecs.chunk_index_bits(layout.chunk_size)}.get(index_codec, 0)  # rice: none
    index_start = layout.scale_bytes
    value_start = index_start + layout.index_bytes
    value_end = value_start + bitpack.packed_nbytes(layout.capacity, value_codecs.value_bits(layout.value_codec))
    return LayoutNumbers(
        numel=layout.numel, chunk_size=layout.chunk_size, chunks=geometry.chunks, last_length=geometry.last_length,
        k_full=geometry.k_full, k_last=geometry.k_last, capacity=layout.capacity, index_codec=index_codec,
        value_codec=value_codec, index_bits=index_bits, value_bits=value_codecs.value_bits(layout.value_codec),
        scaled=value_codecs.has_scale(layout.value_codec), rice_r_full=r_full, rice_r_last=r_last,
        rice_bits_full=bits_full, rice_bits_last=bits_last, index_start=index_start, value_start=value_start,
        value_end=value_end, nbytes=layout.nbytes)


def unsupported(layout) -> str | None:
    """Why the Triton chunk kernels do not take ``layout`` (None: they do)."""
    if getattr(layout, "scale_group", 0):
        # Exact top-k on the compact wire: exact_topk_encode.py selects over the whole bucket.
        if layout.chunk_size != layout.numel:
            return "scale_group > 0 on a layout of more than one chunk"
    elif layout.chunk_size > MAX_CHUNK_SIZE:
        return f"chunk_size {layout.chunk_size} > {MAX_CHUNK_SIZE} (one chunk per program, in one block)"
    if layout.index_codec not in SUPPORTED_INDEX_CODECS:
        return f"index codec {layout.index_codec!r}"
    return None


def check_encode_arguments(op: str, grad, residual, add_residual, layout, payload) -> None:
    """What both encoders (chunk_encode.py, exact_topk_encode.py) check before any work:
    ValueError naming ``op`` and the argument."""
    radix.check_vectors(op, grad, residual=residual)
    if add_residual and residual is None:
        raise ValueError(f"{op}: add_residual=True needs a residual")
    why = unsupported(layout)
    if why is not None:
        raise ValueError(f"{op}: the Triton kernel does not take this layout: {why}")
    if layout.numel != grad.numel():
        raise ValueError(f"{op}: the layout is for {layout.numel} entries, grad has {grad.numel()}")
    if (not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 or payload.dim() != 1
            or not payload.is_contiguous() or payload.numel() != layout.nbytes):
        raise ValueError(f"{op}: payload must be a contiguous 1-D uint8 tensor of {layout.nbytes} bytes")
    if payload.device != grad.device:
        raise ValueError(f"{op}: payload is on {payload.device}, grad on {grad.device}")
    for other in (grad, residual):
        if other is not None and other.numel() and radix.overlap(payload, other):
            raise ValueError(f"{op}: payload may not alias grad or residual")


def num_warps_for(block: int) -> int:
    return max(4, min(16, block // 256))


# --------------------------------------------------------------------------- reductions

@triton.jit
def block_max(x):
    return tl.reduce(x, 0, _MAX_COMBINE)


@triton.jit
def block_min(x):
    return tl.reduce(x, 0, _MIN_COMBINE)


# --------------------------------------------------------------------------- scales

@triton.jit
def bf16_round_up(x):
    """The smallest bfloat16 >= x (x float32, >= 0, finite), as float32."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0xFFFF) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def bf16_round_down(x):
    """The largest bfloat16 <= x (x float32, >= 0, finite), as float32."""
    return (x.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def chunk_scale(largest_key, smallest_key, has_nan, has_inf, CODEC: tl.constexpr):
    """value_codecs.chunk_scales for one chunk, from the keys (float32 bits of the magnitude)
    of its largest finite and smallest non-zero finite selected magnitudes (0x7F800000: none)."""
    largest = largest_key.to(tl.float32, bitcast=True)
    if CODEC == FP8:
        scale = bf16_round_up(tl.math.div_rn(largest, tl.full(largest.shape, 448.0, tl.float32)))
    elif CODEC == INT8:
        scale = bf16_round_up(largest * 0.0078125)  # 2^-7: one rounding, as torch's multiply
    elif CODEC == INT4:
        scale = bf16_round_up(largest * 0.125)
    elif CODEC == INT2:
        scale = bf16_round_up(largest * 0.5)
    else:  # sign
        smallest = tl.where(smallest_key >= 0x7F800000, 0, smallest_key).to(tl.float32, bitcast=True)
        scale = bf16_round_down(tl.minimum(2.0 * smallest, smallest * 0.5 + largest * 0.5))
        scale = tl.maximum(scale, bf16_round_up(largest * 1.52587890625e-05))  # 2^-16
    scale_bits = scale.to(tl.int32, bitcast=True)
    scale_bits = tl.where(has_inf, 0x7F800000, scale_bits)
    scale_bits = tl.where(has_nan, 0x7FC00000, scale_bits)
    return scale_bits.to(tl.float32, bitcast=True)


# --------------------------------------------------------------------------- value codes

@triton.jit
def fp8_e4m3fn_bits(x):
    """float32 -> float8 e4m3fn bits (int32), as c10's fp8e4m3fn_from_fp32_value (x finite)."""
    bits = x.to(tl.int32, bitcast=True)
    sign = bits & -2147483648  # 0x80000000
    a = bits & 0x7FFFFFFF
    mant_odd = (a >> 20) & 1
    normal = (a + (-1006632960 + 0x7FFFF) + mant_odd) >> 20  # (7 - 127) << 23, then round to nearest even
    # Below 2^-6: one float add aligns the value on the 2^-9 grid of the subnormals.
    sub = (a.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - 1182793728  # 141 << 23
    result = tl.where(a < 1015021568, sub, normal)  # 121 << 23
    result = tl.where(a >= 1139802112, 0x7F, result)  # 1087 << 20: NaN
    return (result & 0x7F) | ((sign >> 24) & 0x80)


@triton.jit
def fp8_e4m3fn_value(code):
    """float8 e4m3fn bits (int32, 0..255) -> float32, as c10's fp8e4m3fn_to_fp32_value."""
    sign = (code & 0x80) << 24
    exponent = (code >> 3) & 0xF
    mantissa = code & 7
    normal = ((exponent + 120) << 23) | (mantissa << 20)
    subnormal = (mantissa.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)  # mantissa * 2^-9
    bits = tl.where(exponent == 0, subnormal, normal)
    bits = tl.where((code & 0x7F) == 0x7F, 0x7FF00000, bits)
    return (bits | sign).to(tl.float32, bitcast=True)


@triton.jit
def round_half_even(x):
    """torch.round of a float32 (ties to even): exact for |x| < 2^22 by adding 1.5 * 2^23."""
    r = (x + 12582912.0) - 12582912.0
    return tl.where(tl.abs(x) < 4194304.0, r, x)


@triton.jit
def value_code(v, s, CODEC: tl.constexpr):
    """The code (int32) of float32 value v in a chunk of scale s (value_codecs._codes)."""
    s = tl.broadcast_to(s, v.shape)
    vbits = v.to(tl.int32, bitcast=True)
    is_nan = (vbits & 0x7FFFFFFF) > 0x7F800000
    negative = (vbits < 0) & (is_nan == 0)
    sbits = s.to(tl.int32, bitcast=True)
    finite_scale = (sbits & 0x7F800000) != 0x7F800000
    positive_scale = s > 0.0
    if CODEC == SIGN:
        code = negative.to(tl.int32)
    elif CODEC == FP8:
        ratio = tl.where(positive_scale, tl.math.div_rn(v, s), 0.0)
        ratio = tl.minimum(tl.maximum(ratio, -448.0), 448.0)
        ratio = tl.where(finite_scale, ratio, tl.where(negative, -448.0, 448.0))
        code = fp8_e4m3fn_bits(ratio)
    else:
        QMAX: tl.constexpr = 127 if CODEC == 4 else (7 if CODEC == 5 else 1)  # int8, int4, int2
        q = tl.where(positive_scale, round_half_even(tl.math.div_rn(v, s)), 0.0)
        q = tl.minimum(tl.maximum(q, -QMAX * 1.0), QMAX * 1.0)
        q = tl.where(finite_scale, q, tl.where(negative, -QMAX * 1.0, QMAX * 1.0))
        code = q.to(tl.int32) + QMAX
    return code


@triton.jit
def decode_code(code, s, CODEC: tl.constexpr):
    """What a receiver adds (float32) for ``code`` of a scaled codec in a chunk of scale s."""
    s = tl.broadcast_to(s, code.shape)
    if CODEC == SIGN:
        level = 1.0 - 2.0 * code.to(tl.float32)
    elif CODEC == FP8:
        level = fp8_e4m3fn_value(code)
    else:
        QMAX: tl.constexpr = 127 if CODEC == 4 else (7 if CODEC == 5 else 1)  # int8, int4, int2
        level = (code - QMAX).to(tl.float32)
    # x86's rule for a NaN operand, as torch's CPU multiply gives it: the NaN is the result
    # (level first). Written out, so a sign flip of a NaN cannot happen.
    out = tl.where(s != s, s, level * s)
    return tl.where(level != level, level, out)


# --------------------------------------------------------------------------- bit fields

@triton.jit
def load_field(region_ptr, region_bytes, bit, mask, BITS: tl.constexpr):
    """Fields of BITS (<= 32) bits at bit offsets ``bit`` (int64) of a byte region, as int64
    (bytes past the region read as zeros)."""
    byte = bit >> 3
    shift = bit & 7
    NBYTES: tl.constexpr = (BITS + 7 + 7) // 8
    word = tl.full(bit.shape, 0, tl.int64)
    for j in tl.static_range(NBYTES):
        ok = mask & (byte + j < region_bytes)
        b = tl.load(region_ptr + byte + j, mask=ok, other=0).to(tl.int64)
        word = word | (b << (8 * j))
    return (word >> shift) & ((1 << BITS) - 1)


@triton.jit
def fields_byte(code_ptr, byte, count, mask, BITS: tl.constexpr):
    """Byte ``byte`` (int64, region-relative) of a region of ``count`` fields of BITS bits whose
    codes (non-negative, < 2^BITS, int32 bits) are at code_ptr, LSB first (bitpack.pack)."""
    bit0 = byte * 8
    first = bit0 // BITS
    out = tl.full(byte.shape, 0, tl.int64)
    MAXF: tl.constexpr = 8 // BITS + 2
    for j in tl.static_range(MAXF):
        f = first + j
        ok = mask & (f < count)
        code = tl.load(code_ptr + f, mask=ok, other=0).to(tl.int64) & 0xFFFFFFFF
        pos = f * BITS - bit0
        part = tl.where(pos >= 0, code << tl.minimum(tl.maximum(pos, 0), 8),
                        code >> tl.minimum(tl.maximum(-pos, 0), 40))
        out = out | tl.where(ok & (pos < 8), part & 0xFF, 0)
    return out
