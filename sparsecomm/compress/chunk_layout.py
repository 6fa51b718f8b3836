"""The payload of a chunked selection (``selector="chunk"``): its byte layout, encode, decode.

One payload per bucket and rank, of a size fixed by (numel, chunk_size, density, codecs)::

    [ scales: groups x bfloat16 (scaled value codecs only) | index region | value region | pad to 8 ]

A scale group is a chunk, or, with ``scale_group`` > 0, that many consecutive payload
entries (how exact top-k, one chunk the size of the bucket, gets scales at a useful grain).

The index region is written by the index codec (:mod:`sparsecomm.compress.index_codecs`),
the value region by the value codec (:mod:`sparsecomm.compress.value_codecs`); entries
are in payload order: chunk by chunk, ascending index inside a chunk. This class is the
reference (pure torch) encoder and decoder; it is what the hook, the monitors and the
tests read the layout from.
"""
import dataclasses

import torch

from sparsecomm.compress import bitpack, index_codecs, value_codecs
from sparsecomm.compress.chunking import ChunkGeometry, chunk_topk
from sparsecomm.compress.error_feedback import residual_after_sending
from sparsecomm.compress.layout import ALIGNMENT


@dataclasses.dataclass(frozen=True)
class ChunkLayout:
    numel: int
    chunk_size: int
    density: float
    index_codec: str
    value_codec: str
    scale_group: int = 0  # entries per value scale; 0: one scale per chunk

    @property
    def scale_groups(self) -> int:
        if self.scale_group:
            return -(-self.capacity // self.scale_group)
        return self.geometry.chunks

    def group_of_entry(self, device=None) -> torch.Tensor:
        """int64 [capacity]: the scale group of every payload entry."""
        if self.scale_group:
            return torch.arange(self.capacity, device=device) // self.scale_group
        return self.geometry.chunk_of_entry(device)

    @property
    def geometry(self) -> ChunkGeometry:
        return ChunkGeometry(self.numel, self.chunk_size, self.density)

    @property
    def capacity(self) -> int:
        """Entries one payload holds."""
        return self.geometry.selected

    @property
    def scale_bytes(self) -> int:
        return value_codecs.SCALE_BYTES * self.scale_groups if value_codecs.has_scale(self.value_codec) else 0

    @property
    def index_bytes(self) -> int:
        return index_codecs.index_region_nbytes(self.index_codec, self.geometry)

    @property
    def value_bytes(self) -> int:
        return bitpack.packed_nbytes(self.capacity, value_codecs.value_bits(self.value_codec))

    @property
    def nbytes(self) -> int:
        return -(-(self.scale_bytes + self.index_bytes + self.value_bytes) // ALIGNMENT) * ALIGNMENT

    @property
    def bytes_per_entry(self) -> float:
        """Every byte of the payload (scales, indices, values, padding) per selected entry."""
        return self.nbytes / self.capacity

    @property
    def value_dtype(self) -> torch.dtype:
        """dtype of one value on the wire: the float codec's, else bytes of packed codes."""
        return value_codecs.FLOAT_CODECS.get(self.value_codec, torch.uint8)

    def _regions(self, payload: torch.Tensor):
        index_start = self.scale_bytes
        value_start = index_start + self.index_bytes
        return (payload[:index_start], payload[index_start:value_start],
                payload[value_start : value_start + self.value_bytes], payload[value_start + self.value_bytes :])

    # ----- encode -----------------------------------------------------------------------

    def encode(self, acc: torch.Tensor, residual: torch.Tensor | None, payload: torch.Tensor):
        """Select from the 1-D ``acc``, write ``payload`` (uint8, ``nbytes``) and, when given,
        the new residual (``acc - decoded``; 0 where acc is not finite, acc where the chunk
        decodes to a non-finite value). Returns (indices int64, decoded values)."""
        geometry = self.geometry
        indices = chunk_topk(acc, geometry)
        values = acc[indices]
        group = self.group_of_entry(acc.device)
        scales, value_region = value_codecs.encode(self.value_codec, values, group, self.scale_groups)
        scale_out, index_out, value_out, pad = self._regions(payload)
        if scales is not None:
            scale_out.copy_(value_codecs.scales_to_bytes(scales))
        index_out.copy_(index_codecs.encode(self.index_codec, indices, geometry))
        value_out.copy_(value_region)
        pad.zero_()
        decoded = value_codecs.decode(self.value_codec, scales, value_region, group)
        if residual is not None:
            residual_after_sending(residual, acc, indices, decoded, keep_unusable=True)
        return indices, decoded

    # ----- decode -----------------------------------------------------------------------

    def decode(self, payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(bucket-relative indices int64, values) of one payload, in payload order."""
        geometry = self.geometry
        scale_region, index_region, value_region, _ = self._regions(payload)
        scales = value_codecs.scales_from_bytes(scale_region, self.scale_groups) if self.scale_bytes else None
        return (index_codecs.decode(self.index_codec, index_region, geometry),
                value_codecs.decode(self.value_codec, scales, value_region, self.group_of_entry(payload.device)))

    def views(self, gathered: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(int32 indices, values), each [rows, capacity], of the payloads of ``gathered``
        (:func:`payload_rows`): decoded copies, in the form the scatter-add (``unpack_add``) takes."""
        payloads = payload_rows(gathered, self)
        if payloads is None:
            raise ValueError(f"gathered must be uint8 payloads of {self.nbytes} bytes, back to back or one per row, "
                             f"got {gathered.dtype} {tuple(gathered.shape)} (strides {gathered.stride()})")
        rows = [self.decode(row) for row in payloads]
        return torch.stack([r[0] for r in rows]).to(torch.int32), torch.stack([r[1] for r in rows])

    def values_copy(self, payload: torch.Tensor) -> torch.Tensor:
        """The decoded values of one payload (what receivers add), in payload order."""
        return self.decode(payload)[1]

    def value_byte_offset(self, position: int) -> int:
        """The payload byte holding the first bit of the ``position``-th value's code."""
        if not 0 <= position < self.capacity:
            raise IndexError(f"payload position {position} outside a payload of capacity {self.capacity}")
        return self.scale_bytes + self.index_bytes + position * value_codecs.value_bits(self.value_codec) // 8


def payload_rows(gathered: torch.Tensor, layout) -> torch.Tensor | None:
    """The payloads of ``gathered`` as a [rows, layout.nbytes] view: back to back (1-D), or
    one per row of a 2-D tensor whose rows may lie farther apart (payloads sealed for the
    wire, each followed by its checksum: ``compress.payload_seal``); None if it is neither."""
    nbytes = layout.nbytes
    if gathered.dim() == 1 and gathered.is_contiguous() and gathered.numel() % nbytes == 0:
        return gathered.view(-1, nbytes)
    if (gathered.dim() == 2 and gathered.shape[1] == nbytes and gathered.stride(1) == 1
            and (gathered.shape[0] <= 1 or gathered.stride(0) >= nbytes)):
        return gathered
    return None


def exact_topk_layout(layout) -> bool:
    """Whether ``layout`` (a ChunkLayout) is one of exact top-k on the compact wire."""
    return bool(getattr(layout, "scale_group", 0)) and layout.chunk_size == layout.numel


def check_exact_topk_layout(op: str, layout) -> None:
    """Raise ValueError unless ``layout`` is one of exact top-k on the compact wire."""
    if not exact_topk_layout(layout):
        raise ValueError(f"{op}: the layout must be one chunk of the whole bucket with a scale_group > 0 "
                         f"(exact top-k on the compact wire), got chunk_size={layout.chunk_size} for "
                         f"{layout.numel} entries, scale_group={getattr(layout, 'scale_group', 0)}")
