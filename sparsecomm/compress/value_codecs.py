"""How the values of a chunked selection are written: the value codecs.

Each chunk's values share what a codec needs (a scale), so a codec is a pair of
functions over one bucket's selection, chunk by chunk: ``encode`` -> (scales, codes) and
``decode`` -> the values every receiver adds. Error feedback keeps ``acc - decoded`` in
the residual, so quantization error is compensated like the entries left unsent.

Codecs (bits per value; ``s`` is the chunk's scale, stored as bfloat16, 2 bytes a chunk):

* ``fp32``, ``bf16``, ``fp16``: the value in that dtype, saturated beyond its range
  (``error_feedback.to_wire_dtype``: fp16 at 65504 or less); no scale.
* ``fp8``: float8 e4m3 of ``v / s``, ``s`` = the chunk's largest magnitude / 448 rounded up.
* ``int8``, ``int4``, ``int2``: the nearest of ``q * s``, ``q`` in ``[-(2**(b-1) - 1),
  2**(b-1) - 1]`` (int2: -1, 0, 1), ``s`` = the largest magnitude / 2**(b-1) rounded up;
  the code is ``q + 2**(b-1) - 1``.
* ``sign``: one bit (1 = negative), decoded as +-s, ``s`` = min(2 m, (m + M) / 2) rounded
  down, m and M the smallest non-zero and the largest magnitude of the chunk's selection.

Why conservation (``decoded + residual == acc``, exactly) holds: every decoded value is 0
or lies within a factor of two of the value it stands for, with the same sign, so
``acc - decoded`` is exact in floating point (Sterbenz); a saturated fp16 value is a
multiple of acc's ulp below it, which keeps it exact too. Rounding to the nearest level of a
grid that has 0 guarantees it (fp8, intN); ``sign`` has no 0, hence s <= 2 m; it also
needs s >= M / 2**16 for the largest values (bf16 s has 8 significant bits), which a chunk
whose selected non-zero magnitudes span more than 2**17 cannot have: there s is raised to
M / 2**16 and the smallest entries of that chunk are conserved only to rounding.

Non-finite values: a chunk whose selection holds an Inf or NaN gets the scale NaN (any
NaN) or +Inf, and codes of the values' signs, so every receiver decodes a non-finite
value there (the overflow is seen everywhere); nothing usable is sent for that chunk's
finite entries (they stay in the residual). Scale-free codecs send the Inf/NaN itself.
"""
import torch

from sparsecomm.compress import bitpack
from sparsecomm.compress.error_feedback import to_wire_dtype

FLOAT_CODECS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
INT_CODECS = {"int8": 8, "int4": 4, "int2": 2}
VALUE_CODECS = ("fp32", "bf16", "fp16", "fp8", "int8", "int4", "int2", "sign")
SCALE_BYTES = 2  # bfloat16
FP8_MAX = 448.0


def value_bits(codec: str) -> int:
    if codec in FLOAT_CODECS:
        return FLOAT_CODECS[codec].itemsize * 8
    return {"fp8": 8, "sign": 1}.get(codec) or INT_CODECS[codec]


def has_scale(codec: str) -> bool:
    return codec not in FLOAT_CODECS


def codec_of_dtype(dtype: torch.dtype) -> str:
    return {v: k for k, v in FLOAT_CODECS.items()}[dtype]


# ----- bfloat16 scales, rounded in a stated direction (bit operations: the same everywhere)


def bf16_round_up(x: torch.Tensor) -> torch.Tensor:
    """The smallest bfloat16 >= x (x float32, >= 0, finite), as float32."""
    bits = x.view(torch.int32).to(torch.int64)
    return ((bits + 0xFFFF) & ~0xFFFF).to(torch.int32).view(torch.float32)


def bf16_round_down(x: torch.Tensor) -> torch.Tensor:
    """The largest bfloat16 <= x (x float32, >= 0, finite), as float32."""
    return (x.view(torch.int32) & ~0xFFFF).view(torch.float32)


def scales_to_bytes(scales: torch.Tensor) -> torch.Tensor:
    """float32 scales that are bfloat16 values (or Inf/NaN) -> their bfloat16 bytes."""
    return (scales.contiguous().view(torch.int32) >> 16).to(torch.int16).view(torch.uint8)


def scales_from_bytes(region: torch.Tensor, chunks: int) -> torch.Tensor:
    bits = region[: SCALE_BYTES * chunks].clone().view(torch.int16).to(torch.int32) << 16
    return bits.view(torch.float32)


