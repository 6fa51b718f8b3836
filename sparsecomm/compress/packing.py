"""Packing (index, value) pairs into a payload and summing gathered payloads: the reference.

The byte layout itself is defined once, in :mod:`sparsecomm.compress.layout`.
"""
import torch

from sparsecomm.compress.layout import INDEX_DTYPE, PayloadLayout  # noqa: F401  (INDEX_DTYPE re-exported)


def payload_nbytes(k: int, value_dtype: torch.dtype) -> int:
    """Size in bytes of a payload that holds ``k`` (index, value) pairs, padded to 8 bytes."""
    return PayloadLayout(k, value_dtype).nbytes


def pack_into(payload: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, k: int) -> None:
    """Write ``indices`` and ``values`` (``m <= k`` each) into ``payload``, padding to k."""
    m = indices.numel()
    assert m == values.numel() and m <= k, (m, values.numel(), k)
    layout = PayloadLayout(k, values.dtype)
    index_view, value_view = layout.payload_views(payload)
    index_view[:m].copy_(indices)
    value_view[:m].copy_(values)
    if m < k:
        index_view[m:].zero_()
        value_view[m:].zero_()
    # Everything after the values (the alignment pad, and the rest of a reused larger buffer)
    # is zeroed, so equal selections give byte-identical payloads.
    payload[layout.index_bytes + layout.value_bytes :].zero_()


def unpack_add(gathered: torch.Tensor, out: torch.Tensor, k: int, value_dtype: torch.dtype) -> torch.Tensor:
    """Overwrite ``out`` with the sum of all payloads in ``gathered`` (world_size x nbytes).

    A scatter-add: ranks that picked the same index add up. Payloads are added in rank
    order, onto zeros, so with two ranks the result is bitwise what an allreduce gives.
    """
    out.zero_()
    for indices, values in zip(*PayloadLayout(k, value_dtype).views(gathered)):
        out.index_add_(0, indices.long(), values.to(out.dtype))
    return out
