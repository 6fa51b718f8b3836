"""The chunked wire: selection, index codecs, value codecs, payload layout.

Oracles are independent of the code under test: hand-worked bytes, numpy sorting for the
selection, a brute-force table of every float8 e4m3 value, and float64 arithmetic for
conservation (``decoded + residual == acc`` exactly, not merely after rounding).
"""
import math
import struct

import numpy as np
import pytest
import torch

from sparsecomm.compress import bitpack, index_codecs, value_codecs
from sparsecomm.compress.chunk_layout import ChunkLayout
from sparsecomm.compress.chunking import ChunkGeometry, chunk_topk


# ----- bit packing ------------------------------------------------------------------------


def test_bitpack_hand_worked():
    # 2-bit fields 1, 2, 3 LSB first: 0b11_10_01 = 57; 4-bit 3, 10: 0xA3.
    assert bitpack.pack(torch.tensor([1, 2, 3]), 2).tolist() == [57]
    assert bitpack.pack(torch.tensor([3, 10]), 4).tolist() == [0xA3]
    # 12-bit fields 0xABC, 0x123: bytes BC, 3A, 12 (three bytes for two indices).
    assert bitpack.pack(torch.tensor([0xABC, 0x123]), 12).tolist() == [0xBC, 0x3A, 0x12]
    assert bitpack.unpack(torch.tensor([0xBC, 0x3A, 0x12], dtype=torch.uint8), 12, 2).tolist() == [0xABC, 0x123]


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 7, 8, 12, 16, 32])
def test_bitpack_round_trip_and_whole_bytes_are_little_endian(bits):
    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (37,), generator=gen, dtype=torch.int64)
    packed = bitpack.pack(codes, bits)
    assert packed.numel() == math.ceil(37 * bits / 8)
    assert torch.equal(bitpack.unpack(packed, bits, 37), codes)
    if bits in (8, 16, 32):
        expected = np.array(codes.tolist(), dtype={8: "<u1", 16: "<u2", 32: "<u4"}[bits]).tobytes()
        assert bytes(packed.tolist()) == expected


# ----- chunked selection --------------------------------------------------------------------


def _oracle_chunk_topk(acc: np.ndarray, chunk_size: int, density: float) -> list[int]:
    """Per chunk: magnitude order with NaN > Inf > finite, ties to the lower index (numpy)."""
    out = []
    for start in range(0, acc.size, chunk_size):
        part = acc[start : start + chunk_size]
        k = min(part.size, max(1, math.ceil(round(density * part.size, 6))))
        magnitude = np.where(np.isnan(part), np.inf, np.abs(part))
        rank_nan = np.isnan(part).astype(int)
        order = np.lexsort((np.arange(part.size), -magnitude, -rank_nan))
        out += sorted(int(i) + start for i in order[:k])
    return out


@pytest.mark.parametrize("numel,chunk_size,density", [(100, 16, 0.1), (4096, 4096, 0.01), (10000, 4096, 0.01),
                                                      (33, 8, 1.0), (7, 16, 0.3), (1000, 64, 0.05)])
def test_chunk_topk_matches_numpy_oracle(numel, chunk_size, density):
    gen = torch.Generator().manual_seed(numel)
    acc = torch.randn(numel, generator=gen)
    acc[::7] = acc[::7].round()  # ties
    acc[3] = float("nan")
    acc[-1] = float("-inf")
    geometry = ChunkGeometry(numel, chunk_size, density)
    chosen = chunk_topk(acc, geometry)
    assert chosen.tolist() == _oracle_chunk_topk(acc.numpy(), chunk_size, density)
    assert chosen.numel() == geometry.selected


# ----- index codecs -------------------------------------------------------------------------


def test_chunk_index_codec_hand_worked():
    geometry = ChunkGeometry(32, 16, 2 / 16)  # two chunks of 16, 2 entries each, 4-bit local indices
    region = index_codecs.encode("chunk", torch.tensor([3, 10, 16 + 1, 16 + 15]), geometry)
    assert region.tolist() == [0xA3, 0xF1]


