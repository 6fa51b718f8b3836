"""Triton ``chunk_decode_add``: decode back-to-back chunked payloads and add them into the
dense bucket, in row (rank) order, no host synchronisation.

Semantics: csrc/README.md (oracle: :func:`sparsecomm.ops.reference.chunk_decode_add`, i.e.
``ChunkLayout.views`` + one ``index_add_`` per row): every element receives
``out[i] = T(float(out[i]) + float(T(decoded)))`` row after row, bitwise the reference (NaN
at the same places; the bits of a NaN sum are unspecified). Index codecs int32, chunk and
rice; every value codec; chunks of at most 8192 entries, or, with a ``scale_group`` (exact
top-k on the compact wire), one chunk of the whole bucket whose scales go by groups of
payload entries; ``out`` float32, bfloat16 or float16.

Kernels (grids from the layout and the number of rows)::

    out.zero_()                             if zero_out
    _rice_decode_kernel [chunks, rows]      rice only: one program per chunk and row walks the
                                            chunk's codes one after another (unary part: the
                                            first zero of a 64-bit window, one block min;
                                            low bits: one 32-lane gather) and writes every
                                            entry's bucket index to int32 scratch
    _add_row_kernel     [capacity/B]        once per row, in rank order (stream order makes a
                                            row complete before the next starts): one lane
                                            per entry decodes its index (int32 / chunk field,
                                            or the scratch) and its value (float bits, or the
                                            code and its chunk's or group's scale), then
                                            load-add-store

Race freedom: inside one payload the indices are unique (one chunk's positions are
distinct, chunks are disjoint), so the plain load-add-store of a row never has two lanes on
one element. A corrupt payload (another rank's bytes): an entry whose index falls outside
its own chunk, or a Rice code running past its chunk, is dropped (the native CPU kernel
raises instead; raising here would need a host synchronisation); duplicate indices inside
one corrupt row may then add in any order.
"""
import torch
import triton
import triton.language as tl

from sparsecomm.compress.chunk_layout import payload_rows
from sparsecomm.compress.chunk_layout import check_exact_topk_layout
from sparsecomm.ops.triton import chunk_codecs, radix
from sparsecomm.ops.triton.chunk_codecs import block_min, decode_code, load_field
from sparsecomm.ops.triton.radix import block_sum, from_f32, to_f32

_BLOCK = 1024


@triton.jit
def _rice_decode_kernel(gathered_ptr, index_ptr, row_stride, index_start, index_bytes, chunk_size, chunks,
                        last_length, k_full, k_last, r_full, r_last, bits_full, bits_last, capacity):
    c = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    region = gathered_ptr + row * row_stride + index_start
    is_last = c == chunks - 1
    k = tl.where(is_last, k_last, k_full)
    r = tl.where(is_last, r_last, r_full).to(tl.int64)
    length = tl.where(is_last, last_length, chunk_size)
    cursor = c.to(tl.int64) * bits_full
    end = cursor + tl.where(is_last, bits_last, bits_full)
    begin = c.to(tl.int64) * chunk_size
    out = index_ptr + row * capacity + c.to(tl.int64) * k_full
    lane64 = tl.arange(0, 64)
    lane32 = tl.arange(0, 32)
    local = tl.full([], -1, tl.int64)
    broken = tl.full([], 0, tl.int32)
    for j in range(k):
        # The unary part: ones up to the next zero bit; bits past the chunk read as ones.
        q = tl.full([], 0, tl.int64)
        z = tl.full([], 64, tl.int32)
        while z == 64:
            p = cursor + q + lane64
            inside = p < end
            byte = tl.load(region + (p >> 3), mask=inside, other=0).to(tl.int64)
            bit = tl.where(inside, (byte >> (p & 7)) & 1, 1)
            z = block_min(tl.where(bit == 0, lane64, 64))
            q += z
            z = tl.where((z == 64) & (cursor + q >= end), 65, z)  # no zero before the chunk's end
        found = z < 64
        zero_at = cursor + q
        # The r low bits after the zero, LSB first.
        p = zero_at + 1 + lane32
        take = (lane32 < r) & (p < end)
        byte = tl.load(region + (p >> 3), mask=take, other=0).to(tl.int64)
        low = block_sum(tl.where(take, (byte >> (p & 7)) & 1, 0) << lane32)
        cursor = zero_at + 1 + r
        local = local + ((q << r) | low) + 1
        ok = found & (cursor <= end) & (local < length) & (broken == 0)
        broken = tl.where(ok, broken, 1)
        tl.store(out + j, tl.where(ok, begin + local, -1).to(tl.int32))


