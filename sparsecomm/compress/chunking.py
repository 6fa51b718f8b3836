"""Chunked top-k: the largest entries of every fixed-size chunk of a flat bucket.

A bucket of ``numel`` entries is cut into chunks of ``chunk_size`` (the last one may be
shorter). Every full chunk sends ``ceil(density * chunk_size)`` entries, the last one
``ceil(density * its length)``, so the payload size depends only on (numel, chunk_size,
density): equal on every rank, one fixed-size all-gather carries it. Each chunk's entries
are listed in ascending index order (the order the index codecs rely on).

Selection within a chunk is the exact top-k rule of the kernels: by magnitude key
(non-finite entries first, every NaN alike), equal keys by lower index.
"""
import dataclasses

import torch

from sparsecomm.compress.topk import num_selected
from sparsecomm.compress.topk import magnitude_key

MAX_CHUNK_SIZE = 65536
MIN_CHUNK_SIZE = 2


@dataclasses.dataclass(frozen=True)
class ChunkGeometry:
    """How a bucket is chunked and how many entries each chunk sends."""

    numel: int
    chunk_size: int
    density: float

    @property
    def chunks(self) -> int:
        return -(-self.numel // self.chunk_size)

    @property
    def last_length(self) -> int:
        return self.numel - (self.chunks - 1) * self.chunk_size

    @property
    def k_full(self) -> int:
        """Entries each full chunk sends."""
        return num_selected(self.chunk_size, self.density)

    @property
    def k_last(self) -> int:
        return num_selected(self.last_length, self.density)

    @property
    def lengths(self) -> torch.Tensor:
        """int64 [chunks]: the length of every chunk."""
        lengths = torch.full((self.chunks,), self.chunk_size, dtype=torch.int64)
        lengths[-1] = self.last_length
        return lengths

    @property
    def counts(self) -> torch.Tensor:
        """int64 [chunks]: the entries every chunk sends."""
        counts = torch.full((self.chunks,), self.k_full, dtype=torch.int64)
        counts[-1] = self.k_last
        return counts

    @property
    def selected(self) -> int:
        """Entries the whole bucket sends (the payload's capacity)."""
        return (self.chunks - 1) * self.k_full + self.k_last

    def chunk_of_entry(self, device=None) -> torch.Tensor:
        """int64 [selected]: the chunk every payload entry belongs to."""
        return torch.repeat_interleave(torch.arange(self.chunks, device=device), self.counts.to(device))


def chunk_topk(acc: torch.Tensor, geometry: ChunkGeometry) -> torch.Tensor:
    """Bucket-relative indices (int64, [geometry.selected]) chosen from the 1-D ``acc``:
    chunk by chunk, each chunk's top entries in ascending index order."""
    c, chunks, k = geometry.chunk_size, geometry.chunks, geometry.k_full
    key = magnitude_key(acc).to(torch.int64)
    padded = key.new_full((chunks * c,), -1)  # padding ranks below every real entry (keys are >= 0)
    padded[: acc.numel()] = key
    # One int64 per entry, unique inside its chunk: the key, then the lower index first.
    position = torch.arange(c, device=acc.device)
    ranked = padded.view(chunks, c) * c + (c - 1 - position)
    top = torch.topk(ranked, k, dim=1, sorted=True).indices  # descending, so the last chunk keeps its first k_last
    starts = torch.arange(chunks, device=acc.device) * c
    full = (torch.sort(top[:-1], dim=1).values + starts[:-1].unsqueeze(1)).flatten()
    last = torch.sort(top[-1, : geometry.k_last]).values + starts[-1]
    return torch.cat([full, last])
