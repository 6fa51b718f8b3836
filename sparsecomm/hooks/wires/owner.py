"""The owner exchange (``exchange="owner"``): traffic that does not grow with the number of ranks.

Every rank owns a contiguous range of the bucket's chunks (``compress.owner_layout``).

1. Encode: each rank writes the chunked selection of every owner's range as a message of
   its own (worker-side error feedback, as for the all-gather: ``acc - decoded`` stays in
   the rank's residual).
2. Scatter, in the hook body: one ``all_to_all_single`` (MPI ``Alltoallv`` with
   ``transport="mpi"``) gives every owner the p messages for its range (blocking: the
   owner's reply depends on them, and the reply's collective must be issued from the hook
   body too).
3. Owner reduce, in the hook body: the owner decodes the p messages onto zeros in rank
   order (their sum is the average: each rank divided by p), adds its owner residual,
   selects and encodes again at the same density and codecs; what it does not send stays
   in the owner residual (second-level error feedback, exact: ``decoded + new owner
   residual == sum + old owner residual``).
4. Gather: one all-gather of the owners' replies (each padded to the largest); in the
   Future's callback every rank decodes every owner's reply into its range of the bucket.
   Every rank decodes the same bytes, so replicas stay bit-identical.

With ``wire_checksum`` every message and every reply is sealed (``integrity``). An owner
checks the p messages it received before it decodes any; if one fails, it neither sums nor
touches its owner residual, and says so in its reply's status: every rank reads every
reply, so every rank raises the same error, naming the owner and the sender.

Per rank and bucket that is about k entries sent and 2 k (p-1)/p received, whatever p is
(the all-gather receives (p-1) k).

What the owner's re-selection drops (``owner_dropped``):

* ``"owner"`` (the default): it stays in the owner residual (step 3).
* ``"sender"`` (Ok-Topk: Li and Hoefler, PPoPP 2022, its ``update_residuals``): every sender
  takes its own part of it back into its worker residual. An entry counts as delivered where
  its owner's reply reaches the reduced bucket as a non-zero value; every rank decodes every
  reply, so a sender knows which of its sent entries were delivered without another byte:
  in the Future's callback it adds back, into its worker residual, the decoded value of every
  entry it sent that decoded to 0 in the reduced bucket (the exact value it sent, so that
  entry's residual is ``acc`` again, bit for bit: ``fl(acc - decoded) + decoded`` is the
  sum the encoder's own contract ``decoded + residual == acc`` already checks). The owner
  keeps, at those entries, its owner residual as it was before the step, and, at the
  delivered ones, only its reply's encoding error (``sum + old owner residual - decoded
  reply``: the rounding of a quantized or 16-bit reply, mass of its own making that no
  sender could take back). So no sender's mass is left with another rank, and with a float32
  reply the owner residual stays 0. The velocity of momentum correction is masked where an
  entry went on the wire, delivered or not (as with ``"owner"``, whose owner residual
  holds such an entry). ``packed.values`` is zeroed at the entries taken back: it then says
  what this rank sent for good (the record of parameters DDP drops as unused gives back only
  that).

The owner residual is a per-parameter memory like the worker residual (a full-size
tensor per rank, non-zero only on the rank's own ranges), so it is checkpointed by
parameter name. When the bucket layout changes (DDP's rebuild, another world size after a
restore), a rank may stop owning entries whose owner residual it holds: those values move
into its worker residual (``base.fold_foreign``), which sends them on to their new owner through
the ordinary path. Nothing is lost; the sum of all memories is unchanged up to one
rounding per moved entry.
"""
import time

import torch

from sparsecomm import ops
from sparsecomm.comm import link_model
from sparsecomm.comm.collectives import all_to_all_bytes, allgather_future
from sparsecomm.compress import payload_seal
from sparsecomm.hooks.state.conservation import check_owner_conservation
from sparsecomm.hooks.wires import integrity
from sparsecomm.hooks.wires.base import Packed, Wire, kernel_arguments, owner_residual