# ----- per-chunk statistics --------------------------------------------------------------


def _per_chunk(values, chunk, chunks, reduce, fill):
    out = torch.full((chunks,), fill, dtype=values.dtype, device=values.device)
    return out.scatter_reduce_(0, chunk, values, reduce, include_self=True)


def _nonfinite_scale(values, chunk, chunks):
    """Per chunk: NaN if its selection holds a NaN, +Inf if an Inf, else 0 (finite)."""
    has_nan = _per_chunk(torch.isnan(values).float(), chunk, chunks, "amax", 0.0) > 0
    has_inf = _per_chunk(torch.isinf(values).float(), chunk, chunks, "amax", 0.0) > 0
    marker = torch.zeros(chunks, dtype=torch.float32, device=values.device)
    marker[has_inf] = float("inf")
    marker[has_nan] = float("nan")
    return marker, has_nan | has_inf


def chunk_scales(codec: str, values: torch.Tensor, chunk: torch.Tensor, chunks: int) -> torch.Tensor:
    """float32 [chunks]: every chunk's scale (bfloat16 values; NaN/Inf for non-finite chunks)."""
    magnitude = values.float().abs()
    marker, nonfinite = _nonfinite_scale(values, chunk, chunks)
    finite_magnitude = torch.where(torch.isfinite(magnitude), magnitude, 0.0)
    largest = _per_chunk(finite_magnitude, chunk, chunks, "amax", 0.0)
    if codec == "fp8":
        scale = bf16_round_up(largest / FP8_MAX)
    elif codec in INT_CODECS:
        scale = bf16_round_up(largest * 2.0 ** -(INT_CODECS[codec] - 1))  # exact power-of-two step
    else:  # sign
        nonzero = torch.where(finite_magnitude > 0, finite_magnitude, float("inf"))
        smallest = _per_chunk(nonzero, chunk, chunks, "amin", float("inf"))
        smallest = torch.where(torch.isinf(smallest), 0.0, smallest)
        scale = bf16_round_down(torch.minimum(2 * smallest, smallest / 2 + largest / 2))
        scale = torch.maximum(scale, bf16_round_up(largest * 2.0**-16))
    return torch.where(nonfinite, marker, scale)


# ----- encode / decode -------------------------------------------------------------------


def encode(codec: str, values: torch.Tensor, chunk: torch.Tensor, chunks: int):
    """(scales float32 [chunks] or None, value region uint8) for the selected ``values``."""
    if codec in FLOAT_CODECS:
        return None, to_wire_dtype(values, FLOAT_CODECS[codec]).contiguous().view(torch.uint8)
    scales = chunk_scales(codec, values, chunk, chunks)
    return scales, bitpack.pack(_codes(codec, values.float(), scales[chunk]), value_bits(codec))


def _codes(codec: str, v: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    negative = torch.signbit(v) & ~torch.isnan(v)
    if codec == "sign":
        return negative.to(torch.int64)
    finite_scale = torch.isfinite(s)
    if codec == "fp8":
        ratio = torch.where(s > 0, v / s, 0.0).clamp(-FP8_MAX, FP8_MAX)
        ratio = torch.where(finite_scale, ratio, torch.where(negative, -FP8_MAX, FP8_MAX))
        return ratio.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int64)
    qmax = 2 ** (INT_CODECS[codec] - 1) - 1
    q = torch.where(s > 0, torch.round(v / s), 0.0).clamp(-qmax, qmax)
    q = torch.where(finite_scale, q, torch.where(negative, -qmax, qmax).to(q.dtype))
    return q.to(torch.int64) + qmax


def decode(codec: str, scales: torch.Tensor | None, region: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
    """The values receivers add (float32 for scaled codecs, the wire dtype otherwise)."""
    count = chunk.numel()
    if codec in FLOAT_CODECS:
        dtype = FLOAT_CODECS[codec]
        return region[: count * dtype.itemsize].clone().view(dtype)
    codes = bitpack.unpack(region, value_bits(codec), count)
    s = scales[chunk]
    if codec == "sign":
        level = 1.0 - 2.0 * codes.to(torch.float32)
    elif codec == "fp8":
        level = codes.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    else:
        level = (codes - (2 ** (INT_CODECS[codec] - 1) - 1)).to(torch.float32)
    return level * s
