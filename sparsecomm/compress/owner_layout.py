"""How a bucket is split among owners for the owner exchange (``exchange="owner"``).

Every rank owns a contiguous range of the bucket's chunks: with C chunks and p ranks, the
first ``C % p`` owners hold ``C // p + 1`` chunks, the others ``C // p`` (an owner may hold
none when C < p). A rank sends each owner the chunked selection of that owner's range as a
payload of its own (``ChunkLayout`` over the range), so the message for an owner has the
same size on every rank, and one ``all_to_all_single`` carries them all. Ranges start at a
chunk boundary, so the selection of a range is exactly the selection the whole bucket
would make there: splitting changes which messages carry an entry, never which entries are
sent or how they are encoded.

With exact top-k (``chunk_size`` 0) the bucket is cut into p near-equal ranges and each
range is one chunk: its top ``ceil(density * length)`` entries (scales per 64 entries for
the scaled codecs). That is top-k per range, not over the whole bucket: close to it when
ranges are long, and the same selection on the sending and on the owning side.

What this rank sends is the concatenation ``[payload for owner 0 | owner 1 | ...]``; this
class reads and writes it with the interface of ``ChunkLayout`` (encode, decode, values,
byte offsets), so the monitors and the audit read it like any other payload. The owners'
results, which come back by one all-gather, use the same per-range layouts, each padded
to the largest (``slot_nbytes``). With ``trailer`` > 0 every message, and every slot, is
followed by that many bytes that seal it (``wire_checksum``: ``compress.payload_seal``).
"""
import dataclasses
import functools

import torch

from sparsecomm.compress.chunk_layout import ChunkLayout


# Entries per value scale when an owner's range is one chunk (exact top-k per range), as
# for exact top-k on the compact wire (hooks/pipeline/steps.py, payload_layout).
EXACT_SCALE_GROUP = 64


@dataclasses.dataclass(frozen=True)
class OwnerLayout:
    numel: int
    chunk_size: int  # 0: exact top-k inside each owner's range (the range is one chunk)
    density: float
    index_codec: str
    value_codec: str
    world_size: int
    trailer: int = 0  # bytes sealing each message and each reply slot (0: not sealed)

    # ----- the split -------------------------------------------------------------------

    @functools.cached_property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        """(first entry, entries) of every owner's range, in rank order."""
        if not self.chunk_size:  # exact: p near-equal ranges, the first numel % p one longer
            per_owner, extra = divmod(self.numel, self.world_size)
            starts = [owner * per_owner + min(owner, extra) for owner in range(self.world_size + 1)]
            return tuple((start, end - start) for start, end in zip(starts, starts[1:]))
        chunks = -(-self.numel // self.chunk_size)
        per_owner, extra = divmod(chunks, self.world_size)
        out, chunk = [], 0
        for owner in range(self.world_size):
            owned = per_owner + (owner < extra)
            start = min(chunk * self.chunk_size, self.numel)
            end = min((chunk + owned) * self.chunk_size, self.numel)
            out.append((start, end - start))
            chunk += owned
        return tuple(out)

    @functools.cached_property
    def parts(self) -> tuple[ChunkLayout | None, ...]:
        """The payload layout of every owner's range (None for an owner holding nothing)."""
        if not self.chunk_size:
            return tuple(ChunkLayout(length, length, self.density, self.index_codec, self.value_codec,
                                     scale_group=EXACT_SCALE_GROUP) if length else None for _, length in self.ranges)
        return tuple(ChunkLayout(length, self.chunk_size, self.density, self.index_codec, self.value_codec)
                     if length else None for _, length in self.ranges)

    @functools.cached_property
    def part_nbytes(self) -> tuple[int, ...]:
        """Bytes of the payload of the message for each owner."""
        return tuple(part.nbytes if part is not None else 0 for part in self.parts)

    @functools.cached_property
    def message_nbytes(self) -> tuple[int, ...]:
        """Bytes of the message for each owner, its trailer included (the ``all_to_all_single``
        split sizes); 0 for an owner of nothing."""
        return tuple(nbytes + self.trailer if nbytes else 0 for nbytes in self.part_nbytes)

    @functools.cached_property
    def part_offsets(self) -> tuple[int, ...]:
        offsets, total = [], 0
        for nbytes in self.message_nbytes:
            offsets.append(total)
            total += nbytes
        return tuple(offsets)

    @property
    def slot_nbytes(self) -> int:
        """Bytes of one owner's slot in the all-gather of the results: the largest part, then
        the trailer."""
        return max(self.part_nbytes) + self.trailer

    def sections(self):
        """(owner, its ChunkLayout, its slice of the bucket) of every owner holding a range."""
        for owner, part in enumerate(self.parts):
            if part is not None:
                start, length = self.ranges[owner]
                yield owner, part, slice(start, start + length)

    def part_of(self, payload: torch.Tensor, owner: int) -> torch.Tensor:
        """The bytes of ``payload`` (what a rank sends) meant for ``owner``."""
        offset = self.part_offsets[owner]
        return payload[offset : offset + self.part_nbytes[owner]]

    def message_of(self, payload: torch.Tensor, owner: int) -> torch.Tensor:
        """The message for ``owner`` in ``payload``: its part, then its trailer."""
        offset = self.part_offsets[owner]
        return payload[offset : offset + self.message_nbytes[owner]]

    # ----- the ChunkLayout interface of the whole send buffer ------------------------------

    @property
    def nbytes(self) -> int:
        return sum(self.message_nbytes)

    @property
    def capacity(self) -> int:
        return sum(part.capacity for part in self.parts if part is not None)

    @property
    def bytes_per_entry(self) -> float:
        return self.nbytes / self.capacity

    @property
    def value_dtype(self) -> torch.dtype:
        return next(part for part in self.parts if part is not None).value_dtype

    def encode(self, acc: torch.Tensor, residual: torch.Tensor | None, payload: torch.Tensor):
        """Every owner's range of the 1-D ``acc`` into its part of ``payload`` (see
        ``ChunkLayout.encode``). Returns (bucket-relative indices int64, decoded values)."""
        parts = [part.encode(acc[section], None if residual is None else residual[section],
                             self.part_of(payload, owner)) for owner, part, section in self.sections()]
        return self.joined(parts)

    def joined(self, parts) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-owner (range-relative indices, values), in owner order, as one bucket-relative pair."""
        starts = [section.start for _, _, section in self.sections()]
        return (torch.cat([indices + start for (indices, _), start in zip(parts, starts)]),
                torch.cat([values for _, values in parts]))

    def decode(self, payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(bucket-relative indices int64, values) of a whole send buffer, in payload order."""
        return self.joined([part.decode(self.part_of(payload, owner)) for owner, part, _ in self.sections()])

    def values_copy(self, payload: torch.Tensor) -> torch.Tensor:
        return self.decode(payload)[1]

    def value_byte_offset(self, position: int) -> int:
        """The payload byte holding the first bit of the ``position``-th value's code."""
        if not 0 <= position < self.capacity:
            raise IndexError(f"payload position {position} outside a payload of capacity {self.capacity}")
        for owner, part in enumerate(self.parts):
            if part is None:
                continue
            if position < part.capacity:
                return self.part_offsets[owner] + part.value_byte_offset(position)
            position -= part.capacity
        raise AssertionError("unreachable: position was checked against the capacity")
