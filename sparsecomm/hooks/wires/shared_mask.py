"""The shared-mask exchange (``exchange="shared-mask"``): a mask every rank derives alike
without communicating, one step ahead (SCAPE's idea, Zheng et al., arXiv 2607.01678).

The mask of a bucket at step t is a function of what every rank holds bit for bit before
step t's gradient exists: the reduced buckets of the steps before (the hook's output, the
same bits on every rank) and the step number. So no index travels, and a bucket's values go
on the wire, a plain async allreduce of k values, as soon as backward produces the bucket:
what a rank sends and receives does not grow with the number of ranks, and there are no
index bytes at all. Two memories per entry, the same on every rank:

- ``age``: steps since the entry was last sent (0 after a dense step);
- ``rate``: the synced gradient per step, an EMA (``MASK_BETA``, AdamW's beta1) of what
  each send delivered divided by the steps it covered, ``reduced / (age + 1)``: an entry
  left out for a steps is sent with a + 1 steps of gradient in the residuals.

    priority = |rate| x (age + 1)       what the ranks' residuals are expected to hold there
    mask     = the refresh window  +  the k - r entries of largest priority outside it

A mask ranked by the synced gradient alone starves: what it left out never shows in the
synced gradient again. Ranking by the expected residual lets a left-out entry rise as it
waits. The refresh window, r = ceil(mask_refresh x k) consecutive entries starting at
``(step x r) mod numel`` (wrapping), bounds the wait whatever the priorities: consecutive
windows tile the bucket, so every entry is sent at least once in every ceil(numel / r)
steps (:func:`longest_wait`). Ties of priority: lower index first
(``compress.topk.topk_by_key``), so ranks agree on any CPU.

A step whose reduced bucket is not finite (an overflow, skipped by the loop) leaves both
memories as they were; a step the hook rolls back (``StepJournal``) restores them with the
residuals.
"""
import math

import torch

from sparsecomm.compress.topk import magnitude_key, topk_by_key
from sparsecomm.hooks.wires.shared_index import AllreducedValues, shared_values

MASK_BETA = 0.9  # AdamW's (and AdamS's) default beta1


def refresh_entries(k: int, refresh: float) -> int:
    """Entries of the refresh window in a mask of ``k`` (at least 1)."""
    return min(k, max(1, math.ceil(round(refresh * k, 6))))


def longest_wait(numel: int, k: int, refresh: float) -> int:
    """The most consecutive steps an entry of a bucket of ``numel`` can stay out of the mask."""
    return math.ceil(numel / refresh_entries(k, refresh)) - 1


def shared_mask(priority: torch.Tensor, step: int, k: int, refresh: float) -> torch.Tensor:
    """Indices (int64, ascending) of step ``step``'s mask over a bucket of these priorities."""
    numel = priority.numel()
    if k >= numel:
        return torch.arange(numel, device=priority.device)
    r = refresh_entries(k, refresh)
    window = (torch.arange(r, device=priority.device) + (step * r) % numel) % numel
    if k == r:
        return torch.sort(window).values
    key = magnitude_key(priority)
    key[window] = -1  # below every magnitude: the window's entries are in already
    return torch.sort(torch.cat([window, topk_by_key(key, k - r)])).values


def priority(rate: torch.Tensor, age: torch.Tensor) -> torch.Tensor:
    return rate.abs() * (age + 1)


def follow_reduced(rate: torch.Tensor, age: torch.Tensor, indices: torch.Tensor | None):
    """A Future callback that folds the reduced bucket into ``rate`` and ``age`` (when it is
    finite): at ``indices`` (None: a dense step, every entry) what was sent, elsewhere one
    more step of waiting."""

    def fold(fut: torch.futures.Future) -> torch.Tensor:
        reduced = fut.value()
        # Whether to fold stays on the device (no host sync in the callback): a non-finite
        # bucket writes back the old values.
        finite = torch.isfinite(reduced).all()
        if indices is None:
            new_rate = rate * MASK_BETA + reduced.to(rate.dtype) * (1 - MASK_BETA)
            new_age = torch.zeros_like(age)
        else:
            new_rate, new_age = rate.clone(), age + 1
            per_step = reduced[indices].to(rate.dtype) / (age[indices] + 1)
            new_rate[indices] = rate[indices] * MASK_BETA + per_step * (1 - MASK_BETA)
            new_age[indices] = 0
        rate.copy_(torch.where(finite, new_rate, rate))
        age.copy_(torch.where(finite, new_age, age))
        return reduced

    return fold


def read_memories(call) -> tuple[torch.Tensor, torch.Tensor]:
    """What the mask is derived from, the same on every rank: the bucket's synced rates and ages
    (``call.mask_memory``). Every reduced bucket is folded into them, dense ones too (the dense
    wire reads them under this exchange), by :func:`follow_reduced`."""
    memories = call.context.memories
    call.mask_memory = tuple(memory.bucket_tensor(call.index, call.names, call.numels, call.grad, torch.float32)
                             for memory in (memories.mask_rates, memories.mask_ages))
    return call.mask_memory


class SharedMaskWire(AllreducedValues):
    """The values of acc at the shared mask, allreduced: no index bytes, no broadcast."""

    name = "shared_mask"

    def prepare(self, call, residual) -> list[torch.Tensor]:
        return [*super().prepare(call, residual), *read_memories(call)]

    def follow(self, call, fut, indices):
        return fut.then(follow_reduced(*call.mask_memory, indices))

    def encode(self, call, residual, fused: bool):
        rate, age = call.mask_memory
        indices = shared_mask(priority(rate, age), call.context.step, self.k, self.config.mask_refresh)
        return shared_values(call, residual, indices.to(call.grad.device))
