"""Triton ``exact_topk_encode``: exact top-k on the compact wire (``chunk_encode`` of a layout of
one chunk with a ``scale_group``, which chunk_encode.py hands over to this file).

Semantics: csrc/README.md (oracle: :func:`sparsecomm.ops.reference.exact_topk_encode`, i.e.
``ChunkLayout(numel, numel, density, codecs, scale_group).encode`` of the compensated acc):
the bucket is one chunk, its top k entries (ties: lower index) are listed in ascending index
order, and every ``scale_group`` consecutive payload entries share a bf16 scale. The same
payload bytes, residual, indices and decoded values as the reference (NaN payload bits aside,
as for the other Triton kernels). Grad dtypes float32, bfloat16 and float16; every index and
value codec. No host synchronisation.

Steps (grids follow from the layout)::

    ef_topk_pack (Triton)      the exact top k, fp32 values (acc itself), the residual holding
                               acc everywhere but +0 at the sent and the non-finite entries
    torch.sort                 payload order: ef_topk_pack lists the entries above the k-th
                               key, then its ties, each in index order
    _group_kernel [groups]     one program per scale group: its scale (two payload bytes),
                               every entry's code, decoded value, index and residual
                               (acc - decoded where that is finite, acc where the group decodes
                               to Inf/NaN, +0 wherever acc is not finite), the codes to scratch
    torch.cumsum               rice only: the first bit of every code (a device op)
    pack_kernel [bytes/B]      the index and value regions and the padding, one lane per byte
                               (chunk_pack.py, as chunk_encode.py: sub-byte fields never race)
"""
import torch
import triton
import triton.language as tl

from sparsecomm.compress import value_codecs
from sparsecomm.compress.chunk_layout import check_exact_topk_layout
from sparsecomm.ops.triton import chunk_codecs, radix
from sparsecomm.ops.triton.chunk_codecs import block_max, block_min, chunk_scale, decode_code, value_code
from sparsecomm.ops.triton.chunk_pack import PACK_BLOCK, pack_kernel
from sparsecomm.ops.triton.ef_topk_pack import ef_topk_pack
from sparsecomm.ops.triton.radix import from_f32, magnitude_key, to_f32, to_wire