def test_rice_codec_hand_worked():
    # A chunk of 16 with 2 entries: the bound 2 (r + 1) + (14 >> r) is 16, 11, 9, 9 for r = 0..3:
    # r = 2, 9 bits. Indices 3, 10 -> gaps 3, 6 -> "0" "11" and "10" "01" (low bits LSB first):
    # stream 0 1 1 1 0 0 1 | pad 0 0 -> bytes 0b01001110, 0b0.
    geometry = ChunkGeometry(16, 16, 2 / 16)
    assert index_codecs.rice_parameter(16, 2) == 2
    region = index_codecs.encode("rice", torch.tensor([3, 10]), geometry)
    assert region.tolist() == [0b01001110, 0]
    assert index_codecs.decode("rice", region, geometry).tolist() == [3, 10]


@pytest.mark.parametrize("codec", index_codecs.INDEX_CODECS)
@pytest.mark.parametrize("numel,chunk_size,density", [(10000, 4096, 0.01), (5000, 256, 0.3), (99, 8, 1.0),
                                                      (4097, 4096, 0.02), (3000, 1000, 0.001)])
def test_index_codecs_round_trip_at_their_stated_size(codec, numel, chunk_size, density):
    geometry = ChunkGeometry(numel, chunk_size, density)
    gen = torch.Generator().manual_seed(numel + chunk_size)
    chosen = chunk_topk(torch.randn(numel, generator=gen), geometry)
    region = index_codecs.encode(codec, chosen, geometry)
    assert region.numel() == index_codecs.index_region_nbytes(codec, geometry)
    assert torch.equal(index_codecs.decode(codec, region, geometry), chosen)


def test_rice_worst_case_selection_fits_its_bound():
    # The gaps sum to L - k only when the selection sits at the end of the chunk: the bound is tight.
    geometry = ChunkGeometry(8192, 4096, 0.01)
    k = geometry.k_full
    worst = torch.cat([torch.arange(4096 - k, 4096), torch.arange(4096, 4096 + k)])
    region = index_codecs.encode("rice", worst, geometry)
    assert torch.equal(index_codecs.decode("rice", region, geometry), worst)


def test_rice_bits_per_entry_near_the_entropy_at_one_percent():
    r = index_codecs.rice_parameter(4096, 41)
    bits = index_codecs.rice_bound(4096, 41, r) / 41
    entropy = (math.lgamma(4097) - math.lgamma(42) - math.lgamma(4056)) / math.log(2) / 41
    assert (r, round(bits, 2), round(entropy, 2)) == (6, 8.54, 7.98)


# ----- value codecs -------------------------------------------------------------------------


def _decode_one_chunk(codec, values):
    values = torch.tensor(values, dtype=torch.float32)
    chunk = torch.zeros(values.numel(), dtype=torch.int64)
    scales, region = value_codecs.encode(codec, values, chunk, 1)
    return scales, region, value_codecs.decode(codec, scales, region, chunk)


def test_int_codecs_hand_worked():
    values = [4.0, -1.0, 0.9, -3.0]
    # int2: s = 4 / 2 = 2; v / s = 2, -0.5, 0.45, -1.5 -> nearest (ties to even), clamped to +-1.
    scales, region, decoded = _decode_one_chunk("int2", values)
    assert scales.tolist() == [2.0] and decoded.tolist() == [2.0, 0.0, 0.0, -2.0]
    assert region.tolist() == [2 | 1 << 2 | 1 << 4 | 0 << 6]  # codes q + 1
    # int4: s = 4 / 8 = 0.5; v / s = 8 (-> 7), -2, 1.8, -6.
    _, _, decoded = _decode_one_chunk("int4", values)
    assert decoded.tolist() == [3.5, -1.0, 1.0, -3.0]


def test_sign_codec_hand_worked():
    # m = 0.9, M = 4: s = min(2 m, (m + M) / 2) = 1.8, rounded down to bfloat16: 1.796875 (0x3FE6).
    scales, region, decoded = _decode_one_chunk("sign", [4.0, -1.0, 0.9, -3.0])
    assert scales.tolist() == [1.796875]
    assert decoded.tolist() == [1.796875, -1.796875, 1.796875, -1.796875]
    assert region.tolist() == [0b1010]


def _e4m3_table() -> np.ndarray:
    """Every finite float8 e4m3fn value by its code (NaN at 0x7F, 0xFF), from the format's definition."""
    table = np.empty(256)
    for code in range(256):
        sign, exponent, mantissa = code >> 7, (code >> 3) & 0xF, code & 7
        if exponent == 0xF and mantissa == 7:
            table[code] = np.nan
        elif exponent == 0:
            table[code] = (-1) ** sign * mantissa / 8 * 2.0**-6
        else:
            table[code] = (-1) ** sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)
    return table


