"""Triton ``ef_topk_pack``: error feedback + exact top-k by magnitude + packing, no host sync.

Semantics: csrc/README.md (oracle: :func:`sparsecomm.ops.reference.ef_topk_pack`).

Kernel sequence (grids depend on ``n`` only; every intermediate result stays on the device)::

    ws[:head].zero_()                        histograms + state
    hist1_kernel        [P]   acc = T(g / divisor) (+ r); residual <- acc; level-1 histogram
    select_kernel       [1]   bin of the k-th key (state)
    hist_refine_kernel  [P]   level-2 histogram inside that bin (all loads masked off if done)
    select_kernel       [1]
    hist_refine_kernel  [P]   level-3 histogram; per program: its 128-bin histogram and the
                              count of keys above the level-2 prefix
    select_kernel       [1]   exact k-th key K, need = #(key == K) to take
    _block_counts_kernel[P]   per program: #(key > K), #(key == K)   (from the level-3 data)
    torch.cumsum              inclusive prefix sums over programs (a device op)
    _emit_kernel        [P]   write (index + offset, wire(acc)) at its slot; residual update

P = number of programs, each handling ``tiles`` consecutive tiles of BLOCK elements. Slots:
entries with key > K fill ``[0, k - need)`` in index order (program prefix + in-program
rank), entries with key == K get a global tie rank (same construction) and the first
``need`` of them fill ``[k - need, k)``: ties go to the lowest indices, deterministically.
With a residual, later passes read ``acc`` from it (pass 1 stored it) and the emit pass only
writes the selected entries (unselected ones already hold ``acc``) and the unselected ones
whose acc is +-Inf or NaN (they get +0, as the sent ones do: a non-finite acc is never kept
in the residual). Without one, every pass recomputes ``acc = T(g / divisor)`` from grad.
"""
import torch
import triton
import triton.language as tl

from sparsecomm.ops.triton import radix
from sparsecomm.ops.triton.radix import block_cumsum, block_sum, emit_entries, load_acc, magnitude_key, to_f32


@triton.jit
def _block_counts_kernel(state_ptr, blockhist_ptr, blockgt_ptr, counts_ptr, nprog):
    """counts[0, p] = #(key > K), counts[1, p] = #(key == K) in program p's range."""
    pid = tl.program_id(0)
    kth = tl.load(state_ptr + 8)
    digit = kth & 0x7F
    bins = tl.arange(0, 128)
    h = tl.load(blockhist_ptr + pid * 128 + bins)
    gt = tl.load(blockgt_ptr + pid)
    above = gt + block_sum(tl.where(bins > digit, h, 0))
    ties = block_sum(tl.where(bins == digit, h, 0))
    tl.store(counts_ptr + pid, above)
    tl.store(counts_ptr + nprog + pid, ties)


@triton.jit
def _emit_kernel(g_ptr, src_ptr, state_ptr, counts_ptr, incl_ptr, idx_out_ptr, val_out_ptr,
                 n, k, divisor, index_offset, tiles, nprog,
                 FROM_SRC: tl.constexpr, WRITE_RESIDUAL: tl.constexpr, LIMIT: tl.constexpr,
                 BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    kth = tl.load(state_ptr + 8)
    need = tl.load(state_ptr + 9)
    run_above = tl.load(incl_ptr + pid) - tl.load(counts_ptr + pid)
    run_ties = tl.load(incl_ptr + nprog + pid) - tl.load(counts_ptr + nprog + pid)
    tie_base = k - need
    start = pid.to(tl.int64) * tiles * BLOCK
    T: tl.constexpr = g_ptr.dtype.element_ty
    V: tl.constexpr = val_out_ptr.dtype.element_ty
    for t in range(tiles):
        offs = start + t * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        acc = load_acc(g_ptr, src_ptr, offs, m, divisor, FROM_SRC)
        a32 = to_f32(acc)
        key = magnitude_key(a32)
        is_above = m & (key > kth)
        is_tie = m & (key == kth)
        above_i = is_above.to(tl.int32)
        tie_i = is_tie.to(tl.int32)
        slot_above = run_above + block_cumsum(above_i) - 1
        tie_rank = run_ties + block_cumsum(tie_i) - 1
        sel = is_above | (is_tie & (tie_rank < need))
        slot = tl.where(is_above, slot_above, tie_base + tie_rank)
        emit_entries(idx_out_ptr, val_out_ptr, src_ptr, slot, offs, index_offset, a32, key, sel, m, T, V, LIMIT,
                     WRITE_RESIDUAL)
        run_above += block_sum(above_i)
        run_ties += block_sum(tie_i)


def ef_topk_pack(grad, residual, divisor, add_residual, k, indices_out, values_out, index_offset=0) -> None:
    """Exact top-k of the compensated gradient, packed; residual updated (see csrc/README.md)."""
    radix.check_vectors("ef_topk_pack", grad, residual=residual, indices_out=indices_out, values_out=values_out)
    n = grad.numel()
    k = int(k)
    if not 1 <= k <= n:
        raise ValueError(f"ef_topk_pack: k must be in [1, {n}], got {k}")
    if indices_out.numel() < k or values_out.numel() < k:
        raise ValueError(f"ef_topk_pack: indices_out/values_out must hold k={k} entries")
    if add_residual and residual is None:
        raise ValueError("ef_topk_pack: add_residual needs a residual")
    index_offset = int(index_offset)
    radix.check_index_offset("ef_topk_pack", n, index_offset)
    divisor = float(divisor)

    block, tiles, nprog = radix.geometry(n, grad.device)
    ws = radix.workspace(nprog, per_block=True, device=grad.device)
    has_residual = residual is not None
    src = residual if has_residual else grad
    radix.radix_select(grad, src, ws, n, k, divisor, from_src=False, add_residual=bool(add_residual),
                       write_residual=has_residual, per_block=True,
                       block=block, tiles=tiles, nprog=nprog)
    views = radix.regions(ws, nprog)
    state, counts, blockgt, blockhist = views["state"], views["counts"], views["blockgt"], views["blockhist"]
    _block_counts_kernel[(nprog,)](state, blockhist, blockgt, counts, nprog, num_warps=1, enable_fp_fusion=False)
    incl = torch.cumsum(counts.view(2, nprog), dim=1, dtype=torch.int32)
    limit = radix.wire_limit(grad.dtype, values_out.dtype)
    _emit_kernel[(nprog,)](grad, src, state, counts, incl, indices_out, values_out, n, k, divisor,
                           index_offset, tiles, nprog, FROM_SRC=has_residual, WRITE_RESIDUAL=has_residual,
                           LIMIT=limit, BLOCK=block, num_warps=radix.NUM_WARPS, enable_fp_fusion=False)
