"""How the positions of a chunked selection are written: the index codecs.

Every codec writes the selection of one bucket (``ChunkGeometry``: chunk by chunk, each
chunk's entries in ascending order) into a fixed number of bytes that depends only on the
geometry, so a bucket's payload has the same size on every rank and step.

* ``int32``: the bucket-relative index, 4 bytes per entry (any selector).
* ``chunk``: the index inside its chunk, ``ceil(log2(chunk_size))`` bits (12 for 4096);
  the chunk is implied by the entry's position in the payload.
* ``rice``: inside each chunk, the gaps between sorted indices (``g0 = i0``,
  ``gj = ij - i(j-1) - 1``) in a Rice code of parameter r: ``gj >> r`` one-bits, a zero
  bit, then the low r bits of ``gj``. The gaps of a chunk of length L holding k entries sum
  to at most L - k, so the chunk never needs more than ``k (r + 1) + (L - k) >> r`` bits;
  r is the value that minimises that bound, and every chunk gets exactly that many bits
  (zero-padded). The payload size is therefore fixed, and each chunk starts at a known bit,
  so chunks decode independently (one thread or program per chunk).

Where the entropy of the index set (log2 of L choose k bits per chunk) lies: for L = 4096
and k = 41 (1%), 7.98 bits per entry; ``rice`` takes 8.54, ``chunk`` 12, ``int32`` 32.
"""
import math

import torch

from sparsecomm.compress import bitpack
from sparsecomm.compress.chunking import ChunkGeometry

INDEX_CODECS = ("int32", "chunk", "rice")
MAX_RICE_PARAMETER = 30  # gaps of up to 2**31 (one chunk the size of the largest bucket)


def chunk_index_bits(chunk_size: int) -> int:
    """Bits of a chunk-local index."""
    return max(1, math.ceil(math.log2(chunk_size)))


def rice_parameter(length: int, k: int) -> int:
    """The Rice parameter minimising the worst-case bits of k sorted entries in ``length``."""
    return min(range(MAX_RICE_PARAMETER + 1), key=lambda r: (rice_bound(length, k, r), r))


def rice_bound(length: int, k: int, r: int) -> int:
    """The most bits k sorted entries of a chunk of ``length`` take with Rice parameter r."""
    return k * (r + 1) + ((length - k) >> r)


def rice_chunk_bits(geometry: ChunkGeometry) -> tuple[tuple[int, int], tuple[int, int]]:
    """((r, bits) of a full chunk, (r, bits) of the last chunk)."""
    full_r = rice_parameter(geometry.chunk_size, geometry.k_full)
    last_r = rice_parameter(geometry.last_length, geometry.k_last)
    return ((full_r, rice_bound(geometry.chunk_size, geometry.k_full, full_r)),
            (last_r, rice_bound(geometry.last_length, geometry.k_last, last_r)))


def index_region_nbytes(codec: str, geometry: ChunkGeometry) -> int:
    """Bytes of the index region of one payload."""
    if codec == "int32":
        return 4 * geometry.selected
    if codec == "chunk":
        return bitpack.packed_nbytes(geometry.selected, chunk_index_bits(geometry.chunk_size))
    (_, full_bits), (_, last_bits) = rice_chunk_bits(geometry)
    return bitpack.packed_nbytes((geometry.chunks - 1) * full_bits + last_bits, 1)


def encode(codec: str, indices: torch.Tensor, geometry: ChunkGeometry) -> torch.Tensor:
    """The index region (uint8) for the bucket-relative ``indices`` of a chunked selection."""
    if codec == "int32":
        return indices.to(torch.int32).view(torch.uint8)
    local = indices - geometry.chunk_of_entry(indices.device) * geometry.chunk_size
    if codec == "chunk":
        return bitpack.pack(local, chunk_index_bits(geometry.chunk_size))
    return _rice_encode(local, geometry)


def decode(codec: str, region: torch.Tensor, geometry: ChunkGeometry) -> torch.Tensor:
    """Bucket-relative indices (int64, [selected]) from one payload's index region."""
    if codec == "int32":
        return region[: 4 * geometry.selected].clone().view(torch.int32).to(torch.int64)
    chunk = geometry.chunk_of_entry(region.device)
    if codec == "chunk":
        local = bitpack.unpack(region, chunk_index_bits(geometry.chunk_size), geometry.selected)
    else:
        local = _rice_decode(region, geometry)
    return local + chunk * geometry.chunk_size