class OwnerWire(Wire):
    """Steps 1-4 above: encode (the hook's step 3), scatter + owner reduce + the replies'
    gather (its step 5, issued from the hook body), decode every reply (its step 6)."""

    name = "owner"

    def __init__(self, config, layout, world_size: int):
        super().__init__(config, layout, world_size)
        self.sealed = bool(layout.trailer)
        self.dropped_to_senders = config.owner_dropped == "sender"
        self.buffers = None  # OwnerBuffers, allocated by the first encode, reused every step

    def smaller_than_dense(self, numel, buffer_dtype) -> bool:
        # Received per rank: (p-1) x (own message + reply slot) ~ 2 (p-1) slot, against a
        # ring allreduce's 2 (p-1)/p x dense.
        return not link_model.falls_back_to_dense(self.layout.slot_nbytes, numel * buffer_dtype.itemsize,
                                                  self.world_size)

    def density_bound(self, buffer_dtype) -> float:
        return buffer_dtype.itemsize / self.layout.bytes_per_entry  # p x slot ~ the whole selection, whatever p is

    def modelled_seconds(self, numel, buffer_dtype, link) -> float:
        return link_model.owner_exchange_seconds(self.world_size * self.layout.slot_nbytes, self.world_size,
                                                 rate_bytes_per_s=link.bytes_per_s, alpha_s=link.latency_s)

    def prepare(self, call, residual) -> list[torch.Tensor]:
        """The owner residual of this rank's range (what its re-selection did not send on),
        after moving what it no longer owns into the worker residual (``fold_foreign``)."""
        if residual is None:
            return []
        call.owner_memory = owner_residual(call, residual, self.layout.ranges[call.context.rank])
        return [call.owner_memory]

    def fuses_compensation(self, call) -> bool:
        return call.fusable and ops.dispatch.native_chunk_encode(call.grad, self.layout)

    def _buffers(self, call, memory_dtype) -> "OwnerBuffers":
        cached = self.buffers
        if cached is None or cached.send.device != call.out.device or cached.total.dtype != memory_dtype:
            cached = self.buffers = OwnerBuffers(self.layout, call.context.rank, memory_dtype,
                                                 call.out.device)
        return cached

    def encode(self, call, residual, fused: bool) -> Packed:
        """Step 1: every owner's range of acc into its message, each message sealed as soon
        as it is written (``wire_checksum``)."""
        layout = self.layout
        send = self._buffers(call, call.grad.dtype if residual is None else residual.dtype).send
        divisor, add_residual = kernel_arguments(call.divisor, residual, fused)
        parts = []
        for owner, part, section in layout.sections():
            parts.append(ops.dispatch.chunk_encode(call.grad[section], None if residual is None else residual[section],
                                                   divisor, add_residual, part, layout.part_of(send, owner)))
            if layout.trailer:
                integrity.seal(layout.message_of(send, owner))
        packed = Packed(send, layout, *layout.joined(parts), fused)
        if self.dropped_to_senders:
            packed.extra = residual  # where the entries no owner delivers come back to (None: no error feedback)
        return packed

    def bytes_sent(self, call, packed) -> int:
        """Its messages to the other owners, then its reply."""
        rank = call.context.rank
        return self.layout.nbytes - self.layout.message_nbytes[rank] + self.layout.slot_nbytes

    def bytes_received(self, call, packed) -> int:
        rank = call.context.rank
        return (self.world_size - 1) * (self.layout.message_nbytes[rank] + self.layout.slot_nbytes)

    def exchange(self, call, packed) -> torch.futures.Future:
        """Steps 2-4 (the gather issued, not waited for); counts the owner's own reduce time."""
        context, layout, bufs = call.context, self.layout, self.buffers
        rank = context.rank
        mine, message, slot = layout.part_nbytes[rank], layout.message_nbytes[rank], layout.slot_nbytes
        started = time.perf_counter()
        mpi = context.transport
        if mpi is not None:  # the same bytes as c10d, so the same result bit for bit
            mpi.alltoallv(packed.send, bufs.received, layout.message_nbytes, [message] * layout.world_size)
        else:
            all_to_all_bytes(bufs.received, packed.send, layout.message_nbytes, [message] * layout.world_size,
                             call.group)
        context.count(seconds_owner_scatter=time.perf_counter() - started)
        status = payload_seal.STATUS_OK
        part = layout.parts[rank]
        received = bufs.received if part is None else bufs.received.view(layout.world_size, message)[:, :mine]
        if part is not None and layout.trailer:  # every message checked before any is decoded
            started = time.perf_counter()
            bad = integrity.bad_rows(bufs.received.view(layout.world_size, message))
            status = bad[0] + 1 if bad else status  # 1 + the lowest sender whose message failed
            context.count(seconds_wire_checksum=time.perf_counter() - started)
        started = time.perf_counter()
        if part is None or status != payload_seal.STATUS_OK:
            bufs.reply.zero_()  # nothing owned, or nothing to trust: no sum, the owner residual untouched
        else:
            start, length = layout.ranges[rank]
            ops.dispatch.chunk_decode_add(received, part, bufs.total, True)  # rank order, onto zeros
            memory = None if call.owner_memory is None else call.owner_memory[start : start + length]
            returns = self.dropped_to_senders and memory is not None
            old_memory = memory.clone() if call.audit is not None or returns else None
            indices, values = ops.dispatch.chunk_encode(bufs.total, memory, 1.0, memory is not None, part,
                                                        bufs.reply[:mine])
            bufs.reply[mine:].zero_()
            if returns:  # the senders take back what the reply does not deliver
                keep_only_delivered(memory, old_memory, indices, values, call.out.dtype)
            if call.audit is not None:
                check_owner_conservation(part, received, old_memory, bufs.reply[:mine], memory, call.index,
                                         context.step, call.out.dtype if returns else None)
        if layout.trailer:
            integrity.seal(bufs.reply, status)
        context.count(seconds_owner_reduce=time.perf_counter() - started)
        if mpi is not None:
            return mpi.allgatherv(bufs.reply, bufs.replies, [slot] * layout.world_size)
        return allgather_future(bufs.replies, bufs.reply, call.group)

    def accumulate(self, call, packed):
        """Every owner's reply checked (``wire_checksum``: its checksum, and its status, which
        reports a bad message the owner received), then decoded into its range of the bucket."""
        context, step, seals, layout = call.context, call.context.step, call.context.seals, self.layout

        def decode(fut: torch.futures.Future) -> torch.Tensor:
            replies = fut.value()
            if layout.trailer:
                started = time.perf_counter()
                faults = check_replies(replies.view(layout.world_size, layout.slot_nbytes))
                context.count(seconds_wire_checksum=time.perf_counter() - started)
                if faults:
                    return integrity.refused(call, step, seals, faults)
            started = time.perf_counter()
            for owner, part in enumerate(layout.parts):
                start, length = layout.ranges[owner]
                if part is None:
                    call.out[start : start + length].zero_()  # empty range (length 0)
                    continue
                slot = replies[owner * layout.slot_nbytes : owner * layout.slot_nbytes + part.nbytes]
                ops.dispatch.chunk_decode_add(slot, part, call.out[start : start + length], True)
            if packed.extra is not None:  # owner_dropped="sender": take back what no owner delivered
                returned = take_back_undelivered(call.out, packed, packed.extra)
                if call.audit is not None:
                    call.audit.check_taken_back(self.sent_dense(packed, packed.extra), returned, packed.extra,
                                                call.index, step)
            context.count(seconds_unpack=time.perf_counter() - started)
            if context.journal is not None:
                context.journal.note_reduced(~torch.isfinite(call.out).all())
            return call.out

        return decode

    def sent_dense(self, packed, like) -> torch.Tensor:
        """The messages for every owner, decoded by the reference."""
        indices, values = packed.layout.decode(packed.send)
        return torch.zeros_like(like).index_put_((indices,), values.to(like.dtype))


