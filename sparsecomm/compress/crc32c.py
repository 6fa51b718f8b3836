"""CRC-32C (Castagnoli) of byte rows, in pure torch: the twin of the native ``crc32c`` kernel.

The checksum the hook seals every payload with (:mod:`sparsecomm.compress.payload_seal`).
CRC-32C is the iSCSI / ext4 / SSE4.2 CRC: reflected polynomial 0x82F63B78, initial value
and final XOR 0xFFFFFFFF (RFC 3720, B.4: the 9 bytes "123456789" give 0xE3069283). It
catches every error of up to 3 bits in a message shorter than 2^28 bytes (Koopman's tables
for this polynomial) and every burst of up to 32 bits; other corruptions get through with
probability about 2^-32.

Torch has no sequential byte loop worth running, so the twin uses the CRC's linearity over
GF(2). With the register starting at 0, leading zero bytes change nothing, so every row is
padded in front to a power of two of 4-byte words. ``Z_L``, the effect of appending L zero
bytes to a register, is a 32 x 32 bit matrix, applied as two tables of 65536 entries (one
per half of the register). A word's own CRC is Z_4 of the word (all words at once); then
neighbours merge level by level, ``crc(A || B) = Z_|B|(crc(A)) ^ crc(B)``. The standard
initial value comes back at the end as ``Z_n(0xFFFFFFFF)`` for the row's true length n. Six
tensor operations per level, the same on every (little-endian) device: the oracle of the
kernels' tests and the path GPUs take.
"""
import functools

import torch

POLYNOMIAL = 0x82F63B78  # x^32 + ... of Castagnoli, bit-reversed (LSB-first registers)
MASK = 0xFFFFFFFF


@functools.cache
def _byte_table() -> tuple[int, ...]:
    """The register after shifting one byte b through a zero register: the classic table."""
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (POLYNOMIAL if crc & 1 else 0)
        table.append(crc)
    return tuple(table)


def _append_zero_byte(crc: int) -> int:
    return (crc >> 8) ^ _byte_table()[crc & 0xFF]


@functools.cache
def _zeros_columns(log2_bytes: int) -> tuple[int, ...]:
    """The columns of Z_L for L = 2^log2_bytes: the images of the 32 single-bit registers."""
    if log2_bytes == 0:
        return tuple(_append_zero_byte(1 << bit) for bit in range(32))
    half = _zeros_columns(log2_bytes - 1)
    return tuple(_apply(half, column) for column in half)  # Z_2L = Z_L after Z_L


def _apply(columns: tuple[int, ...], crc: int) -> int:
    out = 0
    for bit in range(32):
        if crc >> bit & 1:
            out ^= columns[bit]
    return out


def append_zeros(crc: int, length: int) -> int:
    """The register ``crc`` after ``length`` zero bytes (a raw register, no initial/final XOR)."""
    bit = 0
    while length:
        if length & 1:
            crc = _apply(_zeros_columns(bit), crc)
        length >>= 1
        bit += 1
    return crc


@functools.cache
def _zeros_tables(log2_bytes: int, device: torch.device) -> torch.Tensor:
    """int64 [2, 65536]: Z_L of every low and of every high half of a register (L = 2^log2_bytes)."""
    columns = torch.tensor(_zeros_columns(log2_bytes), dtype=torch.int64, device=device)
    halves = torch.arange(65536, dtype=torch.int64, device=device)
    tables = torch.zeros(2, 65536, dtype=torch.int64, device=device)
    for bit in range(16):
        chosen = (halves >> bit) & 1
        tables[0] ^= chosen * columns[bit]
        tables[1] ^= chosen * columns[16 + bit]
    return tables


def _through_zeros(log2_bytes: int, crc: torch.Tensor) -> torch.Tensor:
    """Z_L(crc) for every register of ``crc`` (int64 values in [0, 2^32)): two table lookups."""
    tables = _zeros_tables(log2_bytes, crc.device)
    flat = crc.reshape(-1)
    low = tables[0].index_select(0, flat & 0xFFFF)  # index_select: the fastest gather of a table on CPU
    return (low ^ tables[1].index_select(0, flat >> 16)).view(crc.shape)


def crc32c(data: torch.Tensor) -> torch.Tensor:
    """CRC-32C of ``data`` (uint8): a 1-D message, or every row of a 2-D tensor (rows may be
    strided, e.g. payloads of a gathered buffer without their trailers). Returns int64 values
    in [0, 2^32): 0-d for a 1-D message, [rows] for 2-D. Same result on every device."""
    if data.dtype != torch.uint8 or data.dim() not in (1, 2):
        raise ValueError(f"crc32c: data must be a 1-D or 2-D uint8 tensor, got {data.dtype} {tuple(data.shape)}")
    rows = data.reshape(1, -1) if data.dim() == 1 else data
    count, length = rows.shape
    words = 1 << max(0, (length + 3) // 4 - 1).bit_length()  # a power of two holding the row
    padded = torch.zeros(count, 4 * words, dtype=torch.uint8, device=data.device)
    padded[:, 4 * words - length :] = rows  # leading zeros: a zero register stays zero
    # Little-endian 32-bit words, as int64 in [0, 2^32). A word through a zero register is the
    # register holding the word, then 4 zero bytes: Z_4.
    crc = _through_zeros(2, padded.view(torch.int32).to(torch.int64) & MASK)
    log2_block = 2  # each entry of crc covers 2^2 bytes
    while crc.shape[1] > 1:
        pairs = crc.view(count, crc.shape[1] // 2, 2)
        crc = _through_zeros(log2_block, pairs[..., 0]) ^ pairs[..., 1]
        log2_block += 1
    # The standard register starts at 0xFFFFFFFF: by linearity its effect is Z_n(0xFFFFFFFF).
    crc = (crc[:, 0] ^ append_zeros(MASK, length)) ^ MASK
    return crc.reshape(()) if data.dim() == 1 else crc