def _bf16_up(x: float) -> float:
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    return struct.unpack("<f", struct.pack("<I", (bits + 0xFFFF) & 0xFFFF0000))[0]


def test_fp8_codec_matches_the_format_table():
    gen = torch.Generator().manual_seed(8)
    values = (torch.randn(64, generator=gen) * 10.0 ** torch.randint(-4, 3, (64,), generator=gen)).float()
    scales, region, decoded = _decode_one_chunk("fp8", values.tolist())
    s = _bf16_up(float(np.float32(np.float32(values.abs().max().item()) / np.float32(448.0))))
    assert scales.tolist() == [s]
    table = _e4m3_table()
    finite = np.where(np.isnan(table), np.inf, table)
    for v, code, d in zip(values.tolist(), region.tolist(), decoded.tolist()):
        ratio = np.float32(np.float32(v) / np.float32(s))
        distance = np.abs(finite - ratio)
        best = np.flatnonzero(distance == distance.min())
        if best.size > 1:  # a tie goes to the even mantissa
            best = best[(best & 1) == 0]
        assert table[code] == table[best[0]], (v, code, best)
        assert d == np.float32(table[code] * s)


@pytest.mark.parametrize("codec", value_codecs.VALUE_CODECS)
def test_every_codec_conserves_exactly(codec):
    """decoded + residual == acc in exact (float64) arithmetic, for gradients spanning 1e-8..1e2,
    zeros and denormal-small values."""
    gen = torch.Generator().manual_seed(len(codec))
    n = 9000
    acc = torch.randn(n, generator=gen) * torch.logspace(-8, 2, n)[torch.randperm(n, generator=gen)]
    acc[:300] = 0.0  # whole zero stretches: zeros get selected
    acc[5000:5010] = 1e-39  # subnormal float32
    layout = ChunkLayout(n, 1024, 0.03, "rice", codec)
    payload = torch.empty(layout.nbytes, dtype=torch.uint8)
    residual = torch.empty_like(acc)
    indices, decoded = layout.encode(acc, residual, payload)
    sent = torch.zeros(n, dtype=torch.float64)
    sent[indices] = decoded.double()
    assert torch.equal(sent + residual.double(), acc.double())
    received_indices, received = layout.decode(payload)
    assert torch.equal(received_indices, indices) and torch.equal(received, decoded)


@pytest.mark.parametrize("codec", ["int4", "fp8", "sign", "bf16"])
def test_nonfinite_chunk_decodes_nonfinite_and_leaves_no_nonfinite_residual(codec):
    acc = torch.linspace(-1, 1, 64)
    acc[5] = float("inf")
    acc[40] = float("nan")
    layout = ChunkLayout(64, 16, 0.25, "chunk", codec)
    residual = torch.empty_like(acc)
    indices, decoded = layout.encode(acc, residual, torch.empty(layout.nbytes, dtype=torch.uint8))
    assert torch.isfinite(residual).all()
    sent = dict(zip(indices.tolist(), decoded.tolist()))
    assert sent[5] == float("inf") and math.isnan(sent[40])
    if value_codecs.has_scale(codec):  # the whole chunk carries the overflow; its finite entries stay behind
        for i, d in sent.items():
            if i < 16:
                assert math.isinf(d)
                if i != 5:
                    assert residual[i] == acc[i]
            elif 32 <= i < 48:
                assert math.isnan(d)
    for i, d in sent.items():  # chunks without a non-finite value are untouched by it
        if 16 <= i < 32 or i >= 48:
            assert math.isfinite(d) and residual[i].item() + d == acc[i].item()
    assert residual[5] == 0 and residual[40] == 0


def test_payload_size_hand_worked():
    # 10000 entries, chunks of 4096 at 1%: 41 + 41 + ceil(0.01 * 1808) = 19 -> 101 entries.
    # 12-bit indices + 2-bit values + three bf16 scales: 6 + 152 + 26 = 184 bytes (a multiple of 8).
    layout = ChunkLayout(10000, 4096, 0.01, "chunk", "int2")
    assert (layout.capacity, layout.scale_bytes, layout.index_bytes, layout.value_bytes, layout.nbytes) == \
        (101, 6, 152, 26, 184)
    assert ChunkLayout(10000, 4096, 0.01, "int32", "fp32").nbytes == 808  # today's 8 bytes per entry
