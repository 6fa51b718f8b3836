"""Triton ``chunk_encode`` (``selector="chunk"``): error feedback + per-chunk exact top-k +
index and value codecs into the payload, no host synchronisation.

Semantics: csrc/README.md (oracle: :func:`sparsecomm.ops.reference.chunk_encode`, i.e.
``ChunkLayout.encode`` of ``acc = compensated(grad, residual, divisor, add_residual)``):
the same payload bytes, residual, indices and decoded values (NaN payload bits aside: any
NaN matches any NaN, as for the other Triton kernels). Grad dtypes float32, bfloat16 and
float16; index codecs int32, chunk and rice; every value codec; one scale per chunk
(``scale_group == 0``) and chunks of at most ``MAX_CHUNK_SIZE`` (8192) entries; a layout with
a ``scale_group`` (one chunk of the whole bucket) goes to :mod:`~sparsecomm.ops.triton.exact_topk_encode`.
The dispatch sends other layouts to the reference.

Kernel sequence (grids follow from the layout; nothing is read back to the host)::

    _select_kernel     [chunks]  one program per chunk, the chunk in one block: acc = T(g /
                                 divisor) (+ r); magnitude keys; the exact k-th key K by a
                                 bitwise binary search (31 block counts of key >= candidate);
                                 selection = key > K, then keys == K by lower index (a cumsum
                                 gives the tie rank); slots by a cumsum of the selection; the
                                 chunk's scale (from the integer keys of its largest and
                                 smallest non-zero finite selected magnitudes), written as
                                 its two payload bytes; codes and decoded values; the
                                 residual of the whole chunk; per entry (at its slot): the
                                 index, the decoded value, and the index and value codes in
                                 int32 scratch
    _rice_starts_kernel[chunks]  rice only: per entry its gap and the bit where its code starts
                                 (a cumsum of the code widths inside the chunk)
    pack_kernel        [bytes/B] (chunk_pack.py) one lane per payload byte after the scales: the byte of the
                                 index region, value region or zero padding, assembled from
                                 the codes of every field it holds (fixed-width fields:
                                 entries byte*8 // bits on; rice: a binary search of the code
                                 starts finds the first code, then the <= 9 codes that touch
                                 the byte)

The codes go through scratch and a second kernel because adjacent chunks share payload
bytes when fields are sub-byte (chunk indices, int4/int2/sign values, Rice codes): every
byte is written by exactly one lane, never by two programs.
"""
import torch
import triton
import triton.language as tl

from sparsecomm.compress import value_codecs
from sparsecomm.compress.chunk_layout import exact_topk_layout
from sparsecomm.ops.triton import chunk_codecs, radix
from sparsecomm.ops.triton.chunk_codecs import block_max, block_min, chunk_scale, decode_code, value_code
from sparsecomm.ops.triton.chunk_pack import PACK_BLOCK, pack_kernel
from sparsecomm.ops.triton.exact_topk_encode import exact_topk_encode
from sparsecomm.ops.triton.radix import block_cumsum, block_sum, compensate, from_f32, magnitude_key, to_f32, to_wire

