"""Exact top-k selection by magnitude."""
import math

import torch


def num_selected(numel: int, density: float) -> int:
    """Number of entries a bucket of ``numel`` elements sends at ``density`` (at least 1)."""
    # Round away float noise first: 0.07 * 100 is 7.000000000000001, which must give 7.
    return min(numel, max(1, math.ceil(round(density * numel, 6))))


def topk_indices(acc: torch.Tensor, k: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Indices (int64) of the ``k`` entries of the 1-D tensor ``acc`` with the largest magnitude.

    Ties are broken by ``torch.topk``; NaN counts as the largest magnitude, so a NaN in the
    gradient is sent (and seen by every rank) rather than hidden in a residual.
    ``generator`` is unused; it keeps one signature for all selectors.
    """
    del generator
    if k >= acc.numel():
        return torch.arange(acc.numel(), device=acc.device)
    return torch.topk(acc.abs(), k, sorted=False).indices


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
