"""``crc32c``: the CRC-32C (Castagnoli) that seals payloads on the wire, every implementation
(the pure-torch twin, which GPUs run, and the native CPU kernel at every CPU level) against
published check values and against a CRC computed here bit by bit; and the seal and its check
(sparsecomm/compress/payload_seal.py) on top of each."""
import random

import pytest
import torch
from kernel_implementations import REFERENCE, CpuLevelTests, LevelCase, implementations

from sparsecomm.compress import payload_seal

OP = "crc32c"
pytestmark = pytest.mark.timeout(120)

# RFC 3720 (iSCSI), appendix B.4, and the CRC catalogue's check value of CRC-32/ISCSI.
PUBLISHED = [
    (b"123456789", 0xE3069283),
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
]


def bitwise_crc32c(data: bytes) -> int:
    """CRC-32C straight from its definition: LSB-first, polynomial 0x82F63B78, no tables."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def _bytes(data: bytes) -> torch.Tensor:
    return torch.tensor(list(data), dtype=torch.uint8)


def test_the_oracle_gives_the_published_check_values():
    for data, crc in PUBLISHED:
        assert bitwise_crc32c(data) == crc


@pytest.mark.parametrize("impl", implementations(OP, "reference", "cpu"))
def test_published_check_values(impl):
    for data, crc in PUBLISHED:
        got = impl.ops.crc32c(_bytes(data))
        assert got.dtype == torch.int64 and got.dim() == 0 and int(got) == crc, data


@pytest.mark.parametrize("impl", implementations(OP, "reference", "cpu"))
def test_every_length_and_strided_rows_match_the_bitwise_crc(impl):
    rng = random.Random(7)
    # Lengths around the word, the 8-byte step and the native kernel's 3 x 512-byte blocks.
    for n in [*range(0, 20), 511, 512, 1535, 1536, 1537, 3 * 1536 + 13]:
        data = bytes(rng.randrange(256) for _ in range(n))
        assert int(impl.ops.crc32c(_bytes(data))) == bitwise_crc32c(data), n
    # Rows of a larger buffer (a gathered buffer's payloads without their trailers), odd start.
    buffer = torch.randint(0, 256, (5, 1700), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    rows = buffer[:, 3:1603]
    got = impl.ops.crc32c(rows)
    assert got.shape == (5,) and got.tolist() == [bitwise_crc32c(bytes(row.tolist())) for row in rows]
    assert impl.ops.crc32c(buffer[:0, :10]).shape == (0,)


@pytest.mark.parametrize("impl", implementations(OP, "cpu"))
def test_matches_the_twin_on_long_rows(impl):
    data = torch.randint(0, 256, (3, 200_003), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    assert torch.equal(impl.ops.crc32c(data), REFERENCE.ops.crc32c(data))
    assert torch.equal(impl.ops.crc32c(data[1]), REFERENCE.ops.crc32c(data[1]))


@pytest.mark.parametrize("impl", implementations(OP, "cpu"))
def test_the_kernel_refuses_what_it_cannot_read(impl):
    with pytest.raises(RuntimeError, match="1-D or 2-D uint8"):
        impl.ops.crc32c(torch.zeros(8))
    with pytest.raises(RuntimeError, match="1-D or 2-D uint8"):
        impl.ops.crc32c(torch.zeros(2, 2, 2, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="each row of data must be contiguous"):
        impl.ops.crc32c(torch.zeros(4, 4, dtype=torch.uint8).t())
    torch.library.opcheck(torch.ops.sparsecomm.crc32c.default, (torch.zeros(3, 17, dtype=torch.uint8),))


# The host path (CPU tensors, through numpy) and the device path (tensor operations: what GPUs
# run), both exercised here on CPU tensors, each with every implementation's CRC.
SEALS = [(payload_seal.seal_on_host, payload_seal.check_on_host),
         (payload_seal.seal_on_device, payload_seal.check_on_device)]


@pytest.mark.parametrize("impl", implementations(OP, "reference", "cpu"))
@pytest.mark.parametrize("seal,check", SEALS, ids=["host", "device"])
def test_seal_then_check_and_every_single_bit_flip_is_caught(impl, seal, check):
    crc32c = impl.ops.crc32c
    payload = torch.randint(0, 256, (41,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    sealed = torch.empty(payload_seal.sealed_nbytes(41), dtype=torch.uint8)  # odd: no alignment assumed
    sealed[:41] = payload
    seal(sealed, 5, crc32c)
    # The trailer, written by hand: status 5 and the CRC of payload + status, little-endian.
    status = (5).to_bytes(4, "little")
    crc = bitwise_crc32c(bytes(payload.tolist()) + status).to_bytes(4, "little")
    assert bytes(sealed[41:].tolist()) == status + crc
    intact, statuses = check(sealed.view(1, -1), crc32c)
    assert intact == [True] and statuses == [5]
    flipped = sealed.repeat(sealed.numel() * 8, 1)  # one row per bit of the sealed payload
    for bit in range(sealed.numel() * 8):
        flipped[bit, bit // 8] ^= 1 << (bit % 8)
    intact, _ = check(flipped, crc32c)
    assert not any(intact)
    # Rows of a gathered buffer: strided views, each checked on its own.
    both = torch.stack([sealed, flipped[3]])
    rows = torch.cat([both, torch.zeros(2, 3, dtype=torch.uint8)], dim=1)[:, : sealed.numel()]
    assert check(rows, crc32c)[0] == [True, False]


# --------------------------------------------------------------------------- every CPU level


def _crc32c_case(rows, n, seed):
    data = torch.randint(0, 256, (rows, n + 11), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    data = data[:, 3 : 3 + n]  # strided rows, unaligned: the 8-byte loads' head and tail

    def run(impl_ops):
        return [impl_ops.crc32c(data), impl_ops.crc32c(data[0])]
    return run


def cpu_level_cases() -> dict[str, LevelCase]:
    """Empty rows, short ones, lengths around the kernel's 3 x 1536-byte blocks, long ones."""
    return {f"crc32c rows={rows} n={n}": LevelCase(_crc32c_case(rows, n, seed=n))
            for rows, n in ((1, 0), (3, 7), (2, 1537), (4, 3 * 1536 + 13), (2, 100_003))}


class TestEveryCpuLevel(CpuLevelTests):
    cases = cpu_level_cases
