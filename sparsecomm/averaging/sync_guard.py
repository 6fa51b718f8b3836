"""The outer sync's non-finite guard: what a refused sync reports.

The guard needs no collective of its own. The wire contract (csrc/README.md) ranks Inf and
NaN above every finite magnitude, so each chunk (or the exact top-k) holding one sends one,
and it decodes as non-finite on every receiver, for every selector and value codec; so an
Inf or NaN in any rank's delta or error buffer reaches the all-gathered payloads, which
every rank decodes, bit for bit alike, into the same mean and the same new anchor. One check of the new anchor (``anchor
- outer_lr * mean`` is finite exactly when the mean is and the step does not overflow),
:func:`all_finite`, therefore gives every rank the same verdict. Only when it fails are the payloads decoded
again one rank at a time, to name the ranks that sent a non-finite value.
"""
from collections.abc import Callable

import torch

from sparsecomm.errors import NonFiniteSyncError


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every entry of ``tensor`` is finite, exactly. A finite sum proves it in one
    fast pass (an Inf or NaN entry makes the sum Inf or NaN; torch.isfinite(t).all() costs
    about 25 times more on CPU); only a non-finite sum, finite entries that overflowed
    included, pays the entry-wise check. The answer is exact either way, so it is the same
    on every rank whatever order the sum took."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def refusal(gathered: torch.Tensor, decode_one: Callable[[torch.Tensor], torch.Tensor], step: int) -> NonFiniteSyncError:
    """The error for a sync whose new anchor is not finite. ``gathered``: [world_size, bytes],
    every rank's payload; ``decode_one(row)``: that payload decoded into a dense tensor."""
    ranks = [rank for rank in range(gathered.shape[0]) if not bool(torch.isfinite(decode_one(gathered[rank: rank + 1])).all())]
    if ranks:
        cause = (f"rank(s) {ranks} sent Inf or NaN: their weights changed by a non-finite amount since the last "
                 "sync (an optimizer step on non-finite gradients that the loop did not skip?)")
    else:
        cause = ("every rank's payload is finite, but their mean, or the outer step anchor - outer_lr * mean, "
                 "overflowed float32")
    message = (f"SparseDeltaAverager: the outer sync at optimizer step {step} was refused on every rank: {cause}. "
               "Nothing changed: the weights, the anchor, the error buffer and the step count are as they were "
               "before this step() call. Restore a checkpoint (the inner optimizer of the ranks named may hold "
               "Inf or NaN too), and skip every optimizer step whose gradients are not all finite.")
    return NonFiniteSyncError(message, ranks, step)