@triton.jit
def _add_row_kernel(row_ptr, index_ptr, out_ptr, chunk_size, chunks, last_length, k_full, capacity, scale_group,
                    index_start, value_start, value_end,
                    INDEX_CODEC: tl.constexpr, INDEX_BITS: tl.constexpr, VALUE_CODEC: tl.constexpr,
                    VALUE_BITS: tl.constexpr, BLOCK: tl.constexpr):
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = e < capacity
    c = tl.minimum(e // k_full, chunks - 1)
    begin = c * chunk_size
    length = tl.where(c == chunks - 1, last_length, chunk_size)
    T: tl.constexpr = out_ptr.dtype.element_ty
    if INDEX_CODEC == 0:
        raw = load_field(row_ptr + index_start, value_start - index_start, e * 32, m, 32)
        idx = tl.where(raw >= 2147483648, raw - 4294967296, raw)  # the int32 it is
        ok = m & (idx >= begin) & (idx < begin + length)
    elif INDEX_CODEC == 1:
        local = load_field(row_ptr + index_start, value_start - index_start, e * INDEX_BITS, m, INDEX_BITS)
        ok = m & (local < length)
        idx = begin + local
    else:
        idx = tl.load(index_ptr + e, mask=m, other=-1).to(tl.int64)
        ok = m & (idx >= 0)
    code = load_field(row_ptr + value_start, value_end - value_start, e * VALUE_BITS, m, VALUE_BITS)
    if VALUE_CODEC == 0:
        v32 = code.to(tl.int32).to(tl.float32, bitcast=True)
    elif VALUE_CODEC == 1:
        v32 = (code.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    elif VALUE_CODEC == 2:
        v32 = code.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:  # the scale of the entry's chunk, or of its group of payload entries
        group = tl.where(scale_group > 0, e // tl.maximum(scale_group, 1), c)
        lo = tl.load(row_ptr + 2 * group, mask=m, other=0).to(tl.int32)
        hi = tl.load(row_ptr + 2 * group + 1, mask=m, other=0).to(tl.int32)
        s = (((hi << 8) | lo) << 16).to(tl.float32, bitcast=True)
        v32 = decode_code(code.to(tl.int32), s, VALUE_CODEC)
    v = to_f32(from_f32(v32, T))  # decoded.to(out.dtype)
    o = tl.load(out_ptr + idx, mask=ok, other=0.0)
    tl.store(out_ptr + idx, from_f32(to_f32(o) + v, T), mask=ok)


def _check(gathered, layout, out):
    why = chunk_codecs.unsupported(layout)
    if why is not None:
        raise ValueError(f"chunk_decode_add: the Triton kernel does not take this layout: {why}")
    if not isinstance(out, torch.Tensor) or out.dim() != 1 or not out.is_contiguous():
        raise ValueError("chunk_decode_add: out must be a contiguous 1-D tensor")
    if not isinstance(gathered, torch.Tensor) or gathered.dtype != torch.uint8 or \
            payload_rows(gathered, layout) is None:
        raise ValueError(f"chunk_decode_add: gathered must be contiguous uint8 of world_size x {layout.nbytes} bytes, "
                         f"or uint8 [world_size, {layout.nbytes}] rows, got {getattr(gathered, 'dtype', gathered)} "
                         f"{tuple(getattr(gathered, 'shape', ()))}")
    if out.dtype not in radix.GRAD_DTYPES:
        raise ValueError(f"chunk_decode_add: out dtype must be one of {radix.GRAD_DTYPES}, got {out.dtype}")
    if out.numel() != layout.numel:
        raise ValueError(f"chunk_decode_add: the layout is for {layout.numel} entries, out has {out.numel()}")
    if gathered.device != out.device:
        raise ValueError(f"chunk_decode_add: gathered ({gathered.device}) and out ({out.device}) must be on one device")
    if gathered.numel() and out.numel() and radix.overlap(gathered, out):
        raise ValueError("chunk_decode_add: out may not overlap gathered")


def chunk_decode_add(gathered, layout, out, zero_out: bool = True) -> None:
    """Decode every payload of ``gathered`` (back to back, or one per row:
    :func:`~sparsecomm.compress.chunk_layout.payload_rows`) and add them into ``out`` in row
    (rank) order."""
    _check(gathered, layout, out)
    f = chunk_codecs.layout_numbers(layout)
    rows = payload_rows(gathered, layout)
    if zero_out:
        out.zero_()
    if rows.shape[0] == 0:
        return
    if f.index_codec == 2:
        index = torch.empty(rows.shape[0] * f.capacity, dtype=torch.int32, device=out.device)
        _rice_decode_kernel[(f.chunks, rows.shape[0])](rows, index, rows.stride(0), f.index_start,
                                                       f.value_start - f.index_start, f.chunk_size, f.chunks,
                                                       f.last_length, f.k_full, f.k_last, f.rice_r_full,
                                                       f.rice_r_last, f.rice_bits_full, f.rice_bits_last, f.capacity,
                                                       num_warps=1, enable_fp_fusion=False)
    else:
        index = None
    grid = (triton.cdiv(f.capacity, _BLOCK),)
    for row, payload in enumerate(rows):
        row_index = payload if index is None else index[row * f.capacity : (row + 1) * f.capacity]
        _add_row_kernel[grid](payload, row_index, out, f.chunk_size, f.chunks, f.last_length, f.k_full, f.capacity,
                              getattr(layout, "scale_group", 0), f.index_start, f.value_start, f.value_end, INDEX_CODEC=f.index_codec,
                              INDEX_BITS=max(f.index_bits, 1), VALUE_CODEC=f.value_codec, VALUE_BITS=f.value_bits,
                              BLOCK=_BLOCK, num_warps=4, enable_fp_fusion=False)


def exact_topk_decode_add(gathered, layout, out, zero_out: bool = True) -> None:
    """:func:`chunk_decode_add` of payloads of exact top-k on the compact wire (one chunk of the
    whole bucket, scales by groups of ``scale_group`` entries), refusing every other layout."""
    check_exact_topk_layout("exact_topk_decode_add", layout)
    chunk_decode_add(gathered, layout, out, zero_out)
