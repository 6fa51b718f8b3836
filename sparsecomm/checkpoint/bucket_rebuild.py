"""Let DDP rebuild its buckets right after a restore, without training a step.

DDP lays its gradient buckets out one way for the first iteration of a process and
rebuilds them (in gradient-ready order, with a larger first bucket) after that iteration.
A process that resumes from a checkpoint therefore runs its first step with a different
bucket layout than the uninterrupted run had at that step, and a per-bucket top-k
(``k_scope="bucket"``) then selects differently: the resumed run would drift from the
uninterrupted one. Running one throwaway forward/backward, with the hook told to change
nothing and the RNG restored afterwards, makes DDP rebuild before the first real step.
"""
from typing import Callable

import torch

from sparsecomm.checkpoint.rng import capture_rng, restore_rng


def rebuild_buckets(ddp_model: torch.nn.parallel.DistributedDataParallel, hook_state,
                    forward_backward: Callable[[], None],
                    generators: dict[str, torch.Generator] | None = None) -> None:
    """Run ``forward_backward()`` (e.g. ``(loss * 0).backward()`` on any batch) as a pass
    that only teaches DDP its gradient-ready order.

    The hook passes buckets through untouched (no collective, no residual or step
    change), gradients are cleared afterwards, and every RNG is restored, so the next
    step computes exactly what it would have without this call. Collective: every rank
    calls it at the same point.
    """
    rng = capture_rng(generators)
    was_training = ddp_model.training
    hook_state.lifecycle.bypass = True
    try:
        ddp_model.eval()  # no dropout draws; the gradient-ready order is the same
        forward_backward()
    finally:
        hook_state.lifecycle.bypass = False
        ddp_model.train(was_training)
        restore_rng(rng, generators)
        ddp_model.zero_grad(set_to_none=True)
