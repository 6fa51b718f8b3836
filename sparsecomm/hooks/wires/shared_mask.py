"""The shared-mask exchange (``exchange="shared-mask"``): SCAPE's reducer (Zheng et al., arXiv
2607.01678), as its authors' code does it (github ``mz687/SCAPE_SC26``,
``megatron/core/distributed/fp8_topk_adams_reducer.py``, and ``megatron/core/optimizer/AdamS.py``).

It runs under :class:`sparsecomm.optim.AdamS` and synchronises the optimizer's first moment, not the
gradient. For a bucket at step t, on every rank (``m``: AdamS's ``exp_avg``, the same on every
rank; ``g``: this rank's gradient; ``e``: this rank's residual; ``p`` ranks)::

    corrected = beta1 m + (1 - beta1) g + e                    the momentum this rank would apply
    sent      = corrected at the mask M_t, averaged over the ranks (one allreduce, no index bytes)
    e        <- corrected off M_t (0 on it, plus the wire's rounding): error feedback in momentum
                space, no decay
    m        <- sent on M_t, 0 off it; g_hat = (m - beta1 m_prev) / (1 - beta1) on M_t, 0 off it

The hook returns ``g_hat`` (what DDP writes into ``.grad``) and tells the optimizer the mask;
AdamS zeroes its ``exp_avg`` off the mask before its step, so it computes ``m`` as above,
rebuilds its normalizer ``v = beta2 m_prev^2 + (1 - beta2) g_hat^2`` from it, and moves a
parameter only on the mask (weight decay aside). The residual is kept divided by p (this
hook's convention: every rank sends ``corrected / p`` and the allreduce sums), the same
numbers as SCAPE's average up to rounding.

The mask. Each parameter tensor of the bucket has an owner rank: contiguous runs of tensors
balanced by element count (:func:`owners`, the authors' rule). At step t the owner takes, per
tensor, the ``k = max(1, int(density x numel))`` entries of largest ``|corrected|`` (its own
corrected momentum: the synced ``m`` plus its own gradient and residual, so an entry left out
grows in the residual until it wins) at the density of step t + 1, packs them as a 1-bit
bitmap of its range, and the bitmaps are all-gathered (each rank's slot sealed with
``wire_checksum``): that is the mask of step t + 1, one step late. The first sparse step has no
mask yet and makes one at once from its own corrected momentum (a synchronous gather; the
authors bootstrap step 0 so too). Tensors whose name holds ``layernorm``, ``layer_norm``,
``rmsnorm``, ``rms_norm`` or ``bias`` are sent whole (the authors' default exclusion), and so
are the parameters of normalization layers whatever their names (``nn.LayerNorm``,
``RMSNorm``, ``GroupNorm``, batch norms: a GPT-2-style ``ln_1`` or ``norm1`` would otherwise
get one entry per step); ``mask_dense_norms=False`` ranks them like the others, and a step whose density makes every
``k`` its tensor's size needs no bitmap at all.

Where this differs from the authors' code, and why:

- Owners are assigned per DDP bucket (their code: per gradient buffer, usually the whole
  model); a rank may own nothing in a small bucket.
- The bitmap all-gather is issued right after the values' allreduce and waited for with it,
  at the end of the step's backward (theirs: a side stream, waited for before the next
  forward). The bytes and the mask are the same; a DDP comm hook has no pre-forward point.
  It also makes the mask part of the checkpoint (``rank<r>.mask.<name>``), so a resumed run
  continues bit for bit.
- Values travel in ``value_dtype`` (float32 by default; bf16 or fp16 with the rounding fed back
  into the residual). The authors' fp8 e5m2 payload is not built.
- The density schedule is the hook's ``density_schedule``; ``{"kind": "geometric", "steps":
  N}`` is the authors' warm-up from 1.0.

A step whose reduced values are not finite keeps the mask it had (the step is rolled back or
skipped); every rank sees the same sum, so every rank decides alike.
"""
import math

import torch

from sparsecomm.comm import allgather_future, allreduce_future, link_model
from sparsecomm.compress.error_feedback import divide_
from sparsecomm.hooks.wires import integrity
from sparsecomm.hooks.wires.base import Packed
from sparsecomm.hooks.wires.shared_index import AllreducedValues, shared_values

DENSE_NAME_PARTS = ("layernorm", "layer_norm", "rmsnorm", "rms_norm", "bias")
"""Name parts of the tensors sent whole (the authors' ``_should_exclude_name_from_topk``)."""


