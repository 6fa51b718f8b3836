"""The dense wire: a ring allreduce of the whole bucket (warm-up, the dense fallback, or
``exchange="auto"``'s choice); acc is formed, sent in full, and the residual cleared.

And buckets of sparse (COO) gradients (``nn.Embedding(sparse=True)``): averaged by a sparse
allreduce, as DDP's default hook does. They are already as compact as their non-zero
rows; there is no residual.
"""
import torch

from sparsecomm.comm import allreduce_future, link_model
from sparsecomm.hooks.state.unused_parameters import SentRecord
from sparsecomm.hooks.wires.base import Wire


class DenseWire(Wire):
    """Steps 3-6 in one: allreduce the compensated bucket, note whether the sum is finite."""

    dense = True

    def __init__(self, config, world_size: int, warmup: bool):
        super().__init__(config, None, world_size)
        self.warmup = warmup  # counted as a warm-up call, else as a fallback

    def matches(self, other) -> bool:
        return super().matches(other) and self.warmup == other.warmup

    def modelled_seconds(self, numel, buffer_dtype, link) -> float:
        return link_model.ring_allreduce_seconds(numel * buffer_dtype.itemsize, self.world_size,
                                                 rate_bytes_per_s=link.bytes_per_s, alpha_s=link.latency_s)

    def reduce(self, call, velocity, residual) -> torch.futures.Future:
        """Allreduce the bucket, compensated (steps 2-6 in one); any residual is sent in full and cleared."""
        context, grad, out = call.context, call.grad, call.out
        if velocity is not None and not bool(torch.isfinite(grad).all()):
            velocity.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        if grad is not out:  # memories wider than the bucket: the wire carries the bucket's dtype
            out.copy_(grad)
            if residual is not None:  # what rounding to the bucket's dtype lost stays behind
                residual.copy_(grad).sub_(out).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        elif residual is not None:
            residual.zero_()
        if context.unused is not None and residual is not None:
            context.unused.record(call.index, SentRecord(call.names, call.numels, dense=out.clone()))
        call.emit("packed", True, acc=grad, residual=residual, indices=None, payload=out)
        nbytes = out.numel() * out.element_size()
        context.count(
            **{"warmup_calls" if self.warmup else "fallback_calls": 1},
            elements_total=out.numel(),
            bytes_dense=nbytes,
            bytes_sent=nbytes,
            bytes_received=link_model.ring_allreduce_bytes(nbytes, call.world_size),
        )
        fut = allreduce_future(out, call.group)
        if context.journal is None:
            return fut

        def note(done: torch.futures.Future) -> torch.Tensor:
            reduced = done.value()
            context.journal.note_reduced(~torch.isfinite(reduced).all())
            return reduced

        return fut.then(note)


def reduce_sparse_gradients(context, buffer, group, world_size) -> torch.futures.Future:
    """A bucket of sparse (COO) gradients, averaged as DDP's default hook does."""
    buffer.div_(world_size)
    nbytes = buffer._values().numel() * buffer.element_size() + buffer._indices().numel() * 8
    context.count(sparse_gradient_calls=1, elements_total=buffer.numel(), bytes_sent=nbytes,
                bytes_dense=buffer.numel() * buffer.element_size(), bytes_received=(world_size - 1) * nbytes)
    return allreduce_future(buffer, group)