@triton.jit
def _group_kernel(idx_ptr, val_ptr, r_ptr, payload_ptr, idx_out_ptr, dec_out_ptr, vcode_ptr, capacity, scale_group,
                  HAS_RESIDUAL: tl.constexpr, VALUE_CODEC: tl.constexpr, LIMIT: tl.constexpr, GROUP: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    e = g * scale_group + tl.arange(0, GROUP)
    sel = (tl.arange(0, GROUP) < scale_group) & (e < capacity)
    index = tl.load(idx_ptr + e, mask=sel, other=0).to(tl.int64)
    a32 = tl.load(val_ptr + e, mask=sel, other=0.0)  # acc, exactly (float32 holds every T)
    key = magnitude_key(a32)
    finite = key < 0x7F800000
    T: tl.constexpr = r_ptr.dtype.element_ty  # the residual's, or (without one) grad's: acc's dtype
    if VALUE_CODEC >= 3:  # scaled codecs: one bfloat16 scale per group
        has_nan = block_max(tl.where(sel & (key == 0x7F800001), 1, 0)) > 0
        has_inf = block_max(tl.where(sel & (key == 0x7F800000), 1, 0)) > 0
        largest = block_max(tl.where(sel & finite, key, 0))
        smallest = block_min(tl.where(sel & finite & (key > 0), key, 0x7F800000))
        s = chunk_scale(largest, smallest, has_nan, has_inf, VALUE_CODEC)
        s_bits = s.to(tl.int32, bitcast=True) >> 16
        tl.store(payload_ptr + 2 * g, (s_bits & 0xFF).to(tl.uint8))
        tl.store(payload_ptr + 2 * g + 1, ((s_bits >> 8) & 0xFF).to(tl.uint8))
        code = value_code(a32, s, VALUE_CODEC)
        decoded = decode_code(code, s, VALUE_CODEC)
        tl.store(dec_out_ptr + e, decoded, mask=sel)
        wide32 = to_f32(from_f32(decoded, T))  # decoded.to(acc.dtype)
    else:  # float codecs: the value itself, in the wire dtype (finite values saturate)
        V: tl.constexpr = dec_out_ptr.dtype.element_ty
        if V == T:
            wire = from_f32(a32, T)
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
        tl.store(dec_out_ptr + e, wire, mask=sel)
        wide32 = to_f32(from_f32(to_f32(wire), T))
    tl.store(idx_out_ptr + e, index, mask=sel)
    tl.store(vcode_ptr + e, code, mask=sel)
    if HAS_RESIDUAL:
        wide_finite = (wide32.to(tl.int32, bitcast=True) & 0x7F800000) != 0x7F800000
        kept = tl.where(wide_finite, a32 - wide32, a32)
        kept = tl.where(finite, kept, 0.0)
        tl.store(r_ptr + index, from_f32(kept, T), mask=sel)


def exact_topk_encode(grad, residual, divisor, add_residual, layout, payload):
    """The compensated acc encoded by ``layout`` (exact top-k on the compact wire: a ChunkLayout
    of one chunk with a scale_group) into ``payload``; residual updated. Returns
    (bucket-relative indices int64, decoded values)."""
    check_exact_topk_layout("exact_topk_encode", layout)
    chunk_codecs.check_encode_arguments("exact_topk_encode", grad, residual, add_residual, layout, payload)
    f = chunk_codecs.layout_numbers(layout)
    device = grad.device
    k = f.capacity
    # The selection, with acc itself as the (float32) wire value.
    found = torch.empty(k, dtype=torch.int32, device=device)
    acc = torch.empty(k, dtype=torch.float32, device=device)
    ef_topk_pack(grad, residual, divisor, add_residual, k, found, acc)
    found, order = torch.sort(found)
    acc = acc[order]
    value_dtype = value_codecs.FLOAT_CODECS.get(layout.value_codec, torch.float32)
    indices = torch.empty(k, dtype=torch.int64, device=device)
    decoded = torch.empty(k, dtype=value_dtype, device=device)
    value_codes = torch.empty(k, dtype=torch.int32, device=device)
    has_residual = residual is not None
    limit = radix.wire_limit(grad.dtype, value_dtype) if not f.scaled else 0.0
    group = triton.next_power_of_2(layout.scale_group)
    _group_kernel[(layout.scale_groups,)](
        found, acc, residual if has_residual else grad, payload, indices, decoded, value_codes, k, layout.scale_group,
        HAS_RESIDUAL=has_residual, VALUE_CODEC=f.value_codec, LIMIT=limit, GROUP=group,
        num_warps=chunk_codecs.num_warps_for(group), enable_fp_fusion=False)
    if f.index_codec == 2:  # Rice: gaps and the first bit of every code
        previous = torch.cat([found.new_full((1,), -1), found[:-1]])
        gaps = found - previous - 1
        widths = (gaps >> f.rice_r_full).to(torch.int64) + 1 + f.rice_r_full
        starts = torch.cumsum(widths, 0) - widths
    else:
        starts, gaps = indices, found  # unused
    grid = (triton.cdiv(f.nbytes - f.index_start, PACK_BLOCK),)
    pack_kernel[grid](payload, found, value_codes, starts, gaps, f.index_start, f.value_start, f.value_end,
                       f.nbytes, f.capacity, f.chunks, f.k_full, f.rice_r_full, f.rice_r_last,
                       max(1, f.capacity.bit_length()), INDEX_CODEC=f.index_codec, INDEX_BITS=max(f.index_bits, 1),
                       VALUE_BITS=f.value_bits, BLOCK=PACK_BLOCK, num_warps=4, enable_fp_fusion=False)
    return indices, decoded
