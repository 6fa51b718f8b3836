"""The shared-index exchange (``exchange="shared-index"``): one index set for every rank, chosen by a leader.

Every rank sends the values of acc at the same indices, so the values can be summed by a
plain allreduce: no index bytes per rank and no scatter of p payloads, and what a rank
receives does not grow with p. The indices are the selection (exact top-k, or the top
entries of every chunk) of one rank, the leader, and the leader rotates: bucket b of step
t is led by rank ``(t + b) mod p`` (ScaleCom's cyclic local top-k, NeurIPS 2020). The
leader broadcasts its index set, written by the index codec, in the hook body; the
broadcast is waited for there, since every rank needs the indices before its values.
What the shared set leaves out stays in each rank's residual, so an entry that is large
on one rank but not on the leader is sent when it has grown or when that rank leads.

``leader_filter`` (beta < 1) is ScaleCom's low-pass filter on that memory (Algorithm 1 of
the paper): ``residual = (1 - beta) residual + beta (acc - sent)`` (:func:`low_pass`),
so a rank's memory keeps what persists from step to step, which the ranks share, and the
leader's top-k of its own acc comes closer to the top-k of their sum. Then ``sent + new
residual - acc`` is ``(1 - beta) (sent - (acc - old residual))``, not 0: the invariant no
longer holds (the settings refuse ``verify_conservation`` with it). ``diagnose_leader_overlap``
measures that closeness: one dense allreduce of acc per bucket, and the share of the
leader's k indices among the top k of the sum (:meth:`SharedIndexWire.measure_leader_overlap`).

With ``wire_checksum`` the leader seals its broadcast (``integrity``) and every rank checks
its copy. The values that follow are a sum, which no checksum survives; instead every rank
adds its verdict on the broadcast (1: its copy failed the check) to one more element of the
values allreduce, so every rank learns how many ranks saw a bad copy and all raise alike.
A rank whose copy failed sends zeros at stand-in indices (the first k entries) rather than
decode bytes it cannot trust.
"""
import itertools
import time
import zlib

import torch
import torch.distributed as dist

from sparsecomm import compress
from sparsecomm.comm import allreduce_future, link_model
from sparsecomm.compress import index_codecs
from sparsecomm.compress.chunking import ChunkGeometry, chunk_topk
from sparsecomm.hooks.wires import integrity
from sparsecomm.hooks.wires.base import Packed, Wire


class AllreducedValues(Wire):
    """What random-k, the shared-index and the shared-mask exchanges have in common: every rank
    sends k values at the same indices, summed by a plain allreduce (its bytes, its dense-fallback
    rule and its modelled time are those of k values). A sum is no rank's payload: nothing to seal."""

    def __init__(self, config, k: int, value_dtype: torch.dtype, world_size: int):
        super().__init__(config, None, world_size)
        self.k, self.value_dtype = k, value_dtype

    @property
    def capacity(self) -> int:
        return self.k

    def matches(self, other) -> bool:
        return super().matches(other) and (self.k, self.value_dtype) == (other.k, other.value_dtype)

    def smaller_than_dense(self, numel, buffer_dtype) -> bool:
        return not link_model.falls_back_to_dense(self.k * self.value_dtype.itemsize, numel * buffer_dtype.itemsize, 1)

    def density_bound(self, buffer_dtype) -> float:
        return buffer_dtype.itemsize / self.value_dtype.itemsize

    def modelled_seconds(self, numel, buffer_dtype, link) -> float:
        return link_model.ring_allreduce_seconds(self.k * self.value_dtype.itemsize, self.world_size,
                                                 rate_bytes_per_s=link.bytes_per_s, alpha_s=link.latency_s)

    def bytes_received(self, call, packed) -> int:
        return link_model.ring_allreduce_bytes(packed.send.numel() * packed.send.element_size(), self.world_size)

    def exchange(self, call, packed) -> torch.futures.Future:
        return allreduce_future(packed.send, call.group)

    def accumulate(self, call, packed):
        return scatter_values(call, packed.indices)

    def sent_dense(self, packed, like) -> torch.Tensor:
        return torch.zeros_like(like).index_put_((packed.indices,), packed.values.to(like.dtype))


class RandomKWire(AllreducedValues):
    """Random-k: the values at indices every rank draws from the same seeded stream (per
    parameter name, so the same indices whatever the bucket layout), allreduced."""

    def encode(self, call, residual, fused: bool) -> Packed:
        context, config = call.context, self.config
        offsets = [0, *itertools.accumulate(call.numels)]
        indices = torch.cat([
            compress.random_indices(n, k_part, seed=config.seed, step=context.step, stream=zlib.crc32(name.encode()))
            + offset
            for name, n, k_part, offset in zip(call.names, call.numels, call.ks, offsets)
        ]).to(call.grad.device)
        return shared_values(call, residual, indices)


