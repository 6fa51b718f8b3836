"""A payload sealed for the wire: its bytes, a status word and a CRC-32C of both.

::

    [ payload: nbytes | status: uint32 LE | CRC-32C of payload and status: uint32 LE ]

The sender seals a payload right after encoding it, so the checksum covers what the encoder
wrote; a receiver checks it before decoding anything (``hooks/wires/integrity.py``).
Whatever changes the bytes in between (a bit flip in the sender's or the receiver's memory,
a faulty link or transport) makes the check fail, except with probability 2^-32. The
status is 0, except in an owner's reply (``exchange="owner"``), where it reports that a
message the owner received failed its check (1 + the lowest sender rank), so every rank
learns of a corruption only the owner saw. The trailer is 8 bytes, so sealed payloads of a
multiple of 8 bytes stay 8-byte aligned back to back. The trailer is read and written as
bytes (no alignment needed): through numpy on CPU, with tensor operations on other devices.

The CRC-32C itself is the caller's to hand in (``crc32c``: uint8 [n] -> a 0-d int64, or uint8
[rows, n] -> int64 [rows]; the dispatched kernel, ``sparsecomm.ops.dispatch.crc32c``), so the
format sits below the kernels and never imports them.
"""
import struct

import numpy as np
import torch

TRAILER_BYTES = 8
STATUS_OK = 0


def sealed_nbytes(nbytes: int) -> int:
    """Bytes of a sealed payload of ``nbytes`` payload bytes."""
    return nbytes + TRAILER_BYTES


def seal(sealed: torch.Tensor, crc32c, status: int = STATUS_OK) -> None:
    """Write the trailer of ``sealed`` (uint8, the payload's bytes then the trailer's 8):
    ``status``, then the CRC-32C of everything before the CRC."""
    (seal_on_host if sealed.device.type == "cpu" else seal_on_device)(sealed, status, crc32c)


def check(rows: torch.Tensor, crc32c) -> tuple[list[bool], list[int]]:
    """(intact, status) of every sealed payload of ``rows`` (uint8 [rows, sealed bytes]; rows
    may be strided): True where the CRC-32C matches, and the status words (read them only
    where intact). On a GPU, one synchronisation."""
    return (check_on_host if rows.device.type == "cpu" else check_on_device)(rows, crc32c)


# CPU tensors: the trailer through numpy views, a few microseconds instead of a dozen tensor
# operations. Other devices: tensor operations, the seal with no host synchronisation.

def seal_on_host(sealed: torch.Tensor, status: int, crc32c) -> None:
    trailer = sealed[-TRAILER_BYTES:].numpy()
    struct.pack_into("<I", trailer, 0, status)
    struct.pack_into("<I", trailer, 4, int(crc32c(sealed[:-4])))


def seal_on_device(sealed: torch.Tensor, status: int, crc32c) -> None:
    sealed[-TRAILER_BYTES:-4] = torch.tensor(list(status.to_bytes(4, "little")), dtype=torch.uint8,
                                             device=sealed.device)
    sealed[-4:] = _le32(crc32c(sealed[:-4]))


def check_on_host(rows: torch.Tensor, crc32c) -> tuple[list[bool], list[int]]:
    crc = crc32c(rows[:, :-4]).numpy()
    words = np.ascontiguousarray(rows[:, -TRAILER_BYTES:].numpy()).view("<u4")  # [rows, (status, crc)]
    return (words[:, 1] == crc).tolist(), words[:, 0].tolist()


def check_on_device(rows: torch.Tensor, crc32c) -> tuple[list[bool], list[int]]:
    intact = crc32c(rows[:, :-4]) == _read_le32(rows[:, -4:])
    return intact.tolist(), _read_le32(rows[:, -TRAILER_BYTES:-4]).tolist()


def _le32(value: torch.Tensor) -> torch.Tensor:
    """The 4 little-endian bytes of a 0-d int64 in [0, 2^32)."""
    shifts = torch.arange(0, 32, 8, device=value.device)
    return ((value >> shifts) & 0xFF).to(torch.uint8)


def _read_le32(fields: torch.Tensor) -> torch.Tensor:
    """int64 [rows] of the little-endian uint32 in each row of ``fields`` (uint8 [rows, 4])."""
    shifts = torch.arange(0, 32, 8, device=fields.device)
    return (fields.to(torch.int64) << shifts).sum(dim=1)
