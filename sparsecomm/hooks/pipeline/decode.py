"""Stage 6: decode what arrived and accumulate it into the bucket (in the Future callback).

Payloads are added in rank order onto zeros, so with two ranks the result is bitwise what
an allreduce gives. In rollback mode each callback also notes whether the reduced bucket
holds an Inf/NaN (the step is then undone at the start of the next one); only entries some
rank sent can be non-finite (a sent Inf/NaN, or a sum that overflowed), so only those are read.
"""
import time

import torch

from sparsecomm import ops
from sparsecomm.compress.chunk_layout import ChunkLayout
from sparsecomm.compress.layout import PayloadLayout
from sparsecomm.compress.owner_layout import OwnerLayout
from sparsecomm.hooks.pipeline import integrity


def fixed(call, layout: PayloadLayout | ChunkLayout):
    """The callback of a fixed-size all-gather: check every sealed payload (``wire_checksum``:
    a bucket with a failed one is not decoded: ``integrity.refused``), then scatter-add every
    payload into the bucket."""
    state, step, seals = call.state, call.state.step, call.state._seals
    trailer = integrity.trailer_bytes(state.config)

    def accumulate(fut: torch.futures.Future) -> torch.Tensor:
        gathered = fut.value()
        if trailer:  # rows of [payload | trailer]: all checked before any is decoded
            started = time.perf_counter()
            rows = gathered.view(call.world_size, layout.nbytes + trailer)
            bad = integrity.bad_rows(rows)
            state._count(seconds_wire_checksum=time.perf_counter() - started)
            if bad:
                return integrity.refused(call, step, seals, [(integrity.PAYLOAD, sender, 0) for sender in bad])
            gathered = rows[:, : layout.nbytes]
        started = time.perf_counter()
        if isinstance(layout, ChunkLayout):
            ops.dispatch.chunk_decode_add(gathered, layout, call.out, True)
            state._count(seconds_unpack=time.perf_counter() - started)
            if state._journal is not None:  # unsent entries are 0: the whole bucket says the same
                state._journal.note_reduced(~torch.isfinite(call.out).all())
            return call.out
        indices, values = layout.views(gathered)
        ops.unpack_add(indices, values, call.out, True)  # in place: no second bucket-size tensor
        state._count(seconds_unpack=time.perf_counter() - started)
        if state._journal is not None:
            _note(state, call.out, indices)
        return call.out

    return accumulate


def variable(call, counts, value_dtype):
    """The callback of the variable-size MPI all-gather: check every sealed payload
    (``wire_checksum``, as :func:`fixed`), then add them."""
    state, step, seals = call.state, call.state.step, call.state._seals
    trailer = integrity.trailer_bytes(state.config)

    def accumulate(fut: torch.futures.Future) -> torch.Tensor:
        if trailer:
            started = time.perf_counter()
            bad, offset = [], 0
            for rank, m in enumerate(counts):  # payloads of different sizes: one check each
                sealed = PayloadLayout(m, value_dtype).nbytes + trailer
                if integrity.bad_rows(fut.value()[offset : offset + sealed].view(1, -1)):
                    bad.append(rank)
                offset += sealed
            state._count(seconds_wire_checksum=time.perf_counter() - started)
            if bad:
                return integrity.refused(call, step, seals, [(integrity.PAYLOAD, sender, 0) for sender in bad])
        started = time.perf_counter()
        out = unpack_variable(fut.value(), counts, call.out, value_dtype, trailer)
        state._count(seconds_unpack=time.perf_counter() - started)
        if state._journal is not None:
            _note(state, out, variable_indices(fut.value(), counts, value_dtype, trailer))
        return out

    return accumulate


def scatter_values(call, indices):
    """The callback of random-k's allreduce: the summed values at the shared indices."""
    state = call.state

    def scatter(fut: torch.futures.Future) -> torch.Tensor:
        reduced = fut.value()[: indices.numel()]  # (the shared-index exchange may sum one more element)
        if state._journal is not None:
            state._journal.note_reduced(~torch.isfinite(reduced).all())
        call.out.zero_()
        call.out[indices] = reduced.to(call.out.dtype)
        return call.out

    return scatter


def _note(state, out: torch.Tensor, index_rows: torch.Tensor) -> None:
    state._journal.note_reduced(~torch.isfinite(out.index_select(0, index_rows.reshape(-1).long())).all())


def unpack_variable(gathered: torch.Tensor, counts, out: torch.Tensor, value_dtype,
                    trailer: int = 0) -> torch.Tensor:
    """Overwrite ``out`` with the sum of back-to-back payloads of ``counts[r]`` entries (each
    followed by ``trailer`` bytes), in rank order."""
    out.zero_()
    offset = 0
    for m in counts:
        layout = PayloadLayout(m, value_dtype)
        if m:  # onto zeros in rank order: the same additions as the fixed-size unpack
            indices, values = layout.views(gathered[offset : offset + layout.nbytes])
            ops.unpack_add(indices, values, out, False)
        offset += layout.nbytes + trailer
    return out


def variable_indices(gathered: torch.Tensor, counts, value_dtype, trailer: int = 0) -> torch.Tensor:
    """Every index in back-to-back variable payloads (for the finiteness check)."""
    parts, offset = [torch.zeros(1, dtype=torch.int32, device=gathered.device)], 0
    for m in counts:
        layout = PayloadLayout(m, value_dtype)
        if m:
            parts.append(layout.payload_views(gathered[offset : offset + layout.nbytes])[0])
        offset += layout.nbytes + trailer
    return torch.cat(parts)


def sent(packed, like: torch.Tensor) -> torch.Tensor:
    """The dense tensor that this rank's packed entries decode to (for the conservation audit)."""
    if packed.layout is None:  # random-k: bare values at the indices
        return torch.zeros_like(like).index_put_((packed.indices,), packed.values.to(like.dtype))
    out = torch.zeros_like(like)
    if isinstance(packed.layout, OwnerLayout):  # the messages for every owner, decoded by the reference
        indices, values = packed.layout.decode(packed.send)
        return out.index_put_((indices,), values.to(out.dtype))
    if isinstance(packed.layout, ChunkLayout):
        ops.dispatch.chunk_decode_add(packed.send, packed.layout, out, False)
    elif packed.layout.capacity:  # an empty variable payload decodes to nothing
        indices, values = packed.layout.views(packed.send)
        ops.unpack_add(indices, values, out, False)
    return out
