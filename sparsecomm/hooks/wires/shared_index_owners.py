"""The shared index with quantized values (``value_codec`` "int8" ... "sign"): summed through owners.

The leader's index set travels as on :class:`~sparsecomm.hooks.wires.shared_index.SharedIndexWire`
(its broadcast sealed, every rank's copy checked). A scaled codec's values cannot be summed by
an allreduce, so they go through owners instead: the entries are split into p near-equal
ranges, one per owner, and the shared indices in owner o's range are its slice.

1. Encode: every rank writes its values of each slice with the codec (a bf16 scale per 64
   values, no index) as one message per owner, each sealed; the residual keeps ``acc -
   decoded`` (the worker's error feedback, exact: every decoded value is 0 or within a
   factor of two of its value, with its sign, so the subtraction is exact in float32).
2. Exchange, in the caller's body: one all-to-all gives every owner the p messages for its
   slice; the owner checks them, decodes and sums them in float32 in rank order, adds its
   owner residual there, writes the total again with the codec and keeps what the codec did
   not carry in its owner residual (``reply + new owner residual == total + old owner
   residual``, entry by entry); its reply, sealed, goes to every rank at its own size (an
   all-to-all: the leader's indices fall unevenly over the owners' ranges, so an all-gather
   padded to the largest reply would cost more as p grows), issued and not waited for.
3. Accumulate: every reply checked (its checksum and its status), then every slice decoded
   into the bucket at the shared indices: the same bytes, so the same sum, on every rank.

A reply's status reports what its owner saw: a message that failed its check (1 + the
lowest sender, as the owner exchange's replies do), or that its own copy of the leader's
broadcast failed (:func:`broadcast_failed_status`, beyond every sender's code); every rank reads
every reply, so every rank raises the same error. Non-finite values: the leader's selection
need not reach a non-finite entry of another rank's acc, so a rank whose acc holds one
anywhere sends NaN as its first value; the sum, every owner's reply and so every rank see it.

``leader_filter`` and ``diagnose_leader_overlap`` act as on the float wire
(:func:`~sparsecomm.hooks.wires.shared_index.low_pass` on the worker's memory, with the
decoded values as what was sent; the owner residual keeps its exact error feedback).

No index bytes but the leader's: per rank about 2 (p-1)/p x k quantized values received,
whatever p is. The averager's shared-index sync runs it (the hook's settings refuse a
quantized shared index: its exchange is float values, one allreduce).
"""
import itertools
import time

import torch

from sparsecomm.comm.collectives import all_to_all_bytes, gather_unequal_future
from sparsecomm.compress import bitpack, payload_seal, value_codecs
from sparsecomm.compress.owner_layout import EXACT_SCALE_GROUP
from sparsecomm.hooks.wires import integrity
from sparsecomm.hooks.wires.base import Packed
from sparsecomm.hooks.wires.shared_index import SharedIndexWire, low_pass


