"""Triton implementations of the sparsecomm operators (semantics: csrc/README.md).

Same Python signatures as :mod:`sparsecomm.ops.reference` (the oracle)::

    ef_topk_pack(grad, residual, divisor, add_residual, k, indices_out, values_out, index_offset=0) -> None
    unpack_add(indices, values, out, zero_out=True) -> None
    chunk_encode(grad, residual, divisor, add_residual, layout, payload) -> (indices int64, decoded values)
    chunk_decode_add(gathered, layout, out, zero_out=True) -> None
    exact_topk_encode(grad, residual, divisor, add_residual, layout, payload) -> (indices int64, decoded values)
    exact_topk_decode_add(gathered, layout, out, zero_out=True) -> None

None of them synchronises with the host: grid sizes follow from the sizes alone, and every
data-dependent quantity (histograms, the k-th key, per-program counts, offsets) lives in small
device tensors read by the next kernel. One file per op, shared radix kernels in
:mod:`sparsecomm.ops.triton.radix`, shared chunk codecs in :mod:`sparsecomm.ops.triton.chunk_codecs`.

The chunk kernels (``selector="chunk"``, :mod:`~sparsecomm.ops.triton.chunk_encode`,
:mod:`~sparsecomm.ops.triton.chunk_decode_add`) take every index codec (int32, chunk, rice),
every value codec and float32/bfloat16/float16 gradients, for layouts with one scale per
chunk (``scale_group == 0``) and chunks of at most 8192 entries (one program per chunk, the
chunk in one block), and for exact top-k on the compact wire (a ``scale_group``, one chunk of
the whole bucket: :mod:`~sparsecomm.ops.triton.exact_topk_encode`, and ``exact_topk_decode_add``
in :mod:`~sparsecomm.ops.triton.chunk_decode_add`); :func:`chunk_unsupported`
says why a layout is not taken, and the dispatch sends those layouts to the reference.

Importing this package never fails: without a usable Triton the op functions raise
ImportError when called, and :func:`available` says why. Kernels run on CUDA tensors, and
on CPU tensors only under ``TRITON_INTERPRET=1`` (read by Triton when this package is first
imported: ``@triton.jit`` picks compiled or interpreted functions at definition time).
"""
import os

__all__ = ["available", "chunk_decode_add", "chunk_encode", "chunk_unsupported", "ef_topk_pack",
           "exact_topk_decode_add", "exact_topk_encode", "unpack_add"]

_IMPORT_ERROR: str | None = None
try:
    import triton  # noqa: F401
    import triton.language  # noqa: F401
except Exception as error:  # ImportError, or a broken install raising something else
    _IMPORT_ERROR = f"triton is not importable ({type(error).__name__}: {error})"

if _IMPORT_ERROR is None:
    try:
        from sparsecomm.ops.triton.ef_topk_pack import ef_topk_pack
        from sparsecomm.ops.triton.radix import interpreting
        from sparsecomm.ops.triton.unpack_add import unpack_add
    except Exception as error:  # e.g. a Triton too old for tl.histogram(mask=...)
        _IMPORT_ERROR = f"the Triton kernels could not be defined ({type(error).__name__}: {error})"

# The chunk kernels separately: a problem there leaves the other two usable.
_CHUNK_IMPORT_ERROR: str | None = _IMPORT_ERROR
if _CHUNK_IMPORT_ERROR is None:
    try:
        from sparsecomm.ops.triton.chunk_codecs import unsupported as _chunk_layout_unsupported
        from sparsecomm.ops.triton.chunk_decode_add import chunk_decode_add, exact_topk_decode_add
        from sparsecomm.ops.triton.chunk_encode import chunk_encode
        from sparsecomm.ops.triton.exact_topk_encode import exact_topk_encode
    except Exception as error:
        _CHUNK_IMPORT_ERROR = f"the Triton chunk kernels could not be defined ({type(error).__name__}: {error})"


def _unavailable(name, reason):
    def op(*args, **kwargs):
        raise ImportError(f"sparsecomm.ops.triton.{name}: {reason}")
    op.__name__ = name
    return op


if _IMPORT_ERROR is not None:
    ef_topk_pack = _unavailable("ef_topk_pack", _IMPORT_ERROR)
    unpack_add = _unavailable("unpack_add", _IMPORT_ERROR)

    def interpreting() -> bool:
        return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

if _CHUNK_IMPORT_ERROR is not None:
    chunk_encode = _unavailable("chunk_encode", _CHUNK_IMPORT_ERROR)
    chunk_decode_add = _unavailable("chunk_decode_add", _CHUNK_IMPORT_ERROR)
    exact_topk_encode = _unavailable("exact_topk_encode", _CHUNK_IMPORT_ERROR)
    exact_topk_decode_add = _unavailable("exact_topk_decode_add", _CHUNK_IMPORT_ERROR)


def chunk_unsupported(layout) -> str | None:
    """Why the chunk kernels do not take ``layout`` (a ChunkLayout), or None when they do."""
    if _CHUNK_IMPORT_ERROR is not None:
        return _CHUNK_IMPORT_ERROR
    return _chunk_layout_unsupported(layout)


def available(device_type: str = "cuda") -> tuple[bool, str]:
    """(usable, reason if not) for tensors of ``device_type`` ("cuda" or "cpu")."""
    if _IMPORT_ERROR is not None:
        return False, _IMPORT_ERROR
    if device_type == "cuda":
        import torch

        if not torch.cuda.is_available():
            return False, "no CUDA device is available"
        return True, ""
    if device_type == "cpu":
        if not interpreting():
            return False, ("Triton runs on CPU tensors only under TRITON_INTERPRET=1, set before "
                           "sparsecomm.ops.triton is imported")
        return True, ""
    return False, f"Triton kernels support cuda (and cpu under TRITON_INTERPRET=1), not {device_type}"
