"""Loading the native kernels (``sparsecomm._C``) and saying so when they are missing.

The extension registers its operators under ``torch.ops.sparsecomm`` (schema in
``csrc/sparsecomm_ops.cpp``, semantics in ``csrc/README.md``). This module imports it
once, registers fake kernels (for ``torch.compile`` and ``opcheck``), and reports which
device types have native kernels. If it cannot be imported, the first use of a kernel
warns once with the reason and the pure-torch reference runs instead: never silently.
"""
import functools
import os
import warnings

import torch

from sparsecomm.ops import reference

OPS = ("ef_topk_pack", "ef_threshold_pack", "unpack_add", "chunk_encode", "chunk_decode_add", "exact_topk_encode",
       "exact_topk_decode_add", "crc32c")
# The ops of exact top-k on the compact wire run the chunk operators (a layout with a
# scale_group: csrc/cpu/compact_encode.cpp, compact_decode_add.cpp), on CPU only: the CUDA
# kernels take one scale per chunk.
_EXACT_TOPK_OPERATORS = {"exact_topk_encode": "chunk_encode", "exact_topk_decode_add": "chunk_decode_add"}
KERNELS_ENV = "SPARSECOMM_KERNELS"
KERNEL_CHOICES = ("auto", "native", "triton", "reference")
CPU_CAPABILITY_ENV = "SPARSECOMM_CPU_CAPABILITY"


class NativeKernelsUnavailableWarning(UserWarning):
    """The C++/CUDA extension could not be loaded; the slow reference path runs."""


def requested_kernels() -> str:
    """``SPARSECOMM_KERNELS``: auto (default), native, triton or reference."""
    choice = os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto"
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"{KERNELS_ENV} must be one of {KERNEL_CHOICES}, got {choice!r}")
    return choice


@functools.cache
def load() -> tuple[bool, str]:
    """Import the extension once: (loaded, reason if not)."""
    try:
        import sparsecomm._C  # noqa: F401  (registers torch.ops.sparsecomm.*)
    except ImportError as error:
        return False, (f"sparsecomm._C could not be imported ({error}); build it with "
                       "`pip install --no-build-isolation -e .` (see csrc/README.md)")
    _check_codec_ids()
    _register_fakes()
    return True, ""


def _check_codec_ids() -> None:
    """The chunk ops take codecs by id, a position in the Python tables that the C++ enums
    (csrc/cpu/chunk_format.h) repeat: a codec added or moved on one side only would code
    every payload with the wrong codec. Raises RuntimeError naming both lists if they differ."""
    from sparsecomm.compress.index_codecs import INDEX_CODECS
    from sparsecomm.compress.value_codecs import VALUE_CODECS

    index_names, value_names = torch.ops.sparsecomm.chunk_codecs()
    for what, python, native_names in (("index", INDEX_CODECS, index_names), ("value", VALUE_CODECS, value_names)):
        if tuple(native_names) != tuple(python):
            raise RuntimeError(
                f"sparsecomm._C was built with the {what} codecs {tuple(native_names)} (ids by position), but "
                f"sparsecomm.compress has {tuple(python)}: rebuild the extension "
                f"(`pip install --no-build-isolation -e .`) or make csrc/cpu/chunk_format.h match")


@functools.cache
def warn_unavailable(reason: str) -> None:
    """Warn once per distinct reason."""
    warnings.warn(
        f"sparsecomm: native kernels unavailable: {reason}. Using the pure-torch reference path "
        f"(slow on CPU: torch.topk). Set {KERNELS_ENV}=reference to choose it explicitly.",
        NativeKernelsUnavailableWarning,
        stacklevel=3,
    )


def has_kernel(op: str, dispatch_key: str) -> bool:
    """Whether the loaded extension implements ``op`` (one of :data:`OPS`) for ``dispatch_key`` (CPU, CUDA)."""
    if op in _EXACT_TOPK_OPERATORS:
        return dispatch_key == "CPU" and has_kernel(_EXACT_TOPK_OPERATORS[op], dispatch_key)
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"sparsecomm::{op}", dispatch_key)


