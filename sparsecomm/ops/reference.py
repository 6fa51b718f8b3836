"""Pure-torch twins of the native kernels: the oracle in tests and the fallback path.

Each function implements the operator contract in ``csrc/README.md`` exactly (same
selected set, same bits), using only torch ops, so native and Triton kernels are tested
against these. They are slow on CPU (``torch.topk`` over one 1-D tensor does not
parallelise) and allocate temporaries; the native kernels do neither.

Non-finite entries of acc (+-Inf, NaN) are selected first and sent unchanged (every rank
sees the overflow), and leave +0 in the residual whether they were sent or not: Inf - Inf
= NaN, or an unsent Inf, kept there would rank first and be sent again on every later step.
"""
import torch

from sparsecomm.compress.chunk_layout import check_exact_topk_layout, exact_topk_layout  # noqa: F401  (ops take them from here too)
from sparsecomm.compress.crc32c import crc32c  # noqa: F401  (the twin of the native crc32c)
from sparsecomm.compress.error_feedback import divide_, residual_after_sending, to_wire_dtype
from sparsecomm.compress.topk import magnitude_key, topk_by_key  # noqa: F401  (the selection rule)


def compensated(grad: torch.Tensor, residual: torch.Tensor | None, divisor: float, add_residual: bool) -> torch.Tensor:
    """``grad / divisor (+ residual)`` in grad's dtype, rounded exactly as the in-place hook path."""
    acc = divide_(grad.clone(), divisor)
    if add_residual:
        acc.add_(residual)
    return acc


def _emit(acc, residual, selected, indices_out, values_out, index_offset):
    """Write the selected entries and the residual update (``sent + residual == acc`` where acc
    is finite; +0 where it is not, selected or not)."""
    m = selected.numel()
    values = to_wire_dtype(acc[selected], values_out.dtype)
    indices_out[:m] = (selected + index_offset).to(torch.int32)
    values_out[:m] = values
    indices_out[m:] = 0
    values_out[m:] = 0
    if residual is not None:
        residual_after_sending(residual, acc, selected, values)


def _check_vectors(name, tensors, grad):
    for arg, tensor in tensors.items():
        if tensor is None:
            continue
        if tensor.dim() != 1 or not tensor.is_contiguous():
            raise ValueError(f"{name}: {arg} must be a contiguous 1-D tensor, got shape {tuple(tensor.shape)}")
        if tensor.device != grad.device:
            raise ValueError(f"{name}: {arg} is on {tensor.device}, grad on {grad.device}")
    residual = tensors.get("residual")
    if residual is not None and (residual.numel() != grad.numel() or residual.dtype != grad.dtype):
        raise ValueError(f"{name}: residual must match grad ({grad.numel()} x {grad.dtype}), "
                         f"got {residual.numel()} x {residual.dtype}")
    if residual is not None and residual.data_ptr() == grad.data_ptr():
        raise ValueError(f"{name}: residual may not alias grad")


def ef_topk_pack(grad, residual, divisor, add_residual, k, indices_out, values_out, index_offset=0) -> None:
    """Exact top-k of the compensated gradient, packed; residual updated (see csrc/README.md)."""
    _check_vectors("ef_topk_pack", {"grad": grad, "residual": residual, "indices_out": indices_out,
                                    "values_out": values_out}, grad)
    if not 1 <= k <= grad.numel():
        raise ValueError(f"ef_topk_pack: k must be in [1, {grad.numel()}], got {k}")
    if indices_out.numel() < k or values_out.numel() < k:
        raise ValueError(f"ef_topk_pack: indices_out/values_out must hold k={k} entries")
    acc = compensated(grad, residual, divisor, add_residual)
    selected = topk_by_key(magnitude_key(acc), k)
    _emit(acc, residual, selected, indices_out[:k], values_out[:k], index_offset)


def ef_threshold_pack(grad, residual, divisor, add_residual, threshold, indices_out, values_out, index_offset=0):
    """Entries with key >= key(threshold), lowest indices first, up to the capacity."""
    _check_vectors("ef_threshold_pack", {"grad": grad, "residual": residual, "indices_out": indices_out,
                                         "values_out": values_out}, grad)
    acc = compensated(grad, residual, divisor, add_residual)
    bar = magnitude_key(torch.tensor([threshold], dtype=torch.float32)).item()
    selected = torch.nonzero(magnitude_key(acc) >= bar).flatten()[: indices_out.numel()]
    _emit(acc, residual, selected, indices_out, values_out[: indices_out.numel()], index_offset)
    return torch.tensor(selected.numel(), dtype=torch.int64, device=grad.device)


def unpack_add(indices: torch.Tensor, values: torch.Tensor, out: torch.Tensor, zero_out: bool = True) -> None:
    """Scatter-add every row of (indices, values) into ``out``, in row (rank) order."""
    if indices.dim() != 2 or indices.shape != values.shape:
        raise ValueError(f"unpack_add: indices and values must be [world_size, k], got "
                         f"{tuple(indices.shape)} and {tuple(values.shape)}")
    if zero_out:
        out.zero_()
    for row_indices, row_values in zip(indices, values):
        out.index_add_(0, row_indices.long(), row_values.to(out.dtype))


def chunk_encode(grad, residual, divisor, add_residual, layout, payload):
    """``selector="chunk"``: the compensated acc encoded by ``layout`` (a ChunkLayout) into
    ``payload``; residual updated. Returns (bucket-relative indices int64, decoded values)."""
    _check_vectors("chunk_encode", {"grad": grad, "residual": residual, "payload": payload}, grad)
    if add_residual and residual is None:
        raise ValueError("chunk_encode: add_residual=True needs a residual")
    acc = compensated(grad, residual, divisor, add_residual)
    return layout.encode(acc, residual, payload)


def chunk_decode_add(gathered, layout, out, zero_out: bool = True) -> None:
    """Decode every payload of ``gathered`` (back to back, or one per row:
    :func:`~sparsecomm.compress.chunk_layout.payload_rows`) and add them into ``out`` in row
    (rank) order."""
    indices, values = layout.views(gathered)
    unpack_add(indices, values, out, zero_out)


# Exact top-k on the compact wire (the hook's exact top-k with an index or value codec): the
# layout is one chunk of the whole bucket, with a scale per ``scale_group`` payload entries
# (a ChunkLayout(numel, numel, density, codecs, scale_group)). The chunk ops take it too; its
# own ops say what it is, and refuse every other layout.

def exact_topk_encode(grad, residual, divisor, add_residual, layout, payload):
    """The exact top-k of the compensated acc, encoded by ``layout`` (exact top-k on the compact
    wire: :func:`exact_topk_layout`) into ``payload``; residual updated. Returns (indices int64,
    in ascending order, decoded values)."""
    check_exact_topk_layout("exact_topk_encode", layout)
    return chunk_encode(grad, residual, divisor, add_residual, layout, payload)


def exact_topk_decode_add(gathered, layout, out, zero_out: bool = True) -> None:
    """Decode every payload of exact top-k on the compact wire in ``gathered`` (back to back, or
    one per row) and add them into ``out`` in row (rank) order."""
    check_exact_topk_layout("exact_topk_decode_add", layout)
    chunk_decode_add(gathered, layout, out, zero_out)
