"""Triton ``topk_threshold``: a magnitude threshold whose count is within a bound of k, no host sync.

Semantics: csrc/README.md (oracle: :func:`sparsecomm.ops.reference.topk_threshold`).

The radix select of :mod:`sparsecomm.ops.triton.radix` in threshold mode: after each level's
histogram the select kernel looks at the bin holding the k-th largest key; if the bottom of
that bin (count = keys at or above it) or the bottom of the next bin up (count = keys above
the bin) is within ``floor(max_relative_error * k)`` of k, it stops (later passes mask all
their loads off) and stores that threshold with its exact count. Level 3 resolves the exact
k-th key K; like the reference, K + 1 (count = keys above K) is taken only when ties at K
break the bound and it is strictly closer to k. Threshold and count are written to 0-d
device tensors by the last select kernel::

    ws[:head].zero_()
    hist1_kernel [P], select [1], hist_refine_kernel [P], select [1], hist_refine_kernel [P], select [1]
"""
import torch
import triton
import triton.language as tl

from sparsecomm.ops.triton import radix


@triton.jit
def _outputs_kernel(state_ptr, thr_out_ptr, count_out_ptr):
    tl.store(thr_out_ptr, tl.load(state_ptr + 12).to(tl.float32, bitcast=True))
    tl.store(count_out_ptr, tl.load(state_ptr + 13).to(tl.int64))


def topk_threshold(x: torch.Tensor, k: int, max_relative_error: float = 0.05):
    """(threshold: 0-d float32, count: 0-d int64) with |count - k| <= max_relative_error * k."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"topk_threshold: x must be a tensor, got {type(x).__name__}")
    n = x.numel()
    k = int(k)
    if not 1 <= k <= n:
        raise ValueError(f"topk_threshold: k must be in [1, {n}], got {k}")
    if n > radix.INT32_MAX:
        raise ValueError(f"topk_threshold: x has {n} elements; at most {radix.INT32_MAX} are supported")
    if x.dtype not in radix.GRAD_DTYPES:
        x = x.float()
    x = x.reshape(-1)
    if not x.is_contiguous():
        x = x.contiguous()
    slack = radix.threshold_slack(k, float(max_relative_error))

    block, tiles, nprog = radix.geometry(n, x.device)
    ws = radix.workspace(nprog, per_block=False, device=x.device)
    radix.radix_select(x, x, ws, n, k, 1.0, from_src=True, add_residual=False, write_residual=False,
                       threshold_mode=True, slack=slack, per_block=False, block=block, tiles=tiles, nprog=nprog)
    threshold = torch.empty((), dtype=torch.float32, device=x.device)
    count = torch.empty((), dtype=torch.int64, device=x.device)
    _outputs_kernel[(1,)](radix.regions(ws, nprog)["state"], threshold, count, num_warps=1, enable_fp_fusion=False)
    return threshold, count