@triton.jit
def _select_kernel(g_ptr, r_ptr, payload_ptr, idx_out_ptr, dec_out_ptr, vcode_ptr, icode_ptr,
                   n, divisor, chunk_size, chunks, k_full, k_last,
                   HAS_RESIDUAL: tl.constexpr, ADD_RESIDUAL: tl.constexpr, INDEX_CODEC: tl.constexpr,
                   VALUE_CODEC: tl.constexpr, LIMIT: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0)
    begin = c.to(tl.int64) * chunk_size
    is_last = c == chunks - 1
    length = tl.where(is_last, n - begin, chunk_size)
    k = tl.where(is_last, k_last, k_full)
    lane = tl.arange(0, BLOCK)
    m = lane < length
    offs = begin + lane
    T: tl.constexpr = g_ptr.dtype.element_ty
    acc = compensate(g_ptr, r_ptr, offs, m, divisor, ADD_RESIDUAL)
    a32 = to_f32(acc)
    key = tl.where(m, magnitude_key(a32), -1)  # lanes past the chunk rank below every entry

    # The k-th largest key: the largest t with #(key >= t) >= k, bit by bit from the top.
    kth = tl.full([], 0, tl.int32)
    for i in range(31):
        trial = kth | (1 << (30 - i))
        count = block_sum((key >= trial).to(tl.int32))
        kth = tl.where(count >= k, trial, kth)
    above = key > kth
    need = k - block_sum(above.to(tl.int32))
    tie = key == kth
    tie_rank = block_cumsum(tie.to(tl.int32)) - 1
    sel = above | (tie & (tie_rank < need))
    slot = block_cumsum(sel.to(tl.int32)) - 1
    entry = c.to(tl.int64) * k_full + slot
    finite = key < 0x7F800000

    if VALUE_CODEC >= 3:  # scaled codecs: one bfloat16 scale per chunk
        has_nan = block_max(tl.where(sel & (key == 0x7F800001), 1, 0)) > 0
        has_inf = block_max(tl.where(sel & (key == 0x7F800000), 1, 0)) > 0
        largest = block_max(tl.where(sel & finite, key, 0))
        smallest = block_min(tl.where(sel & finite & (key > 0), key, 0x7F800000))
        s = chunk_scale(largest, smallest, has_nan, has_inf, VALUE_CODEC)
        s_bits = s.to(tl.int32, bitcast=True) >> 16
        tl.store(payload_ptr + 2 * c, (s_bits & 0xFF).to(tl.uint8))
        tl.store(payload_ptr + 2 * c + 1, ((s_bits >> 8) & 0xFF).to(tl.uint8))
        code = value_code(a32, s, VALUE_CODEC)
        decoded = decode_code(code, s, VALUE_CODEC)
        tl.store(dec_out_ptr + entry, decoded, mask=sel)
        wide32 = to_f32(from_f32(decoded, T))  # decoded.to(acc.dtype)
    else:  # float codecs: the value itself, in the wire dtype (finite values saturate)
        V: tl.constexpr = dec_out_ptr.dtype.element_ty
        if V == T:
            wire = acc
        else:
            wire = to_wire(a32, key, T, V, LIMIT)
        if V == tl.float32:
            code = wire.to(tl.int32, bitcast=True)
        else:
            code = wire.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            if V == tl.bfloat16 and T == tl.float32:
                # torch's CPU float -> bfloat16 conversion writes every NaN as 0xFFFF
                code = tl.where(key == 0x7F800001, 0xFFFF, code)
                wire = code.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        tl.store(dec_out_ptr + entry, wire, mask=sel)
        if V == T:
            wide32 = a32
        else:
            wide32 = to_f32(from_f32(to_f32(wire), T))

    if INDEX_CODEC == 0:
        index_code = offs.to(tl.int32)
    else:
        index_code = lane
    tl.store(idx_out_ptr + entry, offs, mask=sel)
    tl.store(vcode_ptr + entry, code, mask=sel)
    tl.store(icode_ptr + entry, index_code, mask=sel)

    if HAS_RESIDUAL:
        # acc - decoded where that is finite, acc where the chunk decodes to Inf/NaN or the
        # entry is not sent, +0 wherever acc is not finite.
        wide_finite = (wide32.to(tl.int32, bitcast=True) & 0x7F800000) != 0x7F800000
        kept = tl.where(sel & wide_finite, a32 - wide32, a32)
        kept = tl.where(finite, kept, 0.0)
        tl.store(r_ptr + offs, from_f32(kept, T), mask=m)