class SharedIndexWire(AllreducedValues):
    """The leader's index set, broadcast (sealed); every rank's values there, allreduced with
    the ranks' verdicts on the broadcast (``wire_checksum``)."""

    name = "shared_index"

    def __init__(self, config, numel: int, density: float, value_dtype: torch.dtype, world_size: int):
        self.geometry = geometry(config, numel, density)
        super().__init__(config, self.geometry.selected, value_dtype, world_size)
        self.index_nbytes = index_codecs.index_region_nbytes(config.index_codec, self.geometry)
        self.broadcast_nbytes = self.index_nbytes + integrity.trailer_bytes(config)  # the leader's, sealed
        self.index_buffer = None  # allocated by the first call, reused every step

    def matches(self, other) -> bool:
        return super().matches(other) and self.geometry == other.geometry

    def allreduced_values(self) -> int:
        """Elements of the values allreduce: the selected values, and the ranks' verdicts on the
        index broadcast (``wire_checksum``)."""
        return self.k + int(self.config.wire_checksum)

    def smaller_than_dense(self, numel, buffer_dtype) -> bool:
        # An allreduce of k values, plus the leader's indices once.
        values = self.allreduced_values() * self.value_dtype.itemsize
        return not link_model.falls_back_to_dense(values + self.broadcast_nbytes, numel * buffer_dtype.itemsize, 1)

    def density_bound(self, buffer_dtype) -> float:
        index_bytes = self.index_nbytes / max(self.k, 1)  # the index codec's bytes per entry at this size
        return buffer_dtype.itemsize / (self.value_dtype.itemsize + index_bytes)

    def modelled_seconds(self, numel, buffer_dtype, link) -> float:
        rate, alpha = link.bytes_per_s, link.latency_s
        return (link_model.broadcast_seconds(self.broadcast_nbytes, self.world_size, rate_bytes_per_s=rate,
                                             alpha_s=alpha)
                + link_model.ring_allreduce_seconds(self.allreduced_values() * self.value_dtype.itemsize,
                                                    self.world_size, rate_bytes_per_s=rate, alpha_s=alpha))

    def encode(self, call, residual, fused: bool) -> Packed:
        """The leader's selection of its compensated acc, broadcast to every rank and waited for
        (every rank needs the indices before its values: the one collective before encoding),
        then this rank's values there; ``packed.extra`` = (this rank led, the verdict)."""
        indices, led, verdict = self._shared_indices(call)
        if self.config.diagnose_leader_overlap:
            self.measure_leader_overlap(call, indices, verdict is None or not bool(verdict))
        packed = shared_values(call, residual, indices, self.config.filtered_memory_beta)
        if verdict is not None:  # one more element, in the values' dtype: exact counts up to 256 ranks in bf16
            packed.send = torch.cat([packed.send, verdict.to(packed.send.dtype).reshape(1)])
        packed.extra = (led, verdict is not None)
        return packed

    def bytes_sent(self, call, packed) -> int:
        led, _ = packed.extra
        return super().bytes_sent(call, packed) + (self.broadcast_nbytes if led else 0)

    def bytes_received(self, call, packed) -> int:
        led, _ = packed.extra
        return super().bytes_received(call, packed) + (0 if led else self.broadcast_nbytes)

    def measure_leader_overlap(self, call, indices: torch.Tensor, trusted: bool) -> None:
        """``diagnose_leader_overlap``: count into ``leader_overlap_sum`` the share of the leader's
        ``indices`` that are among the top k (the same selection: exact, or per chunk) of the sum
        over ranks of acc, and one into ``leader_overlap_buckets``. Every rank issues the dense
        allreduce of acc here, in the hook body, and every rank reads the same sum and the same
        indices, so counts the same overlap; a rank whose copy of the index broadcast failed its
        check (not ``trusted``: the step raises) joins the allreduce and counts nothing."""
        started = time.perf_counter()
        summed = call.grad.clone()
        dist.all_reduce(summed, group=call.group)
        if trusted:
            in_global_top = torch.zeros(summed.numel(), dtype=torch.bool, device=summed.device)
            in_global_top[chunk_topk(summed, self.geometry)] = True
            overlap = int(in_global_top[indices].sum()) / indices.numel()
            call.context.count(leader_overlap_buckets=1, leader_overlap_sum=overlap)
        call.context.count(seconds_leader_overlap=time.perf_counter() - started)

    def _shared_indices(self, call) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
        """(bucket-relative indices int64, this rank led, verdict): the verdict (``wire_checksum``;
        else None) is a 0-d tensor, 1 if this rank's copy failed its check (the indices are
        then stand-ins), else 0."""
        context, config, shape, nbytes = call.context, self.config, self.geometry, self.index_nbytes
        if self.index_buffer is None or self.index_buffer.device != call.out.device:
            self.index_buffer = torch.empty(self.broadcast_nbytes, dtype=torch.uint8, device=call.out.device)
        buffer = self.index_buffer
        rank = context.rank
        lead = leader(context.step, call.index, call.world_size)
        if rank == lead:
            buffer[:nbytes].copy_(index_codecs.encode(config.index_codec, chunk_topk(call.grad, shape), shape))
            if config.wire_checksum:
                integrity.seal(buffer)
        started = time.perf_counter()
        source = lead if call.group is dist.group.WORLD else dist.get_global_rank(call.group, lead)
        dist.broadcast(buffer, src=source, group=call.group)
        context.count(seconds_index_broadcast=time.perf_counter() - started)
        verdict = None
        if config.wire_checksum:
            started = time.perf_counter()
            failed = bool(integrity.bad_rows(buffer.view(1, -1)))
            verdict = torch.tensor(float(failed), device=call.out.device)
            context.count(seconds_wire_checksum=time.perf_counter() - started)
            if failed:
                return torch.arange(shape.selected, device=call.out.device), rank == lead, verdict
        indices = index_codecs.decode(config.index_codec, buffer[:nbytes], shape).to(call.out.device)
        return indices, rank == lead, verdict

    def accumulate(self, call, packed):
        """With a verdict element, raise on every rank if any rank's copy of the index broadcast
        failed its check; then scatter the sums."""
        step = call.context.step
        lead = leader(step, call.index, call.world_size)
        scatter = scatter_values(call, packed.indices)
        _, checked = packed.extra
        selected = packed.indices.numel()

        def check_then_scatter(fut: torch.futures.Future) -> torch.Tensor:
            if checked:
                failed = round(float(fut.value()[selected]))
                if failed:
                    integrity.fail(call, step, f"the index broadcast of the leader, rank {lead}, does not match its "
                                               f"CRC-32C on {failed} of {call.world_size} ranks")
            return scatter(fut)

        return check_then_scatter


