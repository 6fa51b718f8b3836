"""The shared-mask exchange (``exchange="shared-mask"``): SCAPE's mask, which every rank derives
alike without communicating, one step ahead.

The mask of a bucket at step t is a function of what every rank holds bit for bit before
step t's gradient exists: the first moment of the *synced* gradient,

    score <- MASK_BETA * score + (1 - MASK_BETA) * reduced      (after every step, dense ones too)

(``reduced`` is the hook's output, the same bits on every rank; with AdamW's or AdamS's
beta1 = 0.9 it is the optimizer's own ``exp_avg`` of what it was fed), and the step number.
SCAPE (Zheng et al., arXiv 2607.01678) takes its masks from AdamS's first moment for the same
reason. So no index travels, and a bucket's values go on the wire, a plain async allreduce of
k values, as soon as backward produces the bucket: what a rank sends and receives does not
grow with the number of ranks, and there are no index bytes at all.

    mask = the refresh window  +  the k - r entries of largest |score| outside it

The refresh window is r = ceil(mask_refresh x k) consecutive entries starting at
``(step x r) mod numel`` (wrapping around): consecutive windows tile the bucket, so every entry
is in the mask at least once in every ceil(numel / r) consecutive steps. A score that decays
where the mask left an entry out could otherwise starve it forever; the window bounds how long
anything waits in a residual (:func:`longest_wait`, which the staleness monitor can hold the
run to). The entries the mask leaves out stay in each rank's error feedback, as with every
wire. Ties of |score|: lower index first (``compress.topk.topk_by_key``), so ranks agree on any CPU.

A step whose reduced bucket is not finite (an overflow, skipped by the loop) leaves the score
as it was; a step the hook rolls back (``StepJournal``) restores it with the residuals.
"""
import math

import torch

from sparsecomm.compress.topk import magnitude_key, topk_by_key
from sparsecomm.hooks.wires.shared_index import AllreducedValues, shared_values

MASK_BETA = 0.9  # AdamW's (and AdamS's) default beta1: the score is the synced first moment


def refresh_entries(k: int, refresh: float) -> int:
    """Entries of the refresh window in a mask of ``k`` (at least 1)."""
    return min(k, max(1, math.ceil(round(refresh * k, 6))))


def longest_wait(numel: int, k: int, refresh: float) -> int:
    """The most consecutive steps an entry of a bucket of ``numel`` can stay out of the mask."""
    return math.ceil(numel / refresh_entries(k, refresh)) - 1


def shared_mask(score: torch.Tensor, step: int, k: int, refresh: float) -> torch.Tensor:
    """Indices (int64, ascending) of step ``step``'s mask over a bucket whose score is ``score``."""
    numel = score.numel()
    if k >= numel:
        return torch.arange(numel, device=score.device)
    r = refresh_entries(k, refresh)
    window = (torch.arange(r, device=score.device) + (step * r) % numel) % numel
    if k == r:
        return torch.sort(window).values
    key = magnitude_key(score)
    key[window] = -1  # below every magnitude: the window's entries are in already
    return torch.sort(torch.cat([window, topk_by_key(key, k - r)])).values


def follow_reduced(score: torch.Tensor):
    """A Future callback that folds the reduced bucket into ``score`` (when it is finite)."""

    def fold(fut: torch.futures.Future) -> torch.Tensor:
        reduced = fut.value()
        if bool(torch.isfinite(reduced).all()):
            score.mul_(MASK_BETA).add_(reduced.to(score.dtype), alpha=1 - MASK_BETA)
        return reduced

    return fold


class SharedMaskWire(AllreducedValues):
    """The values of acc at the shared mask, allreduced: no index bytes, no broadcast."""

    name = "shared_mask"

    def encode(self, call, residual, fused: bool):
        score = call.mask_score
        indices = shared_mask(score, call.state.step, self.k, self.config.mask_refresh)
        return shared_values(call, residual, indices.to(call.grad.device))
