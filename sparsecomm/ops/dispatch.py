"""The dispatch point between the hook and the kernels.

The hook calls the functions here, never a kernel directly. Each op has a pure-torch
reference (:mod:`sparsecomm.ops.reference`, and :func:`sparsecomm.compress.select_and_pack`
for the generic selectors); native implementations take over per device type:

* CPU: the C++/OpenMP extension (``sparsecomm._C``);
* CUDA: the CUDA extension, or Triton kernels when the extension has no CUDA kernels
  (or ``SPARSECOMM_KERNELS=triton``);
* anything else, or ``SPARSECOMM_KERNELS=reference``: the reference.

Kernels registered with :func:`register_kernel` win over all of these (tests use this to
inject faults). When the extension is missing, the first lookup warns once, naming why.
The reference stays the oracle in tests.
"""
import functools
from typing import Callable

import torch

from sparsecomm import compress
from sparsecomm.compress.layout import PayloadLayout
from sparsecomm.ops import native, reference

# op name -> reference implementation
_REFERENCE: dict[str, Callable] = {
    "select_and_pack": compress.select_and_pack,
    **{op: getattr(reference, op) for op in native.OPS},
}
# Ops with Triton twins (sparsecomm/ops/triton) chosen by _builtin; the chunk ops' (and those
# of exact top-k on the compact wire) are chosen by _chunk_implementation (they depend on the
# layout too). ef_threshold_pack has a CPU kernel only: its one caller, the MPI transport's
# variable-size wire, runs on CPU.
_TRITON_OPS = ("ef_topk_pack", "unpack_add")
# The chunk ops run, on a layout of exact top-k on the compact wire (reference.exact_topk_layout),
# as that wire's own ops.
_EXACT_TOPK_OPS = {"chunk_encode": "exact_topk_encode", "chunk_decode_add": "exact_topk_decode_add"}
# (op name, device type) -> implementation registered by the user or a test
_KERNELS: dict[tuple[str, str], Callable] = {}


def register_kernel(op: str, device_type: str, fn: Callable) -> None:
    """Use ``fn`` instead of the built-in choice for ``op`` on tensors of ``device_type``."""
    if op not in _REFERENCE:
        raise ValueError(f"register_kernel: op must be one of {sorted(_REFERENCE)}, got {op!r}")
    _KERNELS[(op, device_type)] = fn


def unregister_kernel(op: str, device_type: str) -> None:
    """Undo :func:`register_kernel` (no error if nothing was registered)."""
    _KERNELS.pop((op, device_type), None)


def _builtin(op: str, device_type: str) -> Callable:
    choice = native.requested_kernels()
    if op not in native.OPS or choice == "reference" or device_type not in ("cpu", "cuda"):
        return _REFERENCE[op]
    if device_type == "cuda" and choice != "native" and op in _TRITON_OPS:
        from sparsecomm.ops import triton as triton_ops

        usable, _ = triton_ops.available()
        if usable and (choice == "triton" or not (native.load()[0] and native.has_kernel(op, "CUDA"))):
            return getattr(triton_ops, op)
    loaded, reason = native.load()
    dispatch_key = "CPU" if device_type == "cpu" else "CUDA"
    if loaded and native.has_kernel(op, dispatch_key):
        return getattr(native, op)
    if choice == "native":
        raise RuntimeError(f"SPARSECOMM_KERNELS=native but there is no native {op} for {device_type}: "
                           f"{reason or 'the extension was built without it'}")
    native.warn_unavailable(reason or f"the extension was built without {dispatch_key} kernels")
    return _REFERENCE[op]


def implementation(op: str, device_type: str) -> Callable:
    """The function that runs ``op`` for tensors on ``device_type``."""
    if op not in _REFERENCE:
        raise ValueError(f"implementation: op must be one of {sorted(_REFERENCE)}, got {op!r}")
    return _KERNELS.get((op, device_type)) or _builtin(op, device_type)


