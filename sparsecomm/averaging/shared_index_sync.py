"""The shared-index exchange of the outer sync (``SparseDeltaAverager(..., exchange="shared-index")``).

One index set for every rank: the leader (sync s is led by rank s mod p) selects from its
own error buffer ``e`` (``selector`` and ``chunk_size``: exact or per-chunk top-k) and
broadcasts the index region once (``index_codec``). What travels next depends on the value
codec:

* **Float values** (``value_codec`` None/"fp32", "bf16", "fp16"): every rank's ``e`` at the
  shared indices in that dtype, summed by one allreduce; ``e -= sent`` (what the wire
  carried, so conservation is exact).
* **Quantized values** (``"int8"``, ``"int4"``, ``"int2"``, ``"fp8"``, ``"sign"``: a bf16
  scale per 64 values): the model's entries are split into p near-equal ranges, one per
  owner; the shared indices in owner o's range are its slice. Every rank quantizes its
  values of each slice and sends them to the slice's owner (one all-to-all; ``e`` loses what
  the codec decodes, the worker's error feedback); each owner decodes the p messages, sums
  them in float32 in rank order, adds its owner residual there, quantizes the total again
  and keeps what the codec did not carry in its owner residual (``reply + new residual ==
  total + old residual``, entry by entry); every owner's reply goes to every rank unpadded
  (an all-to-all whose splits are the slices' sizes: the leader's indices fall unevenly over
  the owners' ranges, so an all-gather padded to the largest slice would cost more as p
  grows) and gives every rank the same sum. The owner residual of an entry is sent
  the next time a leader selects it. No index bytes but the leader's: per rank about
  2 (p-1)/p x k quantized values received, whatever p is.

Non-finite values: the leader's selection need not reach a non-finite entry of another
rank's ``e``, so a rank whose ``e`` holds one anywhere sends NaN as its first value (the
float sum, or the first owner's slice it writes): the sum, every owner's reply and so
every rank's verdict see it, and the sync is refused alike everywhere
(:mod:`sparsecomm.averaging.sync_guard`) at no cost in bytes.

Both levels' updates are exact: every decoded value is 0 or within a factor of two of the
value it stands for, with its sign (``sparsecomm.compress.value_codecs``), so ``acc -
decoded`` is exact in float32 (Sterbenz).
"""
import itertools

import torch
import torch.distributed as dist

from sparsecomm.averaging.sync_guard import all_finite
from sparsecomm.comm.collectives import all_to_all_bytes, gather_unequal_future
from sparsecomm.compress import bitpack, index_codecs, value_codecs
from sparsecomm.compress.chunking import chunk_topk
from sparsecomm.compress.owner_layout import EXACT_SCALE_GROUP
from sparsecomm.hooks.wires.shared_index import geometry as shared_index_geometry


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


class SharedIndexSync:
    """The leader's selection of its own error buffer, its index region broadcast, then the
    values: summed by an allreduce (float wire) or through the owners (quantized)."""

    def __init__(self, config, numel: int, density: float, process_group):
        self.config, self.process_group, self.numel = config, process_group, numel
        self.world_size, self.rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        self.geometry = shared_index_geometry(config, numel, density)
        self.index_nbytes = index_codecs.index_region_nbytes(config.index_codec, self.geometry)
        self.quantized = config.value_codec is not None and value_codecs.has_scale(config.value_codec)
        self.value_dtype = config.value_dtype or value_codecs.FLOAT_CODECS.get(config.value_codec, torch.float32)
        self.values = ScaledValues(config.value_codec) if self.quantized else None
        # Owner o's range of model entries: [bounds[o], bounds[o + 1]).
        self.bounds = torch.tensor([o * numel // self.world_size for o in range(self.world_size + 1)])

    def leader(self, sync: int) -> int:
        return sync % self.world_size

    def led(self, sync: int) -> bool:
        return self.leader(sync) == self.rank

    def indices(self, error: torch.Tensor, sync: int) -> torch.Tensor:
        """The leader's selection, broadcast as its index region: the same on every rank."""
        group, lead = self.process_group, self.leader(sync)
        region = torch.empty(self.index_nbytes, dtype=torch.uint8, device=error.device)
        if self.rank == lead:
            region.copy_(index_codecs.encode(self.config.index_codec, chunk_topk(error, self.geometry), self.geometry))
        dist.broadcast(region, src=lead if group is None else dist.get_global_rank(group, lead), group=group)
        return index_codecs.decode(self.config.index_codec, region, self.geometry).to(error.device)

    # -- quantized values: through the owners ------------------------------------------------------

    def slices(self, indices: torch.Tensor) -> list[slice]:
        """Positions in the sorted ``indices`` of every owner's range."""
        cuts = torch.searchsorted(indices, self.bounds.to(indices.device)).tolist()
        return [slice(a, b) for a, b in zip(cuts, cuts[1:])]

    def quantized_sum(self, error: torch.Tensor, indices: torch.Tensor, owner_residual: torch.Tensor):
        """Sorted ``indices``; ``error`` loses what this rank sends and ``owner_residual`` (pass
        a copy) takes what its reply leaves, in place. Returns (this rank's values as decoded,
        the future of the replies' all-gather (issued, not waited for), the function that
        turns its value into the sum over ranks as the owners sent it on, (bytes sent,
        bytes received))."""
        p, rank, values = self.world_size, self.rank, self.values
        slices = self.slices(indices)
        sizes = [values.nbytes(s.stop - s.start) for s in slices]
        send = torch.empty(sum(sizes), dtype=torch.uint8, device=error.device)
        sent_values, offset = [], 0
        poisoned = not all_finite(error)  # then the first slice written carries NaN (module docstring)
        for part, size in zip(slices, sizes):
            at = indices[part]
            chosen = error[at]
            if poisoned and chosen.numel():
                chosen[0], poisoned = float("nan"), False
            decoded = values.encode(chosen, send[offset: offset + size])
            error[at] -= decoded  # exact (Sterbenz): the worker's error feedback
            sent_values.append(decoded)
            offset += size
        mine = slices[rank]
        count = mine.stop - mine.start
        received = torch.empty(p * sizes[rank], dtype=torch.uint8, device=error.device)
        all_to_all_bytes(received, send, sizes, [sizes[rank]] * p, self.process_group)
        total = torch.zeros(count, dtype=torch.float32, device=error.device)
        for sender in range(p):  # rank order: every replay adds in this order
            total += values.decode(received[sender * sizes[rank]: (sender + 1) * sizes[rank]], count)
        at = indices[mine]
        total += owner_residual[at]
        reply = torch.zeros(sizes[rank], dtype=torch.uint8, device=error.device)
        owner_residual[at] = total - values.encode(total, reply)  # exact: the owner's error feedback
        gathered = torch.empty(sum(sizes), dtype=torch.uint8, device=error.device)
        future = gather_unequal_future(gathered, reply, sizes, self.process_group)
        starts = [0, *itertools.accumulate(sizes)]

        def summed_of(gathered: torch.Tensor) -> torch.Tensor:
            return torch.cat([values.decode(gathered[starts[o]: starts[o] + sizes[o]], s.stop - s.start)
                              for o, s in enumerate(slices)])

        # Sent: the messages to the other owners and the reply (once, as an all-gather counts
        # a payload); received: the p - 1 messages to this owner and the other owners' replies.
        traffic = (sum(sizes), (p - 1) * sizes[rank] + sum(sizes) - sizes[rank])
        return torch.cat(sent_values), future, summed_of, traffic
