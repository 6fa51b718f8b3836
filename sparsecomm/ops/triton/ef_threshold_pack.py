"""Triton ``ef_threshold_pack``: error feedback + selection by a threshold + packing, no host sync.

Semantics: csrc/README.md (oracle: :func:`sparsecomm.ops.reference.ef_threshold_pack`).

Kernel sequence (grids depend on ``n`` and the capacity only)::

    _count_kernel  [P]             acc = T(g / divisor) (+ r); residual <- acc;
                                   counts[p] = #(key(acc) >= key(threshold)) in program p,
                                   counts[P + p] = #(acc is +-Inf or NaN) (with a residual)
    torch.cumsum                   inclusive prefix over programs (device op)
    _pad_kernel    [cdiv(cap, B)]  slots >= min(total, cap) <- (0, 0); the count (int64)
    _emit_kernel   [P]             global rank = program prefix + in-program rank; ranks
                                   < cap are written at slot = rank (lowest indices first)
                                   and get the residual update; the rest keep residual = acc,
                                   except a non-finite acc, which leaves +0 (sent or not)

A program whose first rank is past the capacity sends nothing and is skipped (no loads),
unless it holds a non-finite acc: then it runs to zero those residuals. With a residual the
emit kernel runs even at capacity 0, for the same reason.

The threshold is a tensor on grad's device (read by the kernels: no ``.item()``), or a Python
number or CPU tensor (key computed on the host, exactly like the reference's float32 tensor).
"""
import torch
import triton
import triton.language as tl

from sparsecomm.ops.triton import radix
from sparsecomm.ops.triton.radix import block_cumsum, block_sum, compensate, emit_entries, load_acc, magnitude_key, to_f32


@triton.jit
def _bar(thr_ptr, bar_key, THR_FROM_PTR: tl.constexpr):
    if THR_FROM_PTR:
        bar = magnitude_key(tl.load(thr_ptr).to(tl.float32))
    else:
        bar = bar_key
    return bar


