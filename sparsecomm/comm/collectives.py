"""Asynchronous c10d collectives wrapped as Futures that hold one tensor.

Issue these from the hook body, in bucket order, never from a Future callback: callbacks
run on other threads in any order, and gloo fails or hangs when ranks issue collectives
in different orders (docs/architecture.md, "Rules").
"""
import torch
import torch.distributed as dist

# torch 2.13 deprecates all_gather_into_tensor in favour of all_gather_single; older
# releases only have the former.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def allreduce_future(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.futures.Future:
    """Sum ``tensor`` in place over ``group``; the Future holds ``tensor``."""
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def allgather_future(
    out: torch.Tensor, payload: torch.Tensor, group: dist.ProcessGroup
) -> torch.futures.Future:
    """Gather every rank's equal-size ``payload`` into ``out`` (world_size x payload, in rank order)."""
    return _holding(_all_gather_single(out, payload, group=group, async_op=True), out)


def gather_unequal_future(out: torch.Tensor, payload: torch.Tensor, sizes, group: dist.ProcessGroup
                          ) -> torch.futures.Future:
    """Gather every rank's ``payload`` (``sizes[r]`` bytes from rank r) into ``out``
    (``sum(sizes)`` bytes, rank order), unpadded: an all-to-all in which each rank sends its
    payload to every rank, issued and not waited for. What an all-gather of payloads padded
    to the largest would cost is gone when the sizes differ much (the shared-index replies)."""
    return _holding(dist.all_to_all_single(out, payload.repeat(len(sizes)), output_split_sizes=list(sizes),
                                           input_split_sizes=[payload.numel()] * len(sizes), group=group,
                                           async_op=True), out)


def _holding(work, out: torch.Tensor) -> torch.futures.Future:
    """The Future of ``work`` that holds ``out`` once the collective that writes it is done."""

    def done(fut: torch.futures.Future) -> torch.Tensor:
        fut.value()  # re-raises a failed or timed-out collective instead of returning stale bytes
        return out

    return work.get_future().then(done)


def all_to_all_bytes(received: torch.Tensor, send: torch.Tensor, send_sizes, received_sizes,
                     group: dist.ProcessGroup) -> None:
    """``all_to_all_single`` of byte buffers, blocking: ``send_sizes[r]`` bytes of ``send`` go to
    rank r, ``received_sizes[r]`` bytes from rank r land in ``received`` (rank order).

    Blocking because what arrives is reduced and sent on in the same hook call (the owner
    exchange): the next collective must be issued from the hook body too."""
    dist.all_to_all_single(received, send, output_split_sizes=list(received_sizes),
                           input_split_sizes=list(send_sizes), group=group)
