"""The variable all-gather (``transport="mpi"``, ``selector="sampled"``, ``k_scope="bucket"``):
each rank sends only the entries above its sampled threshold, however many (at most k).

The threshold is estimated from a ~1% sample (DGC), so the count differs per rank and step;
it is capped at the payload capacity k (entries beyond it, lowest indices kept, stay in the
residual). The payload is compacted to ``[m indices | m values | pad to 8]``. The sizes are
exchanged first (a small blocking all-gather, in the hook body), then MPI ``Iallgatherv``
carries the payloads back to back in rank order.
"""
import time

import torch

from sparsecomm import ops
from sparsecomm.compress.error_feedback import divide_
from sparsecomm.compress.layout import PayloadLayout
from sparsecomm.compress.sampled_threshold import sample_positions, sample_size, threshold_of_sample
from sparsecomm.hooks.wires import integrity
from sparsecomm.hooks.wires.allgather import AllgatherWire, note_sent, seal
from sparsecomm.hooks.wires.base import Packed, kernel_arguments


class VariableAllgatherWire(AllgatherWire):
    """The capacity-k layout bounds the buffers and the dense-fallback rule (every rank may
    send k); what travels is each rank's own count."""

    def fuses_compensation(self, call) -> bool:
        return call.fusable  # the threshold pack forms acc itself

    def encode(self, call, residual, fused: bool) -> Packed:
        context, k, value_dtype, grad = call.context, call.k, call.value_dtype, call.grad
        buffer, gathered = self.buffers(call.out.device)
        payload = buffer[: self.layout.nbytes]
        divisor, add_residual = kernel_arguments(call.divisor, residual, fused)
        threshold = _sampled_threshold(grad, residual if add_residual else None, divisor, k,
                                       context.generator(grad.device))
        index_view = self.layout.payload_views(payload)[0]
        # Scratch for the values: the front of this bucket's gather buffer, idle until the
        # all-gather is issued (the last step's unpack has finished), so no allocation.
        values = gathered[: k * value_dtype.itemsize].view(value_dtype)
        m = int(ops.ef_threshold_pack(grad, residual, divisor, add_residual, threshold, index_view, values))
        # Compact to [m indices | m values | pad]: the values move from offset 4k down to 4m.
        layout = PayloadLayout(m, value_dtype)
        payload[layout.index_bytes : layout.index_bytes + layout.value_bytes].copy_(values[:m].view(torch.uint8))
        send = payload[: layout.nbytes]
        if m:
            layout.padding(send).zero_()
            sent_indices, sent_values = layout.payload_views(send)
        else:
            sent_indices, sent_values = index_view[:0], values[:0]
        packed = Packed(send, layout, sent_indices, sent_values, fused)
        seal(packed, buffer, self.trailer)
        return packed

    def exchange(self, call, packed) -> torch.futures.Future:
        """The sizes first (blocking, here in the hook body), then the payloads back to back
        in rank order; ``packed.extra`` keeps the entries per rank."""
        context = call.context
        mpi = context.transport
        started = time.perf_counter()
        counts = packed.extra = mpi.allgather_counts(packed.count)
        context.count(seconds_count_exchange=time.perf_counter() - started)
        _, gathered = self.buffers(call.out.device)
        return mpi.allgatherv(packed.wire, gathered, self._byte_counts(counts))

    def _byte_counts(self, counts) -> list[int]:
        return [PayloadLayout(count, self.layout.value_dtype).nbytes + self.trailer for count in counts]

    def bytes_received(self, call, packed) -> int:
        return sum(self._byte_counts(packed.extra)) - packed.wire.numel()

    def accumulate(self, call, packed):
        """Check every sealed payload (``wire_checksum``, as the fixed all-gather), then add them."""
        context, step, seals, counts, value_dtype = call.context, call.context.step, call.context.seals, packed.extra, \
            self.layout.value_dtype
        trailer = self.trailer

        def accumulate(fut: torch.futures.Future) -> torch.Tensor:
            gathered = fut.value()
            if trailer:
                started = time.perf_counter()
                bad, offset = [], 0
                for rank, m in enumerate(counts):  # payloads of different sizes: one check each
                    sealed = PayloadLayout(m, value_dtype).nbytes + trailer
                    if integrity.bad_rows(gathered[offset : offset + sealed].view(1, -1)):
                        bad.append(rank)
                    offset += sealed
                context.count(seconds_wire_checksum=time.perf_counter() - started)
                if bad:
                    return integrity.refused(call, step, seals, [(integrity.PAYLOAD, sender, 0) for sender in bad])
            started = time.perf_counter()
            out = unpack_variable(gathered, counts, call.out, value_dtype, trailer)
            context.count(seconds_unpack=time.perf_counter() - started)
            if context.journal is not None:
                note_sent(context, out, variable_indices(gathered, counts, value_dtype, trailer))
            return out

        return accumulate


def _sampled_threshold(grad, residual, divisor: float, k: int, generator) -> float:
    """Magnitude of the k-th largest entry of ``acc = grad / divisor (+ residual)``, estimated
    from a ~1% sample (as the sampled selector); exact when the bucket is small. Only the
    sampled entries of acc are computed."""
    n = grad.numel()
    index = slice(None) if sample_size(n) == n else sample_positions(n, generator, grad.device)
    sample = divide_(grad[index].clone(), divisor)  # rounded as the hook's own compensation
    if residual is not None:
        sample.add_(residual[index])
    return float(threshold_of_sample(sample.abs().float(), k, n))


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