def _chunk_bit_starts(geometry: ChunkGeometry, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(Rice parameter, first bit) of every chunk, int64 [chunks] each."""
    (full_r, full_bits), (last_r, _) = rice_chunk_bits(geometry)
    chunks = geometry.chunks
    r = torch.full((chunks,), full_r, dtype=torch.int64, device=device)
    r[-1] = last_r
    return r, torch.arange(chunks, device=device) * full_bits


def _rice_encode(local: torch.Tensor, geometry: ChunkGeometry) -> torch.Tensor:
    device = local.device
    chunk = geometry.chunk_of_entry(device)
    counts = geometry.counts.to(device)
    first_of_chunk = torch.cumsum(counts, 0) - counts
    previous = torch.cat([local.new_full((1,), -1), local[:-1]])
    previous[first_of_chunk] = -1  # every chunk's first gap counts from position 0
    gaps = local - previous - 1
    r_of_chunk, chunk_start = _chunk_bit_starts(geometry, device)
    r = r_of_chunk[chunk]
    quotient = gaps >> r
    width = quotient + 1 + r  # bits of this gap's code
    ends = torch.cumsum(width, 0)
    # Offset of every code inside its chunk: subtract the bits of the earlier chunks.
    before_chunk = (ends - width)[first_of_chunk]
    start = chunk_start[chunk] + (ends - width) - before_chunk[chunk]
    (_, full_bits), (_, last_bits) = rice_chunk_bits(geometry)
    stream = torch.zeros((geometry.chunks - 1) * full_bits + last_bits, dtype=torch.int64, device=device)
    # The unary part: quotient one-bits from the code's start (the terminating zero is implicit).
    code = torch.repeat_interleave(torch.arange(local.numel(), device=device), quotient)
    ones = start[code] + (torch.arange(code.numel(), device=device) - (torch.cumsum(quotient, 0) - quotient)[code])
    stream[ones] = 1
    # The r low bits of the gap, LSB first, after the zero.
    max_r = int(r_of_chunk.max())
    if max_r:
        bit = torch.arange(max_r, device=device)
        valid = bit.unsqueeze(0) < r.unsqueeze(1)
        where = (start + quotient + 1).unsqueeze(1) + bit
        values = (gaps.unsqueeze(1) >> bit) & 1
        stream[where[valid]] = values[valid]
    return bitpack.bits_to_bytes(stream)


# Above this many entries per chunk the rounds of the vectorised decoder cost more than a
# plain walk along each chunk's bits (few, long chunks: exact top-k as one chunk).
_MAX_VECTOR_ROUNDS = 256


def _rice_decode(region: torch.Tensor, geometry: ChunkGeometry) -> torch.Tensor:
    """Decode every chunk at once, one gap per chunk per round (k rounds); for long chunks,
    walk each chunk's bits instead."""
    if geometry.k_full > _MAX_VECTOR_ROUNDS:
        return _rice_decode_walk(region, geometry)
    device = region.device
    (_, full_bits), (_, last_bits) = rice_chunk_bits(geometry)
    total = (geometry.chunks - 1) * full_bits + last_bits
    stream = bitpack.bytes_to_bits(region[: bitpack.packed_nbytes(total, 1)])[:total]
    # next_zero[p]: the first zero bit at or after p (a chunk's padding is zeros, so a code
    # never runs past its chunk).
    position = torch.arange(total + 1, device=device)
    zero_at = torch.where(torch.cat([stream, stream.new_zeros(1)]) == 0, position, total)
    next_zero = torch.flip(torch.cummin(torch.flip(zero_at, [0]), 0).values, [0])
    r, cursor = _chunk_bit_starts(geometry, device)
    counts = geometry.counts.to(device)
    local = torch.empty((geometry.chunks, geometry.k_full), dtype=torch.int64, device=device)
    index = torch.full((geometry.chunks,), -1, dtype=torch.int64, device=device)
    padded_stream = torch.cat([stream, stream.new_zeros(MAX_RICE_PARAMETER + 1)])
    for j in range(geometry.k_full):
        active = counts > j
        zero = next_zero[cursor.clamp(max=total)]
        quotient = zero - cursor
        low = torch.zeros_like(cursor)
        for bit in range(int(r.max()) if r.numel() else 0):
            take = (bit < r).to(torch.int64)
            low |= (padded_stream[zero + 1 + bit] * take) << bit
        gap = (quotient << r) | low
        index = torch.where(active, index + gap + 1, index)
        local[:, j] = index
        cursor = torch.where(active, zero + 1 + r, cursor)
    keep = torch.arange(geometry.k_full, device=device).unsqueeze(0) < counts.unsqueeze(1)
    return local[keep]


def _rice_decode_walk(region: torch.Tensor, geometry: ChunkGeometry) -> torch.Tensor:
    """The same decoding, one code after another (host lists: fast for a few long chunks)."""
    import numpy as np

    (_, full_bits), (_, last_bits) = rice_chunk_bits(geometry)
    total = (geometry.chunks - 1) * full_bits + last_bits
    bits = bitpack.bytes_to_bits(region[: bitpack.packed_nbytes(total, 1)].cpu())[:total].numpy()
    padded = np.concatenate([bits, np.zeros(MAX_RICE_PARAMETER + 2, dtype=bits.dtype)])
    position = np.arange(padded.size)
    next_zero = np.minimum.accumulate(np.where(padded == 0, position, padded.size)[::-1])[::-1].tolist()
    r_of_chunk, chunk_start = (t.tolist() for t in _chunk_bit_starts(geometry, "cpu"))
    counts = geometry.counts.tolist()
    out = []
    for r, cursor, count in zip(r_of_chunk, chunk_start, counts):
        # low[p]: the r-bit number whose least significant bit is at p
        low = np.zeros(padded.size, dtype=np.int64)
        for bit in range(r):
            low[: padded.size - bit] += padded[bit:].astype(np.int64) << bit
        low = low.tolist()
        index = -1
        for _ in range(count):
            zero = next_zero[cursor]
            index += (((zero - cursor) << r) | (low[zero + 1] if r else 0)) + 1
            out.append(index)
            cursor = zero + 1 + r
    return torch.tensor(out, dtype=torch.int64, device=region.device)
