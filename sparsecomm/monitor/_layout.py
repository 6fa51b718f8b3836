"""Where an entry of a flat bucket lives, and how a sparse payload is laid out.

Shared by the guards (to name the parameter holding a bad entry) and the fault injector
(to hit a chosen parameter or payload value). Private: the public API is the monitors.
"""
import bisect
import itertools

import torch

from sparsecomm.compress.packing import payload_nbytes

_INDEX_BYTES = 4  # int32 indices come first in a payload (see sparsecomm.compress.packing)


def locate(names, numels, flat_index: int) -> tuple[str, int]:
    """(parameter name, index inside that parameter) of entry ``flat_index`` of a bucket."""
    starts = list(itertools.accumulate(numels, initial=0))
    if not 0 <= flat_index < starts[-1]:
        raise IndexError(f"flat index {flat_index} outside a bucket of {starts[-1]} elements")
    position = bisect.bisect_right(starts, flat_index) - 1
    return names[position], flat_index - starts[position]


def offset_of(names, numels, name: str) -> int | None:
    """Flat offset of parameter ``name`` in a bucket, None if the bucket does not hold it."""
    offset = 0
    for candidate, numel in zip(names, numels):
        if candidate == name:
            return offset
        offset += numel
    return None


def payload_layout(payload: torch.Tensor, acc: torch.Tensor, indices: torch.Tensor, state=None):
    """(capacity k, value dtype) of a packed sparse payload.

    The value dtype is ``state.value_dtype`` (None: the bucket's dtype), or the bucket's
    dtype without a state. The capacity is the smallest k >= the number of selected
    entries whose payload has this size. That is exact whenever the selector fills every
    slot (exact top-k does: k = sum of the per-parameter k's) and for 4-byte values; a
    sampled selector that leaves slots empty with 2-byte values could be ambiguous (two
    capacities pad to the same size) and then the smaller one is taken. The event does
    not carry k, so this is inferred rather than read (see the monitor package's notes).
    """
    value_dtype = (getattr(state, "value_dtype", None) if state is not None else None) or acc.dtype
    k = indices.numel()
    while payload_nbytes(k, value_dtype) < payload.numel():
        k += 1
    if payload_nbytes(k, value_dtype) != payload.numel():
        raise ValueError(
            f"a payload of {payload.numel()} bytes does not hold {indices.numel()} or more "
            f"{value_dtype} values; pass the TopKState (state=...) if the wire dtype differs from the bucket's"
        )
    return k, value_dtype


def payload_values(payload: torch.Tensor, k: int, value_dtype: torch.dtype) -> torch.Tensor:
    """The value region of a payload as a tensor of ``value_dtype`` (a copy, never a view)."""
    start = _INDEX_BYTES * k
    raw = payload[start : start + k * value_dtype.itemsize]
    return raw.clone().view(value_dtype)  # the clone is aligned whatever the byte offset


def value_byte_offset(k: int, value_dtype: torch.dtype, position: int) -> int:
    """Byte offset in the payload of the ``position``-th value (little-endian)."""
    if not 0 <= position < k:
        raise IndexError(f"payload position {position} outside a payload of capacity {k}")
    return _INDEX_BYTES * k + position * value_dtype.itemsize
