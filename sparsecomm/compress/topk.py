"""Exact top-k selection by magnitude: the one rule every selection and kernel follows.

Entries rank by :func:`magnitude_key` (``|x|`` as float32 bits: +-Inf above every finite
value, NaN above Inf, one key for every NaN, so an overflow is always sent and seen by
every rank); among equal keys the lower index comes first. The native, CUDA and Triton
kernels select exactly this set (``csrc/README.md``).
"""
import math

import torch


def num_selected(numel: int, density: float) -> int:
    """Number of entries a bucket of ``numel`` elements sends at ``density`` (at least 1)."""
    # Round away float noise first: 0.07 * 100 is 7.000000000000001, which must give 7.
    return min(numel, max(1, math.ceil(round(density * numel, 6))))


_KEY_MASK = 0x7FFFFFFF
_NAN_KEY = 0x7F800001  # every NaN: just above Inf (NaN payload bits are not portable)


def magnitude_key(x: torch.Tensor) -> torch.Tensor:
    """int32 key ordering entries by magnitude: +-Inf above finite, NaN above Inf, one key for all NaN."""
    return (x.float().view(torch.int32) & _KEY_MASK).clamp_(max=_NAN_KEY)


def topk_by_key(key: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (int64, ascending) of the k largest keys; equal keys: lower index first."""
    if k >= key.numel():
        return torch.arange(key.numel(), device=key.device)
    kth = torch.topk(key, k, sorted=False).values.min()
    above = torch.nonzero(key > kth).flatten()
    ties = torch.nonzero(key == kth).flatten()[: k - above.numel()]
    return torch.sort(torch.cat([above, ties])).values


def topk_indices(acc: torch.Tensor, k: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Indices (int64, ascending) of the ``k`` entries of the 1-D tensor ``acc`` with the
    largest magnitude (the rule above). ``generator`` is unused; it keeps one signature for
    all selectors."""
    del generator
    return topk_by_key(magnitude_key(acc), k)


def per_parameter(selector, ks: tuple[int, ...], numels: tuple[int, ...]):
    """A selector that takes ``ks[i]`` entries inside the i-th parameter's slice of a bucket.

    Choosing k per parameter (layer-wise top-k) makes the selection independent of how DDP
    groups parameters into buckets: results do not change with ``bucket_cap_mb`` or across
    DDP's bucket rebuild, so a run resumed from a checkpoint (whose first iteration uses
    DDP's initial layout) matches the uninterrupted run bit for bit. It also keeps small
    layers from being starved by large ones. Returned indices are bucket-relative.
    """
    def select(acc: torch.Tensor, k: int, generator: torch.Generator | None = None) -> torch.Tensor:
        assert k == sum(ks), (k, ks)
        parts, offset = [], 0
        for k_part, numel in zip(ks, numels):
            parts.append(selector(acc[offset : offset + numel], k_part, generator) + offset)
            offset += numel
        return torch.cat(parts)

    return select
