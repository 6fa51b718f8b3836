"""Fixed-width bit fields packed into bytes: the reference for every sub-byte wire region.

A field of ``bits`` bits holds an unsigned integer; fields follow each other without gaps,
least significant bit first (bit i of the stream is bit i % 8 of byte i // 8), so a
region of 8-, 16- or 32-bit fields is the little-endian array of those integers. The last
byte is padded with zero bits.
"""
import torch

_BIT_WEIGHTS = 1 << torch.arange(8, dtype=torch.int64)


def packed_nbytes(count: int, bits: int) -> int:
    """Bytes that ``count`` fields of ``bits`` bits take (rounded up to a whole byte)."""
    return -(-count * bits // 8)


def bits_to_bytes(bits: torch.Tensor) -> torch.Tensor:
    """A stream of 0/1 values (any integer dtype, 1-D) as bytes, LSB first, zero-padded."""
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    grouped = bits.to(torch.int64).view(-1, 8)
    return (grouped * _BIT_WEIGHTS.to(bits.device)).sum(dim=1).to(torch.uint8)


def bytes_to_bits(data: torch.Tensor) -> torch.Tensor:
    """The bits (int64 0/1) of ``data`` (uint8, 1-D), LSB of each byte first."""
    return (data.to(torch.int64).unsqueeze(-1) >> torch.arange(8, device=data.device)).bitwise_and_(1).flatten()


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes`` (non-negative integers < 2**bits, 1-D) as a packed byte stream."""
    if bits in (8, 16, 32):  # whole bytes: the little-endian array itself
        dtype = {8: torch.uint8, 16: torch.int16, 32: torch.int32}[bits]
        wrapped = torch.where(codes >= 2 ** (bits - 1), codes - 2**bits, codes) if bits > 8 else codes
        return wrapped.to(dtype).contiguous().view(torch.uint8)
    fields = (codes.to(torch.int64).unsqueeze(-1) >> torch.arange(bits, device=codes.device)).bitwise_and_(1)
    return bits_to_bytes(fields.flatten())


def unpack(data: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first ``count`` fields of ``bits`` bits in ``data`` (uint8, 1-D), as int64."""
    if bits in (8, 16, 32):
        dtype = {8: torch.uint8, 16: torch.int16, 32: torch.int32}[bits]
        raw = data[: count * bits // 8].clone().view(dtype).to(torch.int64)
        return raw if bits == 8 else raw.bitwise_and_(2**bits - 1)
    stream = bytes_to_bits(data[: packed_nbytes(count, bits)])[: count * bits].view(count, bits)
    return (stream << torch.arange(bits, device=data.device)).sum(dim=1)