class ScaledValues:
    """``count`` values written by a scaled value codec with one bf16 scale per
    ``EXACT_SCALE_GROUP`` values: [scales | packed codes], no index."""

    def __init__(self, codec: str):
        self.codec = codec

    def nbytes(self, count: int) -> int:
        groups = -(-count // EXACT_SCALE_GROUP)
        return value_codecs.SCALE_BYTES * groups + bitpack.packed_nbytes(count, value_codecs.value_bits(self.codec))

    def encode(self, values: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``values`` (float32) written into ``out`` (``nbytes(count)`` bytes); returns them as decoded."""
        count = values.numel()
        if not count:
            return values.clone()
        groups = -(-count // EXACT_SCALE_GROUP)
        group = torch.arange(count, device=values.device) // EXACT_SCALE_GROUP
        scales, codes = value_codecs.encode(self.codec, values, group, groups)
        scale_bytes = value_codecs.SCALE_BYTES * groups
        out[:scale_bytes].copy_(value_codecs.scales_to_bytes(scales))
        out[scale_bytes: scale_bytes + codes.numel()].copy_(codes)
        return value_codecs.decode(self.codec, scales, codes, group)

    def decode(self, region: torch.Tensor, count: int) -> torch.Tensor:
        if not count:
            return torch.zeros(0, dtype=torch.float32, device=region.device)
        groups = -(-count // EXACT_SCALE_GROUP)
        group = torch.arange(count, device=region.device) // EXACT_SCALE_GROUP
        scale_bytes = value_codecs.SCALE_BYTES * groups
        scales = value_codecs.scales_from_bytes(region[:scale_bytes], groups)
        return value_codecs.decode(self.codec, scales, region[scale_bytes: self.nbytes(count)], group)


class OwnedSlices:
    """One step's split of the sorted shared indices over the owners: each owner's slice (positions
    in the indices), its values' bytes, and the sealed message size of each."""

    def __init__(self, indices: torch.Tensor, bounds: torch.Tensor, values: ScaledValues, trailer: int):
        cuts = torch.searchsorted(indices, bounds.to(indices.device)).tolist()
        self.slices = [slice(a, b) for a, b in zip(cuts, cuts[1:])]
        self.nbytes = [values.nbytes(s.stop - s.start) for s in self.slices]
        self.sealed = [n + trailer for n in self.nbytes]


class SharedIndexOwnersWire(SharedIndexWire):
    """Steps 1-3 above: the leader's indices, quantized slices to their owners, owners' replies."""

    name = "shared_index"
    sealed = False  # checked in the exchange and the accumulate, not by the step's agreement

    def __init__(self, config, numel: int, density: float, world_size: int):
        super().__init__(config, numel, density, torch.float32, world_size)
        self.values = ScaledValues(config.value_codec)
        self.trailer = integrity.trailer_bytes(config)
        # Owner o's range of the bucket's entries: [bounds[o], bounds[o + 1]).
        self.bounds = torch.tensor([o * numel // world_size for o in range(world_size + 1)])

    def encode(self, call, residual, fused: bool) -> Packed:
        """The leader's indices (broadcast, checked), then this rank's values of every owner's
        slice written as its message (sealed); ``packed.extra``: (led, verdict, the slices)."""
        indices, led, verdict = self._shared_indices(call)
        if self.config.diagnose_leader_overlap:
            self.measure_leader_overlap(call, indices, verdict is None or not bool(verdict))
        indices = torch.sort(indices).values
        acc, values, beta = call.grad, self.values, self.config.filtered_memory_beta
        owned = OwnedSlices(indices, self.bounds, values, self.trailer)
        send = torch.empty(sum(owned.sealed), dtype=torch.uint8, device=acc.device)
        poisoned = not bool(torch.isfinite(acc).all())  # then the first slice written carries NaN
        if beta is None:
            residual.copy_(acc)
        sent, offset = [], 0
        for part, nbytes, sealed in zip(owned.slices, owned.nbytes, owned.sealed):
            at = indices[part]
            chosen = acc[at]
            if poisoned and chosen.numel():
                chosen[0], poisoned = float("nan"), False
            decoded = values.encode(chosen, send[offset: offset + nbytes])
            if beta is None:
                residual[at] -= decoded  # exact (module docstring): the worker's error feedback
            sent.append(decoded)
            if self.trailer:
                integrity.seal(send[offset: offset + sealed])
            offset += sealed
        sent = torch.cat(sent)  # in the order of the sorted indices: the slices follow each other
        if beta is not None:
            low_pass(residual, acc, indices, sent, beta)
        packed = Packed(send, None, indices, sent, False)
        packed.extra = (led, verdict is not None and bool(verdict), owned)
        return packed

    def bytes_sent(self, call, packed) -> int:
        """Its messages to the other owners, its reply to the other ranks, and the leader's index set."""
        led, _, owned = packed.extra
        return sum(owned.sealed) + (self.broadcast_nbytes if led else 0)

    def bytes_received(self, call, packed) -> int:
        """The p - 1 messages for its slice and the other owners' replies, and the leader's index set."""
        led, _, owned = packed.extra
        rank = call.context.rank
        return ((self.world_size - 1) * owned.sealed[rank] + sum(owned.sealed) - owned.sealed[rank]
                + (0 if led else self.broadcast_nbytes))

    def exchange(self, call, packed) -> torch.futures.Future:
        """Step 2: the messages to their owners (blocking), this owner's reply, and the replies'
        exchange (issued, not waited for)."""
        context, p, values = call.context, self.world_size, self.values
        _, broadcast_failed, owned = packed.extra
        rank = context.rank
        mine, nbytes, sealed = owned.slices[rank], owned.nbytes[rank], owned.sealed[rank]
        count = mine.stop - mine.start
        received = torch.empty(p * sealed, dtype=torch.uint8, device=packed.send.device)
        all_to_all_bytes(received, packed.send, owned.sealed, [sealed] * p, call.group)
        messages = received.view(p, sealed)
        status = payload_seal.STATUS_OK
        if self.trailer:
            started = time.perf_counter()
            bad = integrity.bad_rows(messages)
            status = bad[0] + 1 if bad else broadcast_failed_status(p) if broadcast_failed else status
            context.count(seconds_wire_checksum=time.perf_counter() - started)
        reply = torch.zeros(sealed, dtype=torch.uint8, device=packed.send.device)
        if status == payload_seal.STATUS_OK:  # else nothing to trust: no sum, the owner residual untouched
            total = torch.zeros(count, dtype=torch.float32, device=packed.send.device)
            for sender in range(p):  # rank order: every replay adds in this order
                total += values.decode(messages[sender, :nbytes], count)
            at = packed.indices[mine]
            total += call.owner_memory[at]
            call.owner_memory[at] = total - values.encode(total, reply[:nbytes])  # exact: the owner's error feedback
        if self.trailer:
            integrity.seal(reply, status)
        gathered = torch.empty(sum(owned.sealed), dtype=torch.uint8, device=reply.device)
        return gather_unequal_future(gathered, reply, owned.sealed, call.group)

    def accumulate(self, call, packed):
        """Step 3: every reply checked (its checksum, and its status), then every slice decoded
        into the bucket at the shared indices."""
        context, step, values, p = call.context, call.context.step, self.values, self.world_size
        _, _, owned = packed.extra
        starts = [0, *itertools.accumulate(owned.sealed)]

        def decode(fut: torch.futures.Future) -> torch.Tensor:
            gathered = fut.value()
            replies = [gathered[starts[o]: starts[o + 1]] for o in range(p)]
            if self.trailer:
                faults = [fault for owner, reply in enumerate(replies) for fault in _reply_faults(reply, owner, p)]
                if faults:
                    return integrity.refused(call, step, context.seals, faults)
            summed = torch.cat([values.decode(reply[: owned.nbytes[o]], part.stop - part.start)
                                for o, (reply, part) in enumerate(zip(replies, owned.slices))])
            call.out.zero_()
            call.out[packed.indices] = summed.to(call.out.dtype)
            if context.journal is not None:
                context.journal.note_reduced(~torch.isfinite(summed).all())
            return call.out

        return decode


def broadcast_failed_status(world_size: int) -> int:
    """The status of a reply whose owner's copy of the leader's broadcast failed its check:
    past every sender's code (1 + sender)."""
    return 1 + world_size


def _reply_faults(reply: torch.Tensor, owner: int, world_size: int) -> list[tuple[int, int, int]]:
    """(kind, owner, sender) of what one owner's reply shows: a reply that fails its checksum, a
    message that failed the owner's check, or the owner's copy of the leader's broadcast."""
    (intact,), (status,) = integrity.check(reply.view(1, -1))
    if not intact:
        return [(integrity.REPLY, owner, 0)]
    if status == broadcast_failed_status(world_size):
        return [(integrity.BROADCAST, owner, 0)]
    if status != payload_seal.STATUS_OK:
        return [(integrity.REPORTED, owner, status - 1)]
    return []
