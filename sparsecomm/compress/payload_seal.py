"""A payload sealed for the wire: its bytes, a status word and a CRC-32C of both.

::

    [ payload: nbytes | status: uint32 LE | CRC-32C of payload and status: uint32 LE ]

The sender seals a payload right after encoding it, so the checksum covers what the encoder
wrote; a receiver checks it before decoding anything (``hooks/pipeline/integrity.py``).
Whatever changes the bytes in between (a bit flip in the sender's or the receiver's memory,
a faulty link or transport) makes the check fail, except with probability 2^-32. The
status is 0, except in an owner's reply (``exchange="owner"``), where it reports that a
message the owner received failed its check (1 + the lowest sender rank), so every rank
learns of a corruption only the owner saw. The trailer is 8 bytes, so sealed payloads of a
multiple of 8 bytes stay 8-byte aligned back to back. Bytes are read and written one by one:
no alignment needed, the same on every device.
"""
import torch

from sparsecomm.ops import dispatch

TRAILER_BYTES = 8
STATUS_OK = 0


def sealed_nbytes(nbytes: int) -> int:
    """Bytes of a sealed payload of ``nbytes`` payload bytes."""
    return nbytes + TRAILER_BYTES


def seal(sealed: torch.Tensor, status: int = STATUS_OK) -> None:
    """Write the trailer of ``sealed`` (uint8, the payload's bytes then the trailer's 8):
    ``status``, then the CRC-32C of everything before the CRC. No host synchronisation."""
    sealed[-TRAILER_BYTES:-4] = torch.tensor(list(status.to_bytes(4, "little")), dtype=torch.uint8,
                                             device=sealed.device)
    sealed[-4:] = _le32(dispatch.crc32c(sealed[:-4]))


def check(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(intact, status) of every sealed payload of ``rows`` (uint8 [rows, sealed bytes]; rows
    may be strided): bool [rows], True where the CRC-32C matches, and the status words
    (int64 [rows]; read them only where intact)."""
    intact = dispatch.crc32c(rows[:, :-4]) == _read_le32(rows[:, -4:])
    return intact, _read_le32(rows[:, -TRAILER_BYTES:-4])


def _le32(value: torch.Tensor) -> torch.Tensor:
    """The 4 little-endian bytes of a 0-d int64 in [0, 2^32)."""
    shifts = torch.arange(0, 32, 8, device=value.device)
    return ((value >> shifts) & 0xFF).to(torch.uint8)


def _read_le32(fields: torch.Tensor) -> torch.Tensor:
    """int64 [rows] of the little-endian uint32 in each row of ``fields`` (uint8 [rows, 4])."""
    shifts = torch.arange(0, 32, 8, device=fields.device)
    return (fields.to(torch.int64) << shifts).sum(dim=1)