def sent_whole(name: str, norms=frozenset()) -> bool:
    """A bias or a norm's weight: named so (the authors' test), or a parameter of a
    normalization layer (``norms``: their names, from the bound model)."""
    lowered = name.lower()
    return name in norms or any(part in lowered for part in DENSE_NAME_PARTS)


def mask_sizes(names, numels, density: float, dense_norms: bool, norms=frozenset()) -> tuple[int, ...]:
    """Entries of each tensor's mask at ``density``: ``max(1, int(density x numel))``, the whole
    tensor at density 1 and for the tensors sent whole."""
    return tuple(n if density >= 1.0 or (dense_norms and sent_whole(name, norms)) else max(1, int(density * n))
                 for name, n in zip(names, numels))


def owners(numels, world_size: int) -> tuple[int, ...]:
    """The owner rank of each tensor: contiguous runs balanced by element count, every rank
    given a tensor while there are tensors left for it (the authors' rule)."""
    target = sum(numels) / world_size
    result, owner, owned = [], 0, 0
    for cursor, numel in enumerate(numels):
        result.append(owner)
        owned += numel
        if owner < world_size - 1:
            remaining_tensors, remaining_owners = len(numels) - cursor - 1, world_size - owner - 1
            if (target > 0 and owned >= target and remaining_tensors > remaining_owners) \
                    or remaining_tensors <= remaining_owners:
                owner, owned = owner + 1, 0
    return tuple(result)


def owned_ranges(numels, world_size: int) -> tuple[tuple[int, int], ...]:
    """(start, length) of the bucket each rank owns (length 0: none)."""
    starts = [0] * world_size
    lengths = [0] * world_size
    offset = 0
    for owner, numel in zip(owners(numels, world_size), numels):
        if lengths[owner] == 0:
            starts[owner] = offset
        lengths[owner] += numel
        offset += numel
    return tuple(zip(starts, lengths))


