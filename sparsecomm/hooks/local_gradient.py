"""A comm hook that reduces nothing: every rank keeps its own gradient.

Two uses. Local steps (:class:`sparsecomm.SparseDeltaAverager` registers it): between two
outer syncs each replica trains on its own data, so DDP must not average the gradients.
And the no-communication floor of a comparison: the step time of a job with nothing sent
(same model, same kernels, same DDP bucketing) is what no compression can beat.
"""
import torch
import torch.distributed as dist


def local_gradient_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket as this rank computed it, no collective (``state`` unused)."""
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done
