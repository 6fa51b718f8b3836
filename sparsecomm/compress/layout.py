"""The one definition of a sparse payload's byte layout: hook, kernels and monitors read it here.

A payload of capacity ``k`` with values of dtype ``V`` is one uint8 buffer::

    [ k x int32 index | k x V value | pad to a multiple of 8 bytes ]

Indices come first so both regions start on an aligned offset (4k is a multiple of every
value size), and the pad makes every payload of an all-gathered buffer (rank r starts at
r x nbytes) aligned too. A selection of m < k entries is padded with (index 0, value 0):
adding zero is harmless, and the fixed size lets every rank use one fixed-size all-gather.
A variable-size payload (MPI transport, sampled selector) is the same layout with k = m.
"""
import dataclasses

import torch

INDEX_DTYPE = torch.int32
INDEX_BYTES = 4
ALIGNMENT = 8


@dataclasses.dataclass(frozen=True)
class PayloadLayout:
    """Where the indices and values of one payload (or of each row of a gathered buffer) lie."""

    capacity: int  # k: entries the payload holds
    value_dtype: torch.dtype

    @property
    def index_bytes(self) -> int:
        return INDEX_BYTES * self.capacity

    @property
    def value_bytes(self) -> int:
        return self.capacity * self.value_dtype.itemsize

    @property
    def bytes_per_entry(self) -> int:
        """Index and value bytes of one entry (the pad aside: it is under 8 bytes a payload)."""
        return INDEX_BYTES + self.value_dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of one payload, padded to a multiple of 8."""
        return -(-(self.index_bytes + self.value_bytes) // ALIGNMENT) * ALIGNMENT

    def rows(self, buffer: torch.Tensor) -> torch.Tensor:
        """``buffer`` (one payload, or world_size of them back to back) as [rows, nbytes]."""
        return buffer.view(-1, self.nbytes)

    def views(self, buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(int32 indices, values) views, each [rows, capacity] (strided into ``buffer``)."""
        rows = self.rows(buffer)
        indices = rows[:, : self.index_bytes].view(INDEX_DTYPE)
        values = rows[:, self.index_bytes : self.index_bytes + self.value_bytes].view(self.value_dtype)
        return indices, values

    def payload_views(self, payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices, values) of a single payload, each 1-D of ``capacity``."""
        indices, values = self.views(payload)
        return indices[0], values[0]

    def padding(self, payload: torch.Tensor) -> torch.Tensor:
        """The alignment pad of a single payload (kept zero, so equal selections give equal bytes)."""
        return payload[self.index_bytes + self.value_bytes : self.nbytes]

    def value_byte_offset(self, position: int) -> int:
        """Byte offset in the payload of the ``position``-th value (little-endian)."""
        if not 0 <= position < self.capacity:
            raise IndexError(f"payload position {position} outside a payload of capacity {self.capacity}")
        return self.index_bytes + position * self.value_dtype.itemsize

    def values_copy(self, payload: torch.Tensor) -> torch.Tensor:
        """The value region of a single payload as a tensor of ``value_dtype`` (a copy, aligned)."""
        raw = payload[self.index_bytes : self.index_bytes + self.value_bytes]
        return raw.clone().view(self.value_dtype)

    @classmethod
    def inferred(cls, payload: torch.Tensor, selected: int, value_dtype: torch.dtype) -> "PayloadLayout":
        """The layout of a payload of known size holding at least ``selected`` entries: the
        smallest capacity whose payload has that size (for payloads seen without their layout)."""
        layout = cls(selected, value_dtype)
        while layout.nbytes < payload.numel():
            layout = cls(layout.capacity + 1, value_dtype)
        if layout.nbytes != payload.numel():
            raise ValueError(f"a payload of {payload.numel()} bytes does not hold {selected} or more {value_dtype} "
                             "values")
        return layout