def pack_bits(bits: torch.Tensor, nbytes: int) -> torch.Tensor:
    """A bool tensor as ``nbytes`` bytes, least significant bit first (zero padded)."""
    padded = torch.zeros(nbytes * 8, dtype=torch.uint8, device=bits.device)
    padded[: bits.numel()] = bits.to(torch.uint8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=bits.device)
    return (padded.view(nbytes, 8) * weights).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """The first ``count`` bits of ``packed`` (as :func:`pack_bits` wrote them), as bool."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 1).reshape(-1)[:count].bool()


def owner_selection(corrected: torch.Tensor, numels, ks, start: int, length: int) -> torch.Tensor:
    """The owner's mask bits over its range ``[start, start + length)``: per tensor, its ``k``
    entries of largest ``|corrected|`` (ties: ``torch.topk``'s order, as the authors')."""
    bits = torch.zeros(length, dtype=torch.bool, device=corrected.device)
    offset = 0
    for numel, k in zip(numels, ks):
        if start <= offset < start + length:
            part = corrected[offset: offset + numel]
            local = offset - start
            if k >= numel:
                bits[local: local + numel] = True
            else:
                top = torch.topk(part.abs().nan_to_num(nan=math.inf), k, sorted=False).indices
                bits[local + top] = True
        offset += numel
    return bits


class SharedMaskWire(AllreducedValues):
    """SCAPE's reducer on one bucket: the values of the corrected momentum at the mask agreed one
    step before, allreduced; the owners' next mask as bitmaps.

    The bitmaps travel the cheaper of two ways for the bucket's owners: an all-gather of every
    owner's range in slots of the largest range (the authors'; each slot sealed with
    ``wire_checksum``), or, where the ranges are uneven (a bucket of few tensors: the slots
    are padded to the largest), an allreduce of the bucket's bitmap, in which each owner
    sets only its own bits, so the sum is their union. The allreduce moves at most
    2 (p-1)/p x numel / 8 bytes per rank, flat in p whatever the balance; a sum carries no
    seal, so there every rank checks instead that each tensor's mask holds exactly its k
    entries (the all-gather's masks are checked so too)."""

    name = "shared_mask"

    def __init__(self, config, names, numels, density: float, next_density: float, value_dtype: torch.dtype,
                 world_size: int, norms=frozenset()):
        self.ks = mask_sizes(names, numels, density, config.mask_dense_norms, norms)
        self.next_ks = mask_sizes(names, numels, next_density, config.mask_dense_norms, norms)
        super().__init__(config, sum(self.ks), value_dtype, world_size)
        self.names, self.numels = tuple(names), tuple(numels)
        self.ranges = owned_ranges(numels, world_size)
        self.bitmap_nbytes = math.ceil(sum(numels) / 8)
        self.slot_nbytes = max(math.ceil(length / 8) for _, length in self.ranges) + integrity.trailer_bytes(config)
        gathered = self.slot_nbytes * (world_size - 1)
        self.bitmaps_summed = link_model.ring_allreduce_bytes(self.bitmap_nbytes, world_size) < gathered
        self.next_is_whole = sum(self.next_ks) == sum(numels)  # the next mask is every entry: no bitmap

    def matches(self, other) -> bool:
        return super().matches(other) and (self.names, self.numels, self.ks, self.next_ks) == (
            other.names, other.numels, other.ks, other.next_ks)

    # The shared mask keeps its meaning at every density (momentum-space memories): never the
    # plain dense wire, whose residual is a gradient. At density 1 it sends every value, no bitmap.
    def smaller_than_dense(self, numel, buffer_dtype) -> bool:
        return True

    def density_bound(self, buffer_dtype) -> float:
        return 1.0

    def modelled_seconds(self, numel, buffer_dtype, link) -> float:
        rate, alpha = link.bytes_per_s, link.latency_s
        if self.next_is_whole:
            bitmaps = 0.0
        elif self.bitmaps_summed:
            bitmaps = link_model.ring_allreduce_seconds(self.bitmap_nbytes, self.world_size, rate_bytes_per_s=rate,
                                                        alpha_s=alpha)
        else:
            bitmaps = link_model.ring_allgather_seconds(self.slot_nbytes, self.world_size, rate_bytes_per_s=rate,
                                                        alpha_s=alpha)
        return bitmaps + link_model.ring_allreduce_seconds(self.k * self.value_dtype.itemsize, self.world_size,
                                                           rate_bytes_per_s=rate, alpha_s=alpha)

    def prepare(self, call, residual) -> list[torch.Tensor]:
        """Read AdamS's first moment of the bucket and the mask this step uses (the journal keeps
        the mask, which the step's callback replaces by the next one)."""
        previous, beta1 = call.context.momentum.read(call.names, call.numels, call.grad)  # (attached: topk_hook checks)
        mask = call.context.memories.masks.bucket_tensor(call.index, call.names, call.numels, call.grad,
                                                         torch.float32)
        call.mask_memory = (mask, previous, beta1)
        return [mask]

    def fuses_compensation(self, call) -> bool:
        return True  # the corrected momentum is formed by encode, not by the gradient's compensation

    def encode(self, call, residual, fused: bool) -> Packed:
        mask, previous, beta1 = call.mask_memory
        corrected = call.grad
        # corrected = (beta1 m + (1 - beta1) g) / p + e, in that order (the conservation audit's).
        corrected.mul_(1.0 - beta1).add_(previous * beta1)
        divide_(corrected, call.world_size)
        if call.audit is not None:
            call.audit.carry_momentum(previous, beta1)
        if residual is not None:
            corrected.add_(residual)
        bootstrapped = not bool(mask.any())
        if bootstrapped:  # the first sparse step: a mask from this step's corrected momentum, now
            bitmap = self._owner_bitmap(call, corrected, self.ks)
            call.context.count(bytes_sent=self._bitmap_sent(bitmap), bytes_received=self._bitmap_received(bitmap))
            mask.copy_(self._unpack(call, self._exchange_bitmap(call, bitmap).wait(), self.ks))
        indices = mask.nonzero().reshape(-1)
        packed = shared_values(call, residual, indices)
        # The next step's mask: the owners' bitmaps; none when it is every entry, or when it is
        # the one just made from this same corrected momentum at the same sizes.
        reuse = self.next_is_whole or (bootstrapped and self.next_ks == self.ks)
        packed.extra = None if reuse else self._owner_bitmap(call, corrected, self.next_ks)
        return packed

    def _owner_bitmap(self, call, corrected: torch.Tensor, ks) -> torch.Tensor:
        """What this rank sends of the mask at sizes ``ks``: its range's bits in a slot (sealed
        with ``wire_checksum``), or the bucket's bitmap holding only its range's bits."""
        start, length = self.ranges[call.context.rank]
        bits = owner_selection(corrected, self.numels, ks, start, length)
        if self.bitmaps_summed:
            whole = torch.zeros(sum(self.numels), dtype=torch.bool, device=corrected.device)
            whole[start: start + length] = bits
            return pack_bits(whole, self.bitmap_nbytes)
        nbytes = self.slot_nbytes - integrity.trailer_bytes(self.config)
        slot = torch.zeros(self.slot_nbytes, dtype=torch.uint8, device=corrected.device)
        slot[:nbytes] = pack_bits(bits, nbytes)
        if self.config.wire_checksum:
            integrity.seal(slot)
        return slot

    def _exchange_bitmap(self, call, bitmap: torch.Tensor) -> torch.futures.Future:
        if self.bitmaps_summed:  # disjoint bits: the sum of the bytes is their union (no carry)
            return allreduce_future(bitmap, call.group)
        out = torch.empty(self.world_size * bitmap.numel(), dtype=torch.uint8, device=bitmap.device)
        return allgather_future(out, bitmap, call.group)

    def _bitmap_sent(self, bitmap: torch.Tensor) -> int:
        return bitmap.numel()

    def _bitmap_received(self, bitmap: torch.Tensor) -> int:
        if self.bitmaps_summed:
            return link_model.ring_allreduce_bytes(bitmap.numel(), self.world_size)
        return bitmap.numel() * (self.world_size - 1)

    def _unpack(self, call, arrived: torch.Tensor, ks) -> torch.Tensor:
        """The bucket's mask (float 0/1) from what the bitmap exchange delivered, after checking
        the slots' seals and that every tensor's mask holds its k entries."""
        step = call.context.step
        if self.bitmaps_summed:
            mask = unpack_bits(arrived, sum(self.numels))
        else:
            rows = arrived.view(self.world_size, self.slot_nbytes)
            if self.config.wire_checksum:
                bad = integrity.bad_rows(rows)
                if bad:
                    integrity.fail(call, step, f"the mask bitmap of rank(s) {bad} does not match its CRC-32C")
            mask = torch.zeros(sum(self.numels), dtype=torch.bool, device=arrived.device)
            for rank, (start, length) in enumerate(self.ranges):
                if length:
                    mask[start: start + length] = unpack_bits(rows[rank], length)
        counts = [int(part.sum()) for part in mask.split(list(self.numels))]
        if counts != list(ks):
            wrong = [(name, count, k) for name, count, k in zip(self.names, counts, ks) if count != k]
            integrity.fail(call, step, f"the agreed mask holds the wrong number of entries (tensor, entries, k): "
                                       f"{wrong[:3]}")
        return mask.float()

    def bytes_sent(self, call, packed) -> int:
        return super().bytes_sent(call, packed) + (0 if packed.extra is None else self._bitmap_sent(packed.extra))

    def bytes_received(self, call, packed) -> int:
        bitmaps = 0 if packed.extra is None else self._bitmap_received(packed.extra)
        return super().bytes_received(call, packed) + bitmaps

    def exchange(self, call, packed) -> torch.futures.Future:
        futures = [allreduce_future(packed.send, call.group)]
        if packed.extra is not None:
            futures.append(self._exchange_bitmap(call, packed.extra))
        return torch.futures.collect_all(futures)

    def accumulate(self, call, packed):
        """The callback: the recovered gradient on the mask into the bucket, the applied mask to
        the optimizer, the next mask into the memory (when the sum is finite)."""
        context = call.context
        mask, previous, beta1 = call.mask_memory
        indices = packed.indices

        def recover(fut: torch.futures.Future) -> torch.Tensor:
            futures = fut.value()
            summed = futures[0].value()
            next_mask = self._unpack(call, futures[1].value(), self.next_ks) if len(futures) > 1 else None
            finite = torch.isfinite(summed).all()
            if context.journal is not None:
                context.journal.note_reduced(~finite)
            beta = beta1 if isinstance(beta1, float) else beta1[indices]
            synced = summed.to(previous.dtype)
            recovered = (synced - previous[indices] * beta) / (1.0 - beta)
            call.out.zero_()
            call.out[indices] = recovered.to(call.out.dtype)
            applied = torch.zeros(call.out.numel(), dtype=torch.bool, device=call.out.device)
            applied[indices] = True
            context.momentum.set_applied(call.names, call.numels, applied, context.step)
            if next_mask is None and self.next_is_whole:
                next_mask = torch.ones_like(mask)
            if next_mask is not None:
                mask.copy_(torch.where(finite, next_mask, mask))
            return call.out

        return recover