def keep_only_delivered(memory: torch.Tensor, before: torch.Tensor, indices: torch.Tensor, values: torch.Tensor,
                        out_dtype: torch.dtype) -> None:
    """``owner_dropped="sender"``, on the owner: its owner residual ``memory`` (the encoder's
    ``sum + before - decoded`` everywhere) keeps that only where its reply (``indices``,
    ``values``) delivers a non-zero value in a reduced bucket of ``out_dtype``; elsewhere the
    senders take their parts back, and it is ``before`` again."""
    delivered = torch.zeros(memory.numel(), dtype=torch.bool, device=memory.device)
    delivered[indices[values.to(out_dtype) != 0]] = True
    torch.where(delivered, memory, before, out=memory)


def take_back_undelivered(out: torch.Tensor, packed: Packed, residual: torch.Tensor) -> torch.Tensor:
    """``owner_dropped="sender"``, on a sender, once every reply is decoded into ``out``: each
    finite, non-zero value it sent (``packed``) where ``out`` is 0 (its owner did not deliver it)
    goes back into ``residual``, and is zeroed in ``packed.values`` (what was sent for good).
    Returns the bucket indices taken back."""
    values = packed.values
    back = (out[packed.indices] == 0) & (values != 0) & torch.isfinite(values)
    returned = packed.indices[back]
    residual.index_add_(0, returned, values[back].to(residual.dtype))
    values[back] = 0
    return returned


class OwnerBuffers:
    """The tensors one bucket's owner exchange reuses every step."""

    __slots__ = ("layout", "send", "received", "total", "reply", "replies")

    def __init__(self, layout, rank: int, memory_dtype: torch.dtype, device):
        self.layout = layout
        mine = layout.message_nbytes[rank]
        self.send = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
        self.received = torch.empty(layout.world_size * mine, dtype=torch.uint8, device=device)
        self.total = torch.empty(layout.ranges[rank][1], dtype=memory_dtype, device=device)
        self.reply = torch.empty(layout.slot_nbytes, dtype=torch.uint8, device=device)
        self.replies = torch.empty(layout.world_size * layout.slot_nbytes, dtype=torch.uint8, device=device)


def check_replies(slots: torch.Tensor) -> list[tuple[int, int, int]]:
    """The faults the owners' replies (rows of ``slots``) show, as (kind, owner, sender): a reply
    that fails its checksum, or an intact one whose status reports a message that failed the
    owner's check."""
    intact, status = integrity.check(slots)
    return [(integrity.REPLY, owner, 0) if not ok else (integrity.REPORTED, owner, reported - 1)
            for owner, (ok, reported) in enumerate(zip(intact, status)) if not ok or reported != payload_seal.STATUS_OK]
