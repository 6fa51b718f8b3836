"""Triton ``unpack_add``: scatter-add payload rows into a dense tensor, in rank order.

Semantics: csrc/README.md (oracle: :func:`sparsecomm.ops.reference.unpack_add`), bitwise what
``out.index_add_(0, idx, values.to(T))`` gives row after row:
``out[idx] = T(float(out[idx]) + float(T(value)))``.

Indices outside ``[0, out.numel())`` are dropped (checking them would need a host sync).

Kernels (no host synchronisation; grids from ``k`` and the number of rows)::

    out.zero_()                            if zero_out
    _add_row_kernel [cdiv(k, B)]           once per row, in rank order (stream order makes a
                                           row complete before the next starts)
    _plus_zero_kernel [cdiv(k, B), rows]   only if not zero_out

Race freedom: a plain load-add-store per entry needs unique indices inside a row, but padded
payloads repeat (index 0, value +0.0). So the row kernel skips entries whose value in T is
+0.0. Adding +0.0 only changes -0.0 into +0.0 (``f(x) = x + 0``), and f commutes with every
later addition (``f(x) + v == f(x + v)`` bitwise, including signed zeros), so those entries
can be applied after all rows: ``_plus_zero_kernel`` does ``out[idx] += 0.0`` for them
(concurrent duplicates all store the same f(x): a benign race). With ``zero_out`` it is
skipped: starting from +0.0, round-to-nearest sums never produce -0.0, so it is a no-op.
"""
import torch
import triton
import triton.language as tl

from sparsecomm.ops.triton import radix
from sparsecomm.ops.triton.radix import from_f32, to_f32

_BLOCK = 1024


@triton.jit
def _add_row_kernel(idx_ptr, val_ptr, out_ptr, k, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < k
    T: tl.constexpr = out_ptr.dtype.element_ty
    idx = tl.load(idx_ptr + offs, mask=m, other=0)
    v32 = to_f32(from_f32(to_f32(tl.load(val_ptr + offs, mask=m, other=0.0)), T))
    m = m & (v32.to(tl.int32, bitcast=True) != 0)  # +0.0: see the module docstring
    m = m & (idx >= 0) & (idx < n)  # out-of-range indices are dropped (no device-side error)
    o = tl.load(out_ptr + idx, mask=m, other=0.0)
    tl.store(out_ptr + idx, from_f32(to_f32(o) + v32, T), mask=m)


@triton.jit
def _plus_zero_kernel(idx_ptr, val_ptr, out_ptr, k, n, idx_row_stride, val_row_stride, BLOCK: tl.constexpr):
    row = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < k
    T: tl.constexpr = out_ptr.dtype.element_ty
    idx = tl.load(idx_ptr + row * idx_row_stride + offs, mask=m, other=0)
    v32 = to_f32(from_f32(to_f32(tl.load(val_ptr + row * val_row_stride + offs, mask=m, other=0.0)), T))
    m = m & (v32.to(tl.int32, bitcast=True) == 0) & (idx >= 0) & (idx < n)
    o = tl.load(out_ptr + idx, mask=m, other=0.0)
    tl.store(out_ptr + idx, from_f32(to_f32(o) + v32, T), mask=m)


def unpack_add(indices: torch.Tensor, values: torch.Tensor, out: torch.Tensor, zero_out: bool = True) -> None:
    """Scatter-add every row of (indices, values) into ``out``, in row (rank) order."""
    if indices.dim() != 2 or indices.shape != values.shape:
        raise ValueError(f"unpack_add: indices and values must be [world_size, k], got "
                         f"{tuple(indices.shape)} and {tuple(values.shape)}")
    if indices.dtype != torch.int32:
        raise ValueError(f"unpack_add: indices must be int32, got {indices.dtype}")
    if values.dtype not in radix.WIRE_DTYPES:
        raise ValueError(f"unpack_add: values dtype must be one of {radix.WIRE_DTYPES}, got {values.dtype}")
    if out.dtype not in radix.GRAD_DTYPES:
        raise ValueError(f"unpack_add: out dtype must be one of {radix.GRAD_DTYPES}, got {out.dtype}")
    if out.dim() != 1 or not out.is_contiguous():
        raise ValueError(f"unpack_add: out must be a contiguous 1-D tensor, got shape {tuple(out.shape)}")
    if indices.device != out.device or values.device != out.device:
        raise ValueError(f"unpack_add: indices ({indices.device}), values ({values.device}) and out "
                         f"({out.device}) must be on one device")
    # Rows may be strided views of one gathered buffer; each row must be contiguous.
    if indices.shape[1] > 1 and indices.stride(1) != 1:
        indices = indices.contiguous()
    if values.shape[1] > 1 and values.stride(1) != 1:
        values = values.contiguous()
    if out.numel() and any(t.numel() and radix.overlap(out, t) for t in (indices, values)):
        raise ValueError("unpack_add: out may not overlap indices or values")
    rows, k = indices.shape
    n = out.numel()
    if zero_out:
        out.zero_()
    if rows == 0 or k == 0:
        return
    grid = (triton.cdiv(k, _BLOCK),)
    for row in range(rows):
        _add_row_kernel[grid](indices[row], values[row], out, k, n, BLOCK=_BLOCK, num_warps=4, enable_fp_fusion=False)
    if not zero_out:
        _plus_zero_kernel[(grid[0], rows)](indices, values, out, k, n, indices.stride(0), values.stride(0),
                                           BLOCK=_BLOCK, num_warps=4, enable_fp_fusion=False)
