"""The all-gather of fixed-size payloads: every rank receives every other rank's payload.

The default wire. Its payload has the same size on every rank, so one fixed-size
all-gather (c10d, or MPI ``Iallgatherv`` with ``transport="mpi"``: the same bytes, so the
same result bit for bit) carries a bucket. Two layouts:

* ``PayloadLayout`` (exact top-k, or the sampled threshold): ``[k int32 indices | k values | pad]``;
* ``ChunkLayout``: chunked top-k (``selector="chunk"``), or exact top-k on the compact wire
  (``index_codec``/``value_codec`` given: the bucket is one chunk, scales per 64 entries),
  written by the index and value codecs.

Each rank receives ``(p-1)`` payloads: the traffic grows with the world size.
"""
import time

import torch

from sparsecomm import compress, ops
from sparsecomm.comm import allgather_future, link_model
from sparsecomm.compress.chunk_layout import ChunkLayout
from sparsecomm.hooks.wires import integrity
from sparsecomm.hooks.wires.base import Packed, Wire, kernel_arguments


class AllgatherWire(Wire):
    """Fixed-size payloads, all-gathered; decoded in rank order onto zeros (with two ranks,
    bitwise what an allreduce gives)."""

    name = "allgather"

    def __init__(self, config, layout, world_size: int):
        super().__init__(config, layout, world_size)
        self.trailer = integrity.trailer_bytes(config)
        self.sealed = bool(self.trailer)
        self.payload = self.gathered = None  # allocated by the first encode, reused every step

    @property
    def chunked(self) -> bool:
        """Written by the codecs (chunked selection, or exact top-k on the compact wire)."""
        return isinstance(self.layout, ChunkLayout)

    @property
    def sealed_nbytes(self) -> int:
        """One payload on the wire: the layout's bytes and the checksum's trailer."""
        return self.layout.nbytes + self.trailer

    def smaller_than_dense(self, numel, buffer_dtype) -> bool:
        return not link_model.falls_back_to_dense(self.sealed_nbytes, numel * buffer_dtype.itemsize,
                                                  self.world_size)

    def density_bound(self, buffer_dtype) -> float:
        entry_bytes = self.layout.bytes_per_entry
        return buffer_dtype.itemsize / (self.world_size * entry_bytes)

    def modelled_seconds(self, numel, buffer_dtype, link) -> float:
        return link_model.ring_allgather_seconds(self.sealed_nbytes, self.world_size,
                                                 rate_bytes_per_s=link.bytes_per_s, alpha_s=link.latency_s)

    # ----- 3. select + encode --------------------------------------------------------------

    def fuses_compensation(self, call) -> bool:
        """The kernel forms acc itself where nothing needs it written (``acc.fused``): the
        exact top-k kernel always; the chunk encoder where a kernel (not the reference) runs."""
        if not call.fusable:
            return False
        if self.chunked:
            return ops.dispatch.native_chunk_encode(call.grad, self.layout)
        return self.config.selector == "exact"

    def buffers(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(payload with room for the trailer, gather buffer of world_size of those)."""
        if self.payload is None or self.payload.device != device:
            self.payload = torch.empty(self.sealed_nbytes, dtype=torch.uint8, device=device)
            self.gathered = torch.empty(self.world_size * self.sealed_nbytes, dtype=torch.uint8, device=device)
        return self.payload, self.gathered

    def encode(self, call, residual, fused: bool) -> Packed:
        buffer, _ = self.buffers(call.out.device)
        payload = buffer[: self.layout.nbytes]
        divisor, add_residual = kernel_arguments(call.divisor, residual, fused)
        if self.chunked or (self.config.selector == "exact" and self.config.k_scope == "bucket"):
            packed = self.write(call.grad, residual, divisor, add_residual, payload)
        elif self.config.selector == "exact":  # k_scope="parameter"
            packed = self._write_per_parameter(call, residual, divisor, add_residual, payload)
        else:  # the sampled threshold; the residual is rewritten from acc (read only through it)
            indices = ops.select_and_pack(call.grad, call.k, _selector(self.config, call.ks, call.numels), payload,
                                          call.value_dtype, residual_out=residual,
                                          generator=call.context.generator(call.out.device))
            _, value_view = self.layout.payload_views(payload)
            packed = Packed(payload, self.layout, indices, value_view[: indices.numel()], False)
        packed.fused = fused
        seal(packed, buffer, self.trailer)
        return packed

    def write(self, source: torch.Tensor, residual, divisor: float, add_residual: bool,
              payload: torch.Tensor) -> Packed:
        """The selection of ``acc = source / divisor (+ residual)`` written into ``payload`` (the
        layout's bytes), ``residual`` rewritten to what was not sent: exact top-k of the
        whole vector (the fused kernel), or the chunked / compact selection of the codecs.
        No process group and no hook state: the averager encodes its deltas with it too."""
        if self.chunked:
            indices, decoded = ops.dispatch.chunk_encode(source, residual, divisor, add_residual, self.layout, payload)
            return Packed(payload, self.layout, indices, decoded, False)
        index_view, value_view = self.layout.payload_views(payload)
        ops.ef_topk_pack(source, residual, divisor, add_residual, self.layout.capacity, index_view, value_view, 0)
        self.layout.padding(payload).zero_()
        return Packed(payload, self.layout, index_view, value_view, False)

    def _write_per_parameter(self, call, residual, divisor, add_residual, payload) -> Packed:
        """Exact top-k per parameter slice (``k_scope="parameter"``), into consecutive parts
        of the payload."""
        index_view, value_view = self.layout.payload_views(payload)
        offset = position = 0
        for k_part, numel in zip(call.ks, call.numels):
            part = slice(offset, offset + numel)
            ops.ef_topk_pack(call.grad[part], None if residual is None else residual[part], divisor, add_residual,
                             k_part, index_view[position : position + k_part],
                             value_view[position : position + k_part], offset)
            offset, position = offset + numel, position + k_part
        self.layout.padding(payload).zero_()
        return Packed(payload, self.layout, index_view, value_view[: index_view.numel()], False)

    def decode_add(self, gathered: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` = the sum of every payload of ``gathered`` (rows, or back to back), decoded
        onto zeros in rank order; returns the int32 index rows for an int32 + float payload
        (None for the codecs' payloads)."""
        if self.chunked:
            ops.dispatch.chunk_decode_add(gathered, self.layout, out, True)
            return None
        indices, values = self.layout.views(gathered)
        ops.unpack_add(indices, values, out, True)  # in place: no second bucket-size tensor
        return indices

    # ----- 4. bytes, 5. exchange, 6. decode + accumulate -------------------------------------

    def bytes_received(self, call, packed) -> int:
        return (self.world_size - 1) * packed.wire.numel()

    def exchange(self, call, packed) -> torch.futures.Future:
        _, gathered = self.buffers(call.out.device)
        if self.config.transport == "mpi":  # same bytes as c10d, so the same result bit for bit
            return call.context.transport.allgatherv(packed.wire, gathered,
                                                         [packed.wire.numel()] * self.world_size)
        return allgather_future(gathered, packed.wire, call.group)

    def accumulate(self, call, packed):
        """Check every sealed payload (``wire_checksum``: a bucket with a failed one is not
        decoded: ``integrity.refused``), then scatter-add every payload into the bucket."""
        context, step, seals, layout = call.context, call.context.step, call.context.seals, self.layout

        def accumulate(fut: torch.futures.Future) -> torch.Tensor:
            gathered = fut.value()
            if self.trailer:  # rows of [payload | trailer]: all checked before any is decoded
                started = time.perf_counter()
                rows = gathered.view(self.world_size, self.sealed_nbytes)
                bad = integrity.bad_rows(rows)
                context.count(seconds_wire_checksum=time.perf_counter() - started)
                if bad:
                    return integrity.refused(call, step, seals, [(integrity.PAYLOAD, sender, 0) for sender in bad])
                gathered = rows[:, : layout.nbytes]
            started = time.perf_counter()
            indices = self.decode_add(gathered, call.out)
            context.count(seconds_unpack=time.perf_counter() - started)
            if context.journal is not None:
                if indices is None:  # unsent entries are 0: the whole bucket says the same
                    context.journal.note_reduced(~torch.isfinite(call.out).all())
                else:  # only sent entries can be non-finite
                    note_sent(context, call.out, indices)
            return call.out

        return accumulate

    def sent_dense(self, packed, like) -> torch.Tensor:
        return decode_alone(packed, like)


def seal(packed: Packed, buffer: torch.Tensor, trailer: int) -> None:
    """Seal ``packed.send``, the front of ``buffer``, with the ``trailer`` bytes after it (none: 0)."""
    if trailer:
        packed.sealed = buffer[: packed.send.numel() + trailer]
        integrity.seal(packed.sealed)


def decode_alone(packed: Packed, like: torch.Tensor) -> torch.Tensor:
    """What ``packed``'s own payload decodes to, as a dense tensor like ``like``."""
    out = torch.zeros_like(like)
    if isinstance(packed.layout, ChunkLayout):
        ops.dispatch.chunk_decode_add(packed.send, packed.layout, out, False)
    elif packed.layout.capacity:  # an empty variable payload decodes to nothing
        indices, values = packed.layout.views(packed.send)
        ops.unpack_add(indices, values, out, False)
    return out


def note_sent(context, out: torch.Tensor, index_rows: torch.Tensor) -> None:
    """Tell the step journal whether the reduced bucket holds an Inf/NaN, reading only the
    entries some rank sent (a sent Inf/NaN, or a sum that overflowed: nothing else can be)."""
    context.journal.note_reduced(~torch.isfinite(out.index_select(0, index_rows.reshape(-1).long())).all())


def _selector(config, ks, numels):
    selector = compress.SELECTORS[config.selector]
    if config.k_scope == "parameter":
        return compress.per_parameter(selector, ks, numels)
    return selector