def _register_fakes() -> None:
    """Shape-only kernels, so the ops trace under torch.compile and pass opcheck."""
    @torch.library.register_fake("sparsecomm::ef_topk_pack")
    def _(grad, residual, divisor, add_residual, k, indices_out, values_out, index_offset):
        return None

    @torch.library.register_fake("sparsecomm::ef_threshold_pack")
    def _(grad, residual, divisor, add_residual, threshold, indices_out, values_out, index_offset):
        return grad.new_empty((), dtype=torch.int64)

    @torch.library.register_fake("sparsecomm::unpack_add")
    def _(indices, values, out, zero_out):
        return None

    @torch.library.register_fake("sparsecomm::chunk_encode")
    def _(grad, residual, divisor, add_residual, chunk_size, k_full, k_last, index_codec, value_codec, scale_group,
          payload):
        chunks = -(-grad.numel() // chunk_size)
        selected = (chunks - 1) * k_full + k_last
        return (grad.new_empty((selected,), dtype=torch.int64),
                grad.new_empty((selected,), dtype=_DECODED_DTYPES.get(value_codec, torch.float32)))

    @torch.library.register_fake("sparsecomm::chunk_decode_add")
    def _(gathered, chunk_size, k_full, k_last, index_codec, value_codec, scale_group, out, zero_out):
        return None

    @torch.library.register_fake("sparsecomm::crc32c")
    def _(data):
        return data.new_empty(data.shape[:-1], dtype=torch.int64)


# Codec ids of the chunk ops: positions in INDEX_CODECS and VALUE_CODECS (csrc/README.md).
_DECODED_DTYPES = {1: torch.bfloat16, 2: torch.float16}  # value codec id -> decoded dtype (else float32)


def _codec_ids(layout) -> tuple[int, int]:
    from sparsecomm.compress import index_codecs, value_codecs

    return index_codecs.INDEX_CODECS.index(layout.index_codec), value_codecs.VALUE_CODECS.index(layout.value_codec)


def _chunk_geometry(layout) -> tuple[int, int, int, int, int, int]:
    """(chunk_size, k_full, k_last, index codec id, value codec id, scale_group) of a ChunkLayout."""
    geometry = layout.geometry
    return (layout.chunk_size, geometry.k_full, geometry.k_last, *_codec_ids(layout), layout.scale_group)


def _ops():
    loaded, reason = load()
    if not loaded:
        raise RuntimeError(reason)
    return torch.ops.sparsecomm


# Typed wrappers with the reference's signatures (sparsecomm/ops/reference.py).

def ef_topk_pack(grad, residual, divisor, add_residual, k, indices_out, values_out, index_offset=0) -> None:
    """Fused error feedback + exact top-k + packing (two passes over the bucket)."""
    _ops().ef_topk_pack(grad, residual, float(divisor), add_residual, k, indices_out, values_out,
                                      index_offset)


def ef_threshold_pack(grad, residual, divisor, add_residual, threshold, indices_out, values_out, index_offset=0):
    """Fused error feedback + selection by threshold + packing (one pass); returns the count."""
    return _ops().ef_threshold_pack(grad, residual, float(divisor), add_residual, float(threshold),
                                                  indices_out, values_out, index_offset)


def unpack_add(indices, values, out, zero_out=True) -> None:
    """Scatter-add the payload rows into ``out`` in row order."""
    _ops().unpack_add(indices, values, out, zero_out)


def chunk_encode(grad, residual, divisor, add_residual, layout, payload):
    """Fused error feedback + chunked (or, with a scale_group, exact) top-k + codecs into
    ``payload``; (indices int64, decoded)."""
    return _ops().chunk_encode(grad, residual, float(divisor), add_residual, *_chunk_geometry(layout), payload)


def chunk_decode_add(gathered, layout, out, zero_out=True) -> None:
    """Decode the payloads of ``gathered`` (back to back, or one per row) and add them into ``out`` in row order."""
    _ops().chunk_decode_add(gathered, *_chunk_geometry(layout), out, zero_out)


def exact_topk_encode(grad, residual, divisor, add_residual, layout, payload):
    """Fused error feedback + exact top-k of the whole bucket + codecs into ``payload``, a scale
    per scale group (exact top-k on the compact wire); (indices int64, decoded)."""
    reference.check_exact_topk_layout("exact_topk_encode", layout)
    return chunk_encode(grad, residual, divisor, add_residual, layout, payload)


def exact_topk_decode_add(gathered, layout, out, zero_out=True) -> None:
    """Decode the payloads of exact top-k on the compact wire in ``gathered`` and add them into ``out`` in row order."""
    reference.check_exact_topk_layout("exact_topk_decode_add", layout)
    chunk_decode_add(gathered, layout, out, zero_out)


def crc32c(data):
    """CRC-32C of a 1-D uint8 message (0-d int64) or of every row of a 2-D one (int64 [rows])."""
    return _ops().crc32c(data)


# The CPU kernels' instruction-set level (csrc/README.md, "CPU levels").

def cpu_capability() -> str:
    """The level the CPU kernels run at in this process: "default", "avx2" or "avx512".

    Chosen once per process: the widest compiled level this CPU supports, or the one
    ``SPARSECOMM_CPU_CAPABILITY`` names. Raises RuntimeError when the extension is missing or
    the variable names a level this build or this CPU lacks (as every CPU kernel call then does).
    """
    return _ops().cpu_capability()


def compiled_cpu_levels() -> tuple[str, ...]:
    """The CPU levels the extension was built with, lowest first."""
    return tuple(_ops().cpu_levels()[0])


def supported_cpu_levels() -> tuple[str, ...]:
    """The compiled CPU levels this CPU supports, lowest first: what ``SPARSECOMM_CPU_CAPABILITY`` may name."""
    return tuple(_ops().cpu_levels()[1])