def geometry(config, numel: int, density: float) -> ChunkGeometry:
    """The selection's geometry: the chunks of ``selector="chunk"``, or one chunk (exact top-k)."""
    return ChunkGeometry(numel, config.chunk_size if config.selector == "chunk" else numel, density)


def leader(step: int, bucket_index: int, world_size: int) -> int:
    return (step + bucket_index) % world_size


def shared_values(call, residual, indices: torch.Tensor, beta: float | None = None) -> Packed:
    """The values of the compensated acc at ``indices``, which every rank shares (random-k's
    seeded draw, or the leader's selection), ready to be summed by an allreduce; the residual
    keeps the rest and the wire rounding of what is sent (``beta``: through :func:`low_pass`)."""
    acc = call.grad
    values = compress.to_wire_dtype(acc[indices], call.value_dtype)
    nonfinite = not bool(torch.isfinite(acc).all())
    if nonfinite and bool(torch.isfinite(values).all()):
        # The shared indices missed this rank's Inf/NaN: send one anyway (at a shared
        # index), so that every rank sees the overflow and the step is skipped.
        values[0] = acc[(~torch.isfinite(acc)).nonzero()[0, 0]].to(values.dtype)
    if residual is not None:
        if beta is None:
            residual.copy_(acc)
            residual[indices] = acc[indices] - values.to(acc.dtype)
        else:
            low_pass(residual, acc, indices, values.to(acc.dtype), beta)
        if nonfinite:  # 0 where acc is not finite, and at the index that carried a stand-in Inf/NaN
            residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    return Packed(values, None, indices, values, False, nonfinite)


def low_pass(memory: torch.Tensor, acc: torch.Tensor, indices: torch.Tensor, sent: torch.Tensor,
             beta: float) -> None:
    """ScaleCom's low-pass filter on the error-feedback memory, in place (Chen et al., NeurIPS
    2020, Algorithm 1: ``m = (1 - beta) m + beta (acc - sent)``): ``sent``, the decoded values at
    ``indices`` (unique), and acc, with the old memory in it, as the hook formed it. Where
    something was sent, ``acc - sent`` (the wire's rounding) is formed first, so a small memory
    there is not lost to the cancellation of ``beta acc - beta sent``; beta = 1 would be plain
    error feedback (the callers pass None instead, and keep its exact path)."""
    left = acc[indices] - sent  # what the payload did not carry of the sent entries
    kept = memory[indices].mul_(1.0 - beta).add_(left, alpha=beta)  # (a copy: advanced indexing)
    memory.mul_(1.0 - beta).add_(acc, alpha=beta)
    memory[indices] = kept


def scatter_values(call, indices):
    """The callback of the values allreduce: the summed values at the shared indices."""
    context = call.context

    def scatter(fut: torch.futures.Future) -> torch.Tensor:
        reduced = fut.value()[: indices.numel()]  # (the shared-index exchange sums one more element)
        if context.journal is not None:
            context.journal.note_reduced(~torch.isfinite(reduced).all())
        call.out.zero_()
        call.out[indices] = reduced.to(call.out.dtype)
        return call.out

    return scatter
