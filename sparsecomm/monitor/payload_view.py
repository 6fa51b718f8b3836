"""Where an entry of a flat bucket lives, and how a sparse payload is laid out.

Shared by the guards (to name the parameter holding a bad entry) and the fault injector
(to hit a chosen parameter or payload value). Internal to the monitors: users call the monitors.
"""
import bisect
import itertools

import torch

from sparsecomm.compress.layout import PayloadLayout



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


def payload_layout(payload: torch.Tensor, acc, indices: torch.Tensor, state=None, event=None) -> PayloadLayout:
    """The layout of a packed sparse payload: the one the hook sent with the event, else
    inferred from the payload's size (capacity: the smallest k >= the number of selected
    entries whose payload has this size; the value dtype: ``state.value_dtype``, else the
    bucket's). Inference is exact whenever the selector fills every slot and for 4-byte
    values; a sampled selector that leaves slots empty with 2-byte values could be
    ambiguous (two capacities pad to the same size), which is why the hook sends the layout."""
    layout = getattr(event, "layout", None)
    if layout is not None:
        return layout
    value_dtype = (getattr(state, "value_dtype", None) if state is not None else None) or \
        (acc.dtype if acc is not None else None)
    if value_dtype is None:
        raise ValueError("the payload's layout is unknown: pass the TopKState (state=...)")
    try:
        return PayloadLayout.inferred(payload, indices.numel(), value_dtype)
    except ValueError as error:
        raise ValueError(f"{error}; pass the TopKState (state=...) if the wire dtype differs from the bucket's") from None
