"""Triton implementations of the sparsecomm operators (semantics: csrc/README.md).

Same Python signatures as :mod:`sparsecomm.ops.reference` (the oracle)::

    ef_topk_pack(grad, residual, divisor, add_residual, k, indices_out, values_out, index_offset=0) -> None
    ef_threshold_pack(grad, residual, divisor, add_residual, threshold, indices_out, values_out,
                      index_offset=0) -> 0-d int64 tensor
    topk_threshold(x, k, max_relative_error=0.05) -> (0-d float32 tensor, 0-d int64 tensor)
    unpack_add(indices, values, out, zero_out=True) -> None

None of them synchronises with the host: grid sizes follow from the sizes alone, and every
data-dependent quantity (histograms, the k-th key, per-program counts, offsets) lives in small
device tensors read by the next kernel. One file per op, shared radix kernels in
:mod:`sparsecomm.ops.triton.radix`.

Importing this package never fails: without a usable Triton the four functions raise
ImportError when called, and :func:`available` says why. Kernels run on CUDA tensors, and
on CPU tensors only under ``TRITON_INTERPRET=1`` (read by Triton when this package is first
imported: ``@triton.jit`` picks compiled or interpreted functions at definition time).
"""
import os

__all__ = ["available", "ef_threshold_pack", "ef_topk_pack", "topk_threshold", "unpack_add"]

_IMPORT_ERROR: str | None = None
try:
    import triton  # noqa: F401
    import triton.language  # noqa: F401
except Exception as error:  # ImportError, or a broken install raising something else
    _IMPORT_ERROR = f"triton is not importable ({type(error).__name__}: {error})"

if _IMPORT_ERROR is None:
    try:
        from sparsecomm.ops.triton.ef_threshold_pack import ef_threshold_pack
        from sparsecomm.ops.triton.ef_topk_pack import ef_topk_pack
        from sparsecomm.ops.triton.radix import interpreting
        from sparsecomm.ops.triton.topk_threshold import topk_threshold
        from sparsecomm.ops.triton.unpack_add import unpack_add
    except Exception as error:  # e.g. a Triton too old for tl.histogram(mask=...)
        _IMPORT_ERROR = f"the Triton kernels could not be defined ({type(error).__name__}: {error})"

if _IMPORT_ERROR is not None:
    def _unavailable(name):
        def op(*args, **kwargs):
            raise ImportError(f"sparsecomm.ops.triton.{name}: {_IMPORT_ERROR}")
        op.__name__ = name
        return op

    ef_topk_pack = _unavailable("ef_topk_pack")
    ef_threshold_pack = _unavailable("ef_threshold_pack")
    topk_threshold = _unavailable("topk_threshold")
    unpack_add = _unavailable("unpack_add")

    def interpreting() -> bool:
        return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


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
