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
"""
import time

import torch
import torch.distributed as dist

from sparsecomm.compress import index_codecs
from sparsecomm.compress.chunking import ChunkGeometry, chunk_topk


def geometry(config, numel: int, density: float) -> ChunkGeometry:
    """The selection's geometry: the chunks of ``selector="chunk"``, or one chunk (exact top-k)."""
    return ChunkGeometry(numel, config.chunk_size if config.selector == "chunk" else numel, density)


def index_nbytes(config, numel: int, density: float) -> int:
    """Bytes of the leader's broadcast."""
    return index_codecs.index_region_nbytes(config.index_codec, geometry(config, numel, density))


def leader(step: int, bucket_index: int, world_size: int) -> int:
    return (step + bucket_index) % world_size


def shared_indices(call, density: float) -> tuple[torch.Tensor, int, bool]:
    """(bucket-relative indices int64, index bytes, this rank led) of this call: the leader's
    selection of its compensated ``call.grad``, broadcast to every rank (blocking)."""
    state, config = call.state, call.state.config
    shape = geometry(config, call.out.numel(), density)
    buffer = _index_buffer(state, call.index, index_codecs.index_region_nbytes(config.index_codec, shape),
                           call.out.device)
    rank = state._rank_and_world_size()[0]
    lead = leader(state.step, call.index, call.world_size)
    if rank == lead:
        buffer.copy_(index_codecs.encode(config.index_codec, chunk_topk(call.grad, shape), shape))
    started = time.perf_counter()
    source = lead if call.group is dist.group.WORLD else dist.get_global_rank(call.group, lead)
    dist.broadcast(buffer, src=source, group=call.group)
    state._count(seconds_index_broadcast=time.perf_counter() - started)
    return index_codecs.decode(config.index_codec, buffer, shape).to(call.out.device), buffer.numel(), rank == lead


def _index_buffer(state, bucket_index: int, nbytes: int, device) -> torch.Tensor:
    cached = state._index_buffers.get(bucket_index)
    if cached is None or cached.numel() != nbytes or cached.device != device:
        cached = state._index_buffers[bucket_index] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return cached