@triton.jit
def _count_kernel(g_ptr, r_ptr, thr_ptr, counts_ptr, n, divisor, bar_key, tiles,
                  HAS_RESIDUAL: tl.constexpr, ADD_RESIDUAL: tl.constexpr, THR_FROM_PTR: tl.constexpr,
                  BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    bar = _bar(thr_ptr, bar_key, THR_FROM_PTR)
    start = pid.to(tl.int64) * tiles * BLOCK
    count = tl.full([], 0, tl.int32)
    non_finite = tl.full([], 0, tl.int32)
    for t in range(tiles):
        offs = start + t * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        acc = compensate(g_ptr, r_ptr, offs, m, divisor, ADD_RESIDUAL)
        key = magnitude_key(to_f32(acc))
        if HAS_RESIDUAL:
            tl.store(r_ptr + offs, acc, mask=m)
            non_finite += block_sum((m & (key >= 0x7F800000)).to(tl.int32))
        count += block_sum((m & (key >= bar)).to(tl.int32))
    tl.store(counts_ptr + pid, count)
    if HAS_RESIDUAL:
        tl.store(counts_ptr + tl.num_programs(0) + pid, non_finite)


@triton.jit
def _pad_kernel(incl_ptr, idx_out_ptr, val_out_ptr, count_out_ptr, cap, nprog, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    total = tl.load(incl_ptr + nprog - 1)
    sent = tl.minimum(total, cap)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = (offs < cap) & (offs >= sent)
    tl.store(idx_out_ptr + offs, tl.full([BLOCK], 0, tl.int32), mask=m)
    tl.store(val_out_ptr + offs, tl.full([BLOCK], 0, val_out_ptr.dtype.element_ty), mask=m)
    if pid == 0:
        tl.store(count_out_ptr, sent.to(tl.int64))


@triton.jit
def _emit_kernel(g_ptr, src_ptr, thr_ptr, counts_ptr, incl_ptr, idx_out_ptr, val_out_ptr,
                 n, cap, divisor, bar_key, index_offset, tiles,
                 FROM_SRC: tl.constexpr, WRITE_RESIDUAL: tl.constexpr, THR_FROM_PTR: tl.constexpr,
                 LIMIT: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    bar = _bar(thr_ptr, bar_key, THR_FROM_PTR)
    run = tl.load(incl_ptr + pid) - tl.load(counts_ptr + pid)
    start = pid.to(tl.int64) * tiles * BLOCK
    T: tl.constexpr = g_ptr.dtype.element_ty
    V: tl.constexpr = val_out_ptr.dtype.element_ty
    # Programs whose first rank is already past the capacity send nothing (loads masked off),
    # unless a residual of theirs holds a non-finite acc, which must become +0.
    if WRITE_RESIDUAL:
        non_finite = tl.load(counts_ptr + tl.num_programs(0) + pid)
        n = tl.where((run < cap) | (non_finite > 0), n, 0)
    else:
        n = tl.where(run < cap, n, 0)
    for t in range(tiles):
        offs = start + t * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        acc = load_acc(g_ptr, src_ptr, offs, m, divisor, FROM_SRC)
        a32 = to_f32(acc)
        key = magnitude_key(a32)
        hit = m & (key >= bar)
        hit_i = hit.to(tl.int32)
        rank = run + block_cumsum(hit_i) - 1
        sel = hit & (rank < cap)
        emit_entries(idx_out_ptr, val_out_ptr, src_ptr, rank, offs, index_offset, a32, key, sel, m, T, V, LIMIT,
                     WRITE_RESIDUAL)
        run += block_sum(hit_i)


def _host_key(threshold: float) -> int:
    """key(float32(threshold)) computed on the host like the reference (no device involved)."""
    if isinstance(threshold, torch.Tensor):
        value = threshold.detach().reshape(1).to(torch.float32)
    else:
        value = torch.tensor([float(threshold)], dtype=torch.float32)
    return min(int(value.view(torch.int32).item()) & radix.KEY_MASK, radix.NAN_KEY)  # one key for every NaN


def ef_threshold_pack(grad, residual, divisor, add_residual, threshold, indices_out, values_out, index_offset=0):
    """Entries with key >= key(threshold), lowest indices first, up to the capacity.

    Returns the number sent as a 0-d int64 tensor on grad's device (no host synchronisation).
    """
    radix.check_vectors("ef_threshold_pack", grad, residual=residual, indices_out=indices_out,
                        values_out=values_out)
    n = grad.numel()
    cap = indices_out.numel()
    if values_out.numel() < cap:
        raise ValueError(f"ef_threshold_pack: values_out must hold {cap} entries (indices_out's size), "
                         f"got {values_out.numel()}")
    if add_residual and residual is None:
        raise ValueError("ef_threshold_pack: add_residual needs a residual")
    index_offset = int(index_offset)
    radix.check_index_offset("ef_threshold_pack", n, index_offset)
    divisor = float(divisor)
    if isinstance(threshold, torch.Tensor) and threshold.numel() != 1:
        raise ValueError(f"ef_threshold_pack: threshold must have one element, got {threshold.numel()}")
    if isinstance(threshold, torch.Tensor) and threshold.device == grad.device:
        thr = threshold.reshape(1).to(torch.float32)
        thr_from_ptr, bar_key = True, 0
    elif isinstance(threshold, torch.Tensor) and threshold.device.type != "cpu":
        raise ValueError(f"ef_threshold_pack: threshold is on {threshold.device}, grad on {grad.device}")
    else:  # a number, or a CPU tensor for a GPU grad (read on the host: no device synchronisation)
        thr, thr_from_ptr, bar_key = grad, False, _host_key(threshold)

    count_out = torch.empty((), dtype=torch.int64, device=grad.device)
    values_out = values_out[:cap]
    block, tiles, nprog = radix.geometry(n, grad.device)
    counts = torch.empty(2 * nprog, dtype=torch.int32, device=grad.device)  # selected, non-finite
    has_residual = residual is not None
    src = residual if has_residual else grad
    _count_kernel[(nprog,)](grad, src, thr, counts, n, divisor, bar_key, tiles, HAS_RESIDUAL=has_residual,
                            ADD_RESIDUAL=bool(add_residual), THR_FROM_PTR=thr_from_ptr, BLOCK=block,
                            num_warps=radix.NUM_WARPS, enable_fp_fusion=False)
    incl = torch.cumsum(counts[:nprog], dim=0, dtype=torch.int32)
    pad_block = 1024
    _pad_kernel[(max(1, triton.cdiv(cap, pad_block)),)](incl, indices_out, values_out, count_out, cap, nprog,
                                                        BLOCK=pad_block, num_warps=4, enable_fp_fusion=False)
    if cap or has_residual:  # capacity 0 sends nothing, but non-finite residuals still become +0
        limit = radix.wire_limit(grad.dtype, values_out.dtype)
        _emit_kernel[(nprog,)](grad, src, thr, counts, incl, indices_out, values_out, n, cap, divisor, bar_key,
                               index_offset, tiles, FROM_SRC=has_residual, WRITE_RESIDUAL=has_residual,
                               THR_FROM_PTR=thr_from_ptr, LIMIT=limit, BLOCK=block, num_warps=radix.NUM_WARPS, enable_fp_fusion=False)
    return count_out
