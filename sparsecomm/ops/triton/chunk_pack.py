"""Assembling a chunked payload's index and value regions from per-entry codes (Triton).

Shared by the encoders (chunk_encode.py, exact_topk_encode.py), which first write every
entry's index code and value code (and, for Rice, its gap and the bit where its code starts)
to int32 scratch. Adjacent entries, and adjacent chunks, share payload bytes when fields
are sub-byte (chunk indices, int4/int2/sign values, Rice codes), so one lane per payload
byte assembles that byte from the codes of every field it holds: no byte is written twice.
"""
import triton
import triton.language as tl

from sparsecomm.ops.triton.chunk_codecs import fields_byte

PACK_BLOCK = 1024


@triton.jit
def _rice_byte(start_ptr, gap_ptr, byte, mask, capacity, chunks, k_full, r_full, r_last, search_steps):
    """Byte ``byte`` (region-relative) of the Rice index region from the code starts and gaps."""
    bit0 = byte * 8
    lo = tl.full(byte.shape, 0, tl.int64)
    hi = tl.full(byte.shape, 0, tl.int64) + capacity
    # The last code starting at or before bit0 (start[0] = 0 <= bit0).
    for _ in range(search_steps):
        mid = (lo + hi) >> 1
        active = mask & (hi - lo > 1)
        s = tl.load(start_ptr + mid, mask=active, other=0)
        lo = tl.where(active & (s <= bit0), mid, lo)
        hi = tl.where(active & (s > bit0), mid, hi)
    out = tl.full(byte.shape, 0, tl.int64)
    for j in tl.static_range(9):  # codes are >= 1 bit: at most 8 start inside the byte
        f = lo + j
        ok = mask & (f < capacity)
        start = tl.load(start_ptr + f, mask=ok, other=0)
        gap = tl.load(gap_ptr + f, mask=ok, other=0).to(tl.int64)
        chunk = tl.minimum(f // k_full, chunks - 1)
        r = tl.where(chunk == chunks - 1, r_last, r_full).to(tl.int64)
        q = gap >> r
        low = gap & ((1 << r) - 1)
        rel = start - bit0
        # q one-bits from the start, a zero, then the r low bits of the gap, LSB first.
        first_one = tl.minimum(tl.maximum(rel, 0), 8)
        end_one = tl.minimum(tl.maximum(rel + q, 0), 8)
        ones = (1 << end_one) - (1 << first_one)
        low_at = rel + q + 1
        low_part = tl.where(low_at >= 0, low << tl.minimum(tl.maximum(low_at, 0), 8),
                            low >> tl.minimum(tl.maximum(-low_at, 0), 63))
        low_part = tl.where(low_at < 8, low_part & 0xFF, 0)
        out = out | tl.where(ok, ones | low_part, 0)
    return out


@triton.jit
def pack_kernel(payload_ptr, icode_ptr, vcode_ptr, start_ptr, gap_ptr,
                 index_start, value_start, value_end, nbytes, capacity, chunks, k_full, r_full, r_last,
                 search_steps, INDEX_CODEC: tl.constexpr, INDEX_BITS: tl.constexpr, VALUE_BITS: tl.constexpr,
                 BLOCK: tl.constexpr):
    p = index_start + tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = p < nbytes
    in_index = m & (p < value_start)
    in_value = m & (p >= value_start) & (p < value_end)
    if INDEX_CODEC == 2:
        index_byte = _rice_byte(start_ptr, gap_ptr, p - index_start, in_index, capacity, chunks, k_full,
                                r_full, r_last, search_steps)
    else:
        index_byte = fields_byte(icode_ptr, p - index_start, capacity, in_index, INDEX_BITS)
    value_byte = fields_byte(vcode_ptr, p - value_start, capacity, in_value, VALUE_BITS)
    byte = tl.where(in_index, index_byte, tl.where(in_value, value_byte, 0))  # the rest: zero padding
    tl.store(payload_ptr + p, byte.to(tl.uint8), mask=m)