@triton.jit
def _rice_starts_kernel(icode_ptr, start_ptr, gap_ptr, chunks, k_full, k_last, r_full, r_last, bits_full,
                        KBLOCK: tl.constexpr):
    c = tl.program_id(0)
    is_last = c == chunks - 1
    k = tl.where(is_last, k_last, k_full)
    r = tl.where(is_last, r_last, r_full)
    j = tl.arange(0, KBLOCK)
    m = j < k
    e = c.to(tl.int64) * k_full + j
    local = tl.load(icode_ptr + e, mask=m, other=0)
    previous = tl.load(icode_ptr + e - 1, mask=m & (j > 0), other=-1)
    gap = local - previous - 1  # g0 = i0, gj = ij - i(j-1) - 1
    width = tl.where(m, (gap >> r) + 1 + r, 0).to(tl.int64)
    start = c.to(tl.int64) * bits_full + block_cumsum(width) - width
    tl.store(start_ptr + e, start, mask=m)
    tl.store(gap_ptr + e, gap, mask=m)


def chunk_encode(grad, residual, divisor, add_residual, layout, payload):
    """``selector="chunk"``: the compensated acc encoded by ``layout`` (a ChunkLayout) into
    ``payload``; residual updated. Returns (bucket-relative indices int64, decoded values).
    A layout of exact top-k on the compact wire goes to exact_topk_encode.py."""
    if exact_topk_layout(layout):
        return exact_topk_encode(grad, residual, divisor, add_residual, layout, payload)
    chunk_codecs.check_encode_arguments("chunk_encode", grad, residual, add_residual, layout, payload)
    f = chunk_codecs.layout_numbers(layout)
    device = grad.device
    value_dtype = value_codecs.FLOAT_CODECS.get(layout.value_codec, torch.float32)
    indices = torch.empty(f.capacity, dtype=torch.int64, device=device)
    decoded = torch.empty(f.capacity, dtype=value_dtype, device=device)
    codes = torch.empty(2 * f.capacity, dtype=torch.int32, device=device)
    value_codes, index_codes = codes[: f.capacity], codes[f.capacity :]
    has_residual = residual is not None
    limit = radix.wire_limit(grad.dtype, value_dtype) if not f.scaled else 0.0
    block = triton.next_power_of_2(f.chunk_size)
    _select_kernel[(f.chunks,)](
        grad, residual if has_residual else grad, payload, indices, decoded, value_codes, index_codes,
        f.numel, float(divisor), f.chunk_size, f.chunks, f.k_full, f.k_last,
        HAS_RESIDUAL=has_residual, ADD_RESIDUAL=bool(add_residual), INDEX_CODEC=f.index_codec,
        VALUE_CODEC=f.value_codec, LIMIT=limit, BLOCK=block, num_warps=chunk_codecs.num_warps_for(block),
        enable_fp_fusion=False)
    if f.index_codec == 2:
        starts = torch.empty(f.capacity, dtype=torch.int64, device=device)
        gaps = torch.empty(f.capacity, dtype=torch.int32, device=device)
        kblock = triton.next_power_of_2(f.k_full)
        _rice_starts_kernel[(f.chunks,)](index_codes, starts, gaps, f.chunks, f.k_full, f.k_last, f.rice_r_full,
                                         f.rice_r_last, f.rice_bits_full, KBLOCK=kblock,
                                         num_warps=chunk_codecs.num_warps_for(kblock), enable_fp_fusion=False)
    else:
        starts, gaps = indices, index_codes  # unused
    grid = (triton.cdiv(f.nbytes - f.index_start, PACK_BLOCK),)
    pack_kernel[grid](payload, index_codes, value_codes, starts, gaps, f.index_start, f.value_start, f.value_end,
                       f.nbytes, f.capacity, f.chunks, f.k_full, f.rice_r_full, f.rice_r_last,
                       max(1, f.capacity.bit_length()), INDEX_CODEC=f.index_codec, INDEX_BITS=max(f.index_bits, 1),
                       VALUE_BITS=f.value_bits, BLOCK=PACK_BLOCK, num_warps=4, enable_fp_fusion=False)
    return indices, decoded
