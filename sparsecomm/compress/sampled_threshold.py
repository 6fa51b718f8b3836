"""Sampled-threshold selection (DGC style): estimate the k-th magnitude from a sample.

Reading the whole bucket once to compare against a threshold is much cheaper than a full
top-k. The threshold comes from the exact top-k of a random sample, so the number of
entries above it is only approximately k:

* more than k: keep the k largest of the candidates (an exact top-k over a small set,
  DGC's hierarchical selection), so the payload never exceeds its fixed size;
* fewer than ``(1 - undershoot) * k``: the sample missed; fall back to exact top-k so a
  step never sends far less than asked;
* otherwise send what passed (between ``(1 - undershoot) * k`` and k entries).
"""
import math

import torch

from sparsecomm.compress.topk import topk_indices

# Sample ~1% of the bucket but never fewer than this many entries: below a few thousand
# samples the k-th order statistic of the sample is too noisy at density 1%.
MIN_SAMPLE = 4096
SAMPLE_FRACTION = 0.01
# Accept a selection that falls short of k by at most this fraction.
UNDERSHOOT = 0.2


def sample_size(n: int) -> int:
    """How many of ``n`` entries the threshold is estimated from (all of them when n is small)."""
    return min(n, max(MIN_SAMPLE, math.ceil(SAMPLE_FRACTION * n)))


def sample_positions(n: int, generator: torch.Generator | None, device) -> torch.Tensor:
    """``sample_size(n)`` positions drawn uniformly (with replacement) from ``generator``."""
    return torch.randint(n, (sample_size(n),), generator=generator, device=device)


def threshold_of_sample(sample_magnitude: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """The magnitude of the sample's k-th largest entry, k scaled from n to the sample."""
    k_sample = max(1, math.ceil(k * sample_magnitude.numel() / n))
    return torch.topk(sample_magnitude, k_sample, sorted=False).values.min()


def sampled_threshold_indices(
    acc: torch.Tensor, k: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Indices (int64) of at most ``k`` large-magnitude entries of the 1-D tensor ``acc``.

    ``generator`` draws the sample; pass a per-rank generator owned by the caller so the
    global RNG (and thus the training run) is not disturbed.
    """
    n = acc.numel()
    if k >= n:
        return torch.arange(n, device=acc.device)
    if sample_size(n) == n:
        return topk_indices(acc, k)
    magnitude = acc.abs()
    threshold = threshold_of_sample(magnitude[sample_positions(n, generator, acc.device)], k, n)
    # "not below" rather than ">=": a NaN compares false with everything, and it must be a
    # candidate (NaN ranks above all magnitudes, so an overflow is sent, never dropped).
    candidates = torch.nonzero(~(magnitude < threshold), as_tuple=True)[0]
    count = candidates.numel()
    if count > k:
        return candidates[torch.topk(magnitude[candidates], k, sorted=False).indices]
    if count < (1.0 - UNDERSHOOT) * k:
        return topk_indices(acc, k)
    return candidates