def select_and_pack(acc: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Dispatching :func:`sparsecomm.compress.select_and_pack` (generic selectors)."""
    return implementation("select_and_pack", acc.device.type)(acc, *args, **kwargs)


def ef_topk_pack(grad, residual, divisor, add_residual, k, indices_out, values_out, index_offset=0) -> None:
    """Dispatching :func:`sparsecomm.ops.reference.ef_topk_pack`."""
    implementation("ef_topk_pack", grad.device.type)(grad, residual, divisor, add_residual, k, indices_out,
                                                     values_out, index_offset)


def ef_threshold_pack(grad, residual, divisor, add_residual, threshold, indices_out, values_out, index_offset=0):
    """Dispatching :func:`sparsecomm.ops.reference.ef_threshold_pack`."""
    return implementation("ef_threshold_pack", grad.device.type)(grad, residual, divisor, add_residual, threshold,
                                                                 indices_out, values_out, index_offset)


def unpack_add(indices: torch.Tensor, values: torch.Tensor, out: torch.Tensor, zero_out: bool = True) -> None:
    """Dispatching :func:`sparsecomm.ops.reference.unpack_add`."""
    implementation("unpack_add", out.device.type)(indices, values, out, zero_out)


# The native chunk encoders take float32 gradients (csrc/README.md); the decoders every bucket dtype.
_NATIVE_CHUNK_GRAD_DTYPES = (torch.float32,)
# The Triton chunk kernels' gradient (encode) and bucket (decode) dtypes.
_TRITON_CHUNK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _chunk_implementation(chunk_op: str, tensor: torch.Tensor, layout) -> Callable:
    """The choice for ``chunk_op`` (chunk_encode or chunk_decode_add) on ``layout``, as
    :func:`_builtin`'s: a layout of exact top-k on the compact wire runs that wire's op
    (exact_topk_encode, exact_topk_decode_add), any other the chunk op. On CPU the native
    kernel; on CUDA the native CUDA kernel, else (or with ``SPARSECOMM_KERNELS=triton``) the
    Triton kernel; the reference with ``SPARSECOMM_KERNELS=reference``, on other devices, and
    for what the kernels do not take (every reference gives the same bits): 16-bit gradients
    (native encoders), a ``scale_group`` on a layout of more than one chunk (all kernels), exact
    top-k on CUDA (the CUDA kernels: Triton takes it), and chunks over 8192 entries without a
    ``scale_group`` (Triton). A registered kernel wins, as everywhere: one registered for the
    exact top-k op, else one registered for the chunk op (which took every layout before the
    exact top-k ops had names of their own)."""
    exact = reference.exact_topk_layout(layout)
    op = _EXACT_TOPK_OPS[chunk_op] if exact else chunk_op
    device_type = tensor.device.type
    registered = _KERNELS.get((op, device_type)) or _KERNELS.get((chunk_op, device_type))
    if registered is not None:
        return registered
    choice = native.requested_kernels()
    if choice == "reference" or device_type not in ("cpu", "cuda") or (getattr(layout, "scale_group", 0) and not exact):
        return _REFERENCE[op]
    native_takes = chunk_op != "chunk_encode" or tensor.dtype in _NATIVE_CHUNK_GRAD_DTYPES
    if device_type == "cpu":
        return _builtin(op, "cpu") if native_takes else _REFERENCE[op]
    loaded, reason = native.load()
    native_cuda = native_takes and loaded and native.has_kernel(op, "CUDA")
    if choice != "native" and (choice == "triton" or not native_cuda):
        from sparsecomm.ops import triton as triton_ops

        usable, why_not = triton_ops.available()
        if usable and tensor.dtype in _TRITON_CHUNK_DTYPES and triton_ops.chunk_unsupported(layout) is None:
            return getattr(triton_ops, op)
    if native_cuda:
        return getattr(native, op)
    if choice == "native" and native_takes and not exact:
        raise RuntimeError(f"SPARSECOMM_KERNELS=native but there is no native {op} for cuda: "
                           f"{reason or 'the extension was built without it'}")
    if choice != "native" and why_not:  # no kernel at all (not just this layout): say so once
        native.warn_unavailable(f"no CUDA {op} kernel (the extension: {reason or 'built without it'}; "
                                f"Triton: {why_not})")
    return _REFERENCE[op]


def native_chunk_encode(grad: torch.Tensor, layout) -> bool:
    """Whether :func:`chunk_encode` runs a kernel (not the reference) for ``grad`` and ``layout``."""
    return _chunk_implementation("chunk_encode", grad, layout) not in (reference.chunk_encode,
                                                                        reference.exact_topk_encode)


def chunk_encode(grad, residual, divisor, add_residual, layout, payload):
    """Dispatching :func:`sparsecomm.ops.reference.chunk_encode`: (indices int64, decoded values)."""
    return _chunk_implementation("chunk_encode", grad, layout)(grad, residual, divisor, add_residual, layout, payload)


def chunk_decode_add(gathered: torch.Tensor, layout, out: torch.Tensor, zero_out: bool = True) -> None:
    """Dispatching :func:`sparsecomm.ops.reference.chunk_decode_add`."""
    _chunk_implementation("chunk_decode_add", out, layout)(gathered, layout, out, zero_out)


def exact_topk_encode(grad, residual, divisor, add_residual, layout, payload):
    """Dispatching :func:`sparsecomm.ops.reference.exact_topk_encode`: (indices int64, decoded values)."""
    reference.check_exact_topk_layout("exact_topk_encode", layout)
    return chunk_encode(grad, residual, divisor, add_residual, layout, payload)


def exact_topk_decode_add(gathered: torch.Tensor, layout, out: torch.Tensor, zero_out: bool = True) -> None:
    """Dispatching :func:`sparsecomm.ops.reference.exact_topk_decode_add`."""
    reference.check_exact_topk_layout("exact_topk_decode_add", layout)
    chunk_decode_add(gathered, layout, out, zero_out)


def crc32c(data: torch.Tensor) -> torch.Tensor:
    """Dispatching :func:`sparsecomm.ops.reference.crc32c`: the native kernel on CPU, the
    pure-torch twin elsewhere (GPUs have no crc32c kernel: the twin is their path, not a
    fallback, so it runs without a warning). Called twice per sealed bucket and step on a
    payload of a few KB, where the general lookup would cost more than the CRC: the common
    case (CPU, native, nothing registered or forced) takes a cached answer."""
    if data.device.type != "cpu":
        return _KERNELS.get(("crc32c", data.device.type), reference.crc32c)(data)
    if not _KERNELS and _native_crc32c() and native.requested_kernels() != "reference":
        return native.crc32c(data)
    return implementation("crc32c", "cpu")(data)


@functools.cache
def _native_crc32c() -> bool:
    """Whether the extension is loaded with a CPU crc32c (fixed for the process)."""
    return native.load()[0] and native.has_kernel("crc32c", "CPU")


def payload_views(payload: torch.Tensor, k: int, value_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 indices, values) views of one payload, or ``[world_size, k]`` views of a gathered buffer."""
    return PayloadLayout(k, value_dtype).views(payload)


def unpack_payloads(gathered: torch.Tensor, out: torch.Tensor, k: int, value_dtype: torch.dtype) -> torch.Tensor:
    """Overwrite ``out`` with the sum of the all-gathered payloads (rank order)."""
    indices, values = payload_views(gathered, k, value_dtype)
    unpack_add(indices, values, out, True)
    return out
