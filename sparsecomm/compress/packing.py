"""One-buffer payload of a sparse bucket: int32 indices, then values.

Layout of a payload for capacity ``k`` and value dtype ``V`` (bytes, uint8 tensor)::

    [ k x int32 index | k x V value ]

Indices come first so both views start on an aligned offset (4*k is a multiple of every
value size), and the payload is padded to a multiple of 8 bytes so that every payload in
an all-gathered buffer (rank r starts at r * nbytes) is aligned too. A selection of ``m < k`` entries is padded with (index 0, value 0): adding
zero is harmless, and the fixed size lets every rank use one fixed-size all-gather.
"""
import torch

INDEX_DTYPE = torch.int32
_INDEX_BYTES = 4
_PAYLOAD_ALIGNMENT = 8


def payload_nbytes(k: int, value_dtype: torch.dtype) -> int:
    """Size in bytes of a payload that holds ``k`` (index, value) pairs, padded to 8 bytes."""
    unpadded = k * (_INDEX_BYTES + value_dtype.itemsize)
    return -(-unpadded // _PAYLOAD_ALIGNMENT) * _PAYLOAD_ALIGNMENT


def _views(payload: torch.Tensor, k: int, value_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    index_bytes = k * _INDEX_BYTES
    indices = payload[:index_bytes].view(INDEX_DTYPE)
    values = payload[index_bytes : index_bytes + k * value_dtype.itemsize].view(value_dtype)
    return indices, values


def pack_into(payload: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, k: int) -> None:
    """Write ``indices`` and ``values`` (``m <= k`` each) into ``payload``, padding to k."""
    m = indices.numel()
    assert m == values.numel() and m <= k, (m, values.numel(), k)
    index_view, value_view = _views(payload, k, values.dtype)
    index_view[:m].copy_(indices)
    value_view[:m].copy_(values)
    if m < k:
        index_view[m:].zero_()
        value_view[m:].zero_()
    # Alignment padding is zeroed too, so equal selections give byte-identical payloads.
    payload[index_view.numel() * _INDEX_BYTES + value_view.numel() * value_view.element_size() :].zero_()


def unpack_add(gathered: torch.Tensor, out: torch.Tensor, k: int, value_dtype: torch.dtype) -> torch.Tensor:
    """Overwrite ``out`` with the sum of all payloads in ``gathered`` (world_size x nbytes).

    A scatter-add: ranks that picked the same index add up. Payloads are added in rank
    order, onto zeros, so with two ranks the result is bitwise what an allreduce gives.
    """
    out.zero_()
    for payload in gathered.view(-1, payload_nbytes(k, value_dtype)):
        indices, values = _views(payload, k, value_dtype)
        out.index_add_(0, indices.long(), values.to(out.dtype))
    return out
