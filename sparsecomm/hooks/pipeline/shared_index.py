"""Stage 3 of ``exchange="shared-index"``: one index set for every rank, chosen by a leader.

Every rank sends the values of acc at the same indices, so the values can be summed by a
plain allreduce: no index bytes per rank and no scatter of p payloads, and what a rank
receives does not grow with p. The indices are the selection (exact top-k, or the top
entries of every chunk) of one rank, the leader, and the leader rotates: bucket b of step
t is led by rank ``(t + b) mod p`` (ScaleCom's cyclic local top-k, NeurIPS 2020). The
leader broadcasts its index set, written by the index codec, in the hook body; the
broadcast is waited for there, since every rank needs the indices before its values.
What the shared set leaves out stays in each rank's residual, so an entry that is large
on one rank but not on the leader is sent when it has grown or when that rank leads.

With ``wire_checksum`` the leader seals its broadcast (``integrity``) and every rank checks
its copy. The values that follow are a sum, which no checksum survives; instead every rank
adds its verdict on the broadcast (1: its copy failed the check) to one more element of the
values allreduce, so every rank learns how many ranks saw a bad copy and all raise alike.
A rank whose copy failed sends zeros at stand-in indices (the first k entries) rather than
decode bytes it cannot trust.
"""
import time

import torch
import torch.distributed as dist

from sparsecomm.compress import index_codecs
from sparsecomm.compress.chunking import ChunkGeometry, chunk_topk
from sparsecomm.hooks.pipeline import decode, integrity


def geometry(config, numel: int, density: float) -> ChunkGeometry:
    """The selection's geometry: the chunks of ``selector="chunk"``, or one chunk (exact top-k)."""
    return ChunkGeometry(numel, config.chunk_size if config.selector == "chunk" else numel, density)


def index_nbytes(config, numel: int, density: float) -> int:
    """Bytes of the leader's broadcast (its checksum's trailer included)."""
    return (index_codecs.index_region_nbytes(config.index_codec, geometry(config, numel, density))
            + integrity.trailer_bytes(config))


def allreduced_values(config, selected: int) -> int:
    """Elements of the values allreduce: the selected values, and the ranks' verdicts on the
    index broadcast (``wire_checksum``)."""
    return selected + int(config.wire_checksum)


def leader(step: int, bucket_index: int, world_size: int) -> int:
    return (step + bucket_index) % world_size


def shared_indices(call, density: float) -> tuple[torch.Tensor, int, bool, torch.Tensor | None]:
    """(bucket-relative indices int64, index bytes, this rank led, verdict) of this call: the
    leader's selection of its compensated ``call.grad``, broadcast to every rank (blocking).
    The verdict (``wire_checksum``; else None) is a 0-d tensor, 1 if this rank's copy failed
    its check (the indices are then stand-ins), else 0."""
    state, config = call.state, call.state.config
    shape = geometry(config, call.out.numel(), density)
    nbytes = index_codecs.index_region_nbytes(config.index_codec, shape)
    buffer = _index_buffer(state, call.index, nbytes + integrity.trailer_bytes(config), call.out.device)
    rank = state._rank_and_world_size()[0]
    lead = leader(state.step, call.index, call.world_size)
    if rank == lead:
        buffer[:nbytes].copy_(index_codecs.encode(config.index_codec, chunk_topk(call.grad, shape), shape))
        if config.wire_checksum:
            integrity.seal(buffer)
    started = time.perf_counter()
    source = lead if call.group is dist.group.WORLD else dist.get_global_rank(call.group, lead)
    dist.broadcast(buffer, src=source, group=call.group)
    state._count(seconds_index_broadcast=time.perf_counter() - started)
    verdict = None
    if config.wire_checksum:
        started = time.perf_counter()
        failed = bool(integrity.bad_rows(buffer.view(1, -1)))
        verdict = torch.tensor(float(failed), device=call.out.device)
        state._count(seconds_wire_checksum=time.perf_counter() - started)
        if failed:
            return torch.arange(shape.selected, device=call.out.device), buffer.numel(), rank == lead, verdict
    indices = index_codecs.decode(config.index_codec, buffer[:nbytes], shape).to(call.out.device)
    return indices, buffer.numel(), rank == lead, verdict


def with_verdict(packed, verdict: torch.Tensor | None):
    """``packed`` whose allreduce also sums the ranks' verdicts on the index broadcast (one more
    element, in the values' dtype: exact counts up to 256 ranks in bfloat16)."""
    if verdict is not None:
        packed.send = torch.cat([packed.send, verdict.to(packed.send.dtype).reshape(1)])
    return packed


def accumulate(call, indices: torch.Tensor, checked: bool):
    """The callback of the values allreduce: with a verdict element (``checked``), raise on every
    rank if any rank's copy of the index broadcast failed its check; then scatter the sums."""
    state, step = call.state, call.state.step
    lead = leader(step, call.index, call.world_size)
    scatter = decode.scatter_values(call, indices)

    def check_then_scatter(fut: torch.futures.Future) -> torch.Tensor:
        if checked:
            failed = round(float(fut.value()[indices.numel()]))
            if failed:
                integrity.fail(call, step, f"the index broadcast of the leader, rank {lead}, does not match its "
                                           f"CRC-32C on {failed} of {call.world_size} ranks")
        return scatter(fut)

    return check_then_scatter


def _index_buffer(state, bucket_index: int, nbytes: int, device) -> torch.Tensor:
    cached = state._index_buffers.get(bucket_index)
    if cached is None or cached.numel() != nbytes or cached.device != device:
        cached = state._index_buffers[bucket_index] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return cached
