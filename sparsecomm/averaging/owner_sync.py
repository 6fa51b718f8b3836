"""The owner exchange of the outer sync (``SparseDeltaAverager(..., exchange="owner")``).

The hook's owner exchange (:mod:`sparsecomm.hooks.wires.owner`) applied to the averager's
error buffer, with error feedback at both levels:

1. Every rank selects, in each owner's range of its ``e`` (contiguous chunks,
   :class:`sparsecomm.compress.owner_layout.OwnerLayout`), the entries the wire sends, as one
   message per owner; ``e -= decoded(sent)`` (the worker's error feedback).
2. One ``all_to_all_single`` gives every owner the p messages for its range.
3. The owner decodes them onto zeros in rank order (their sum), adds its owner residual,
   selects again at the same density and codecs, and keeps what it did not send in its owner
   residual: ``decoded(reply) + new owner residual == sum + old owner residual``, entry by
   entry, as the worker's update is (exactly wherever the wire's decode is exact in float32).
4. One all-gather of the replies (each padded to the largest); every rank decodes every
   owner's reply into its range: the same bytes, so the same sum, on every rank. The mean
   is that sum divided by p.

Per rank and sync that is about k entries sent and 2 k (p-1)/p received whatever p is,
where the all-gather receives (p-1) k. The owner residual is a full-size float32 buffer
per rank, non-zero only on the rank's own range, saved with the averager's state.
"""
import torch
import torch.distributed as dist

from sparsecomm.comm.collectives import all_to_all_bytes, allgather_future
from sparsecomm.compress.owner_layout import OwnerLayout
from sparsecomm.hooks.wires import payload_layout


class OwnerSync:
    """Steps 1-4 above for one flat buffer of ``numel`` entries over ``process_group``."""

    def __init__(self, config, numel: int, density: float, process_group):
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        # The hook's owner layout for a float32 buffer of this size (no seal: the averager's
        # messages are not checksummed, as its all-gather's payloads are not).
        self.layout = payload_layout(config, density, numel, 0, torch.float32, self.world_size, "owner")
        assert isinstance(self.layout, OwnerLayout) and not self.layout.trailer

    @property
    def bytes_sent(self) -> int:
        """Its messages to the other owners, then its reply (counted once, as the hook counts it)."""
        return self.layout.nbytes - self.layout.message_nbytes[self.rank] + self.layout.slot_nbytes

    @property
    def bytes_received(self) -> int:
        """The p-1 messages for its range and the p-1 other owners' replies."""
        return (self.world_size - 1) * (self.layout.message_nbytes[self.rank] + self.layout.slot_nbytes)

    def send(self, error: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
        """Steps 1 and 2 for this rank: ``error`` loses what it sends (in place). Returns
        (entries sent, the p messages for this rank's range [p, message bytes], the values
        this rank sent as decoded)."""
        layout = self.layout
        payload = torch.empty(layout.nbytes, dtype=torch.uint8, device=error.device)
        indices, decoded = layout.encode(error.clone(), error, payload)
        mine = layout.message_nbytes[self.rank]
        received = torch.empty(self.world_size * mine, dtype=torch.uint8, device=error.device)
        all_to_all_bytes(received, payload, layout.message_nbytes, [mine] * self.world_size, self.process_group)
        return indices.numel(), received.view(self.world_size, mine), decoded

    def reduce_and_gather(self, messages: torch.Tensor, owner_residual: torch.Tensor) -> torch.futures.Future:
        """Steps 3 and 4: this owner's reply from ``messages`` and ``owner_residual`` (updated
        in place: pass a copy to keep the old one); the all-gather of every owner's reply is
        issued, its future returned (its value: [p * slot bytes], for :meth:`decode_sum`)."""
        layout, rank = self.layout, self.rank
        slot = torch.zeros(layout.slot_nbytes, dtype=torch.uint8, device=messages.device)
        part = layout.parts[rank]
        if part is not None:
            start, length = layout.ranges[rank]
            total = torch.zeros(length, dtype=torch.float32, device=messages.device)
            for sender in range(self.world_size):  # rank order: every replay adds in this order
                indices, values = part.decode(messages[sender, : part.nbytes])
                total.index_add_(0, indices, values.float())
            mine = owner_residual[start: start + length]
            total += mine
            part.encode(total, mine, slot[: part.nbytes])
        gathered = torch.empty(self.world_size * slot.numel(), dtype=torch.uint8, device=slot.device)
        return allgather_future(gathered, slot, self.process_group)

    def decode_sum(self, replies: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Every owner's reply in ``replies`` (the gathered slots) written into its range of
        the zeroed ``out``: the sum over ranks of what the owners sent on."""
        replies = replies.view(self.world_size, -1)
        out.zero_()
        for owner, part, section in self.layout.sections():
            indices, values = part.decode(replies[owner, : part.nbytes])
            out[section].index_add_(0, indices, values.float())
        return out
