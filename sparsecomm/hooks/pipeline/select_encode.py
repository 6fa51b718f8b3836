"""Stage 3: select entries of acc and encode them into what this rank sends.

Four shapes of payload:

* fixed (exact top-k, sampled threshold): ``[k int32 indices | k values | pad]``, the same
  size on every rank, so one fixed-size all-gather carries it;
* variable (sampled threshold over MPI): the entries above this rank's threshold, however
  many (at most k), compacted to ``[m indices | m values | pad]``;
* values (random-k): the values at indices every rank drew from the same seeded stream;
* chunked (``selector="chunk"``): per chunk of the bucket, its top entries, written by an
  index codec and a value codec (``compress.chunk_layout``), also the same size everywhere.

Error feedback is written here too (the kernels fuse it with the selection): the new
residual is acc minus what the receivers will decode, and 0 where acc is not finite.
"""
import itertools
import zlib

import torch

from sparsecomm import compress, ops
from sparsecomm.compress.error_feedback import divide_
from sparsecomm.compress.layout import PayloadLayout
from sparsecomm.compress.sampled_threshold import sample_positions, sample_size, threshold_of_sample
from sparsecomm.hooks.pipeline import acc, integrity


class Packed:
    """What this rank is about to send for one bucket."""

    __slots__ = ("send", "layout", "indices", "values", "fused", "nonfinite", "sealed")

    def __init__(self, send, layout, indices, values, fused, nonfinite=None):
        self.send = send  # the payload: what the receivers decode
        self.layout = layout  # PayloadLayout of ``send`` (None: bare values, random-k)
        self.indices = indices  # the selected bucket-relative indices
        self.values = values  # the sent values, in the wire dtype
        self.fused = fused  # acc was formed by the kernel and never written
        self.nonfinite = nonfinite  # random-k: acc held an Inf/NaN (None: not checked here)
        self.sealed = None  # ``send`` and its checksum's trailer (wire_checksum), set by seal()

    @property
    def count(self) -> int:
        return self.indices.numel()

    @property
    def wire(self) -> torch.Tensor:
        """What goes on the wire: the sealed payload, or the bare one."""
        return self.send if self.sealed is None else self.sealed

    def seal(self, buffer: torch.Tensor, trailer: int) -> None:
        """Seal ``send``, the front of ``buffer``, with the ``trailer`` bytes after it (none: 0)."""
        if trailer:
            self.sealed = buffer[: self.send.numel() + trailer]
            integrity.seal(self.sealed)


def fixed_payload(call, residual, fused: bool, payload: torch.Tensor) -> Packed:
    """Exact top-k (the fused kernel, or after compensation) or the sampled threshold."""
    state, config, layout = call.state, call.state.config, call.layout
    if config.selector == "exact":
        indices = _exact_topk_pack(call, residual, not fused, payload)
    else:
        # The residual is rewritten from acc, so read the old one only through acc.
        indices = ops.select_and_pack(call.grad, call.k, _selector(config, call.ks, call.numels), payload,
                                      call.value_dtype, residual_out=residual,
                                      generator=state._generator(call.out.device))
    index_view, value_view = layout.payload_views(payload)
    return Packed(payload, layout, indices, value_view[: indices.numel()], fused)


def chunk_fused(call) -> bool:
    """Does the chunk encoder form acc itself? Where a kernel (not the reference) encodes this
    bucket and nothing needs acc written (acc.fused); the reference keeps the compensation pass."""
    return acc.fused(call.state) and ops.dispatch.native_chunk_encode(call.grad, call.layout)


def chunk_payload(call, residual, fused: bool, payload: torch.Tensor) -> Packed:
    """Chunked top-k of acc, written by the layout's index and value codecs; the residual
    keeps ``acc - decoded`` (quantization error included). ``fused`` (:func:`chunk_fused`):
    the kernel forms ``grad / world_size + residual`` in the same pass, leaving ``call.grad``
    as it is; otherwise ``call.grad`` already holds acc."""
    divisor, add_residual = (float(call.world_size), residual is not None) if fused else (1.0, False)
    indices, decoded = ops.dispatch.chunk_encode(call.grad, residual, divisor, add_residual, call.layout, payload)
    return Packed(payload, call.layout, indices, decoded, fused)


def _exact_topk_pack(call, residual, compensated: bool, payload) -> torch.Tensor:
    """Fused error feedback + exact top-k + pack through the kernel dispatch point.

    ``compensated``: ``call.grad`` already holds ``acc`` (the residual is then only
    written); otherwise the kernel computes ``grad / world_size + residual`` itself in the
    same pass, leaving ``call.grad`` as it is (the unpack overwrites the bucket anyway).
    Returns the payload's int32 index view (bucket-relative indices of the sent entries).
    """
    config, buffer, k = call.state.config, call.grad, call.k
    divisor, add_residual = (1.0, False) if compensated else (float(call.world_size), residual is not None)
    index_view, value_view = call.layout.payload_views(payload)
    if config.k_scope == "bucket":
        ops.ef_topk_pack(buffer, residual, divisor, add_residual, k, index_view, value_view, 0)
    else:  # one selection per parameter slice, into consecutive parts of the payload
        offset = position = 0
        for k_part, numel in zip(call.ks, call.numels):
            part = slice(offset, offset + numel)
            ops.ef_topk_pack(buffer[part], None if residual is None else residual[part], divisor, add_residual,
                             k_part, index_view[position : position + k_part],
                             value_view[position : position + k_part], offset)
            offset, position = offset + numel, position + k_part
    call.layout.padding(payload).zero_()
    return index_view


def _selector(config, ks, numels):
    selector = compress.SELECTORS[config.selector]
    if config.k_scope == "parameter":
        return compress.per_parameter(selector, ks, numels)
    return selector


def variable_payload(call, residual, fused: bool, payload: torch.Tensor, gathered: torch.Tensor) -> Packed:
    """Sampled selector over MPI: the entries above this rank's threshold, however many.

    The threshold is estimated from a sample (DGC), so the count differs per rank and step;
    it is capped at the payload capacity k (entries beyond it, lowest indices kept, stay in
    the residual). The payload is compacted to ``[m indices | m values | pad to 8]``.
    """
    state, k, value_dtype, buffer = call.state, call.k, call.value_dtype, call.grad
    divisor, add_residual = (float(call.world_size), residual is not None) if fused else (1.0, False)
    threshold = _sampled_threshold(buffer, residual if add_residual else None, divisor, k,
                                   state._generator(buffer.device))
    index_view = call.layout.payload_views(payload)[0]
    # Scratch for the values: the front of this bucket's gather buffer, idle until the
    # all-gather is issued (the last step's unpack has finished), so no allocation.
    values = gathered[: k * value_dtype.itemsize].view(value_dtype)
    m = int(ops.ef_threshold_pack(buffer, residual, divisor, add_residual, threshold, index_view, values))
    # Compact to [m indices | m values | pad]: the values move from offset 4k down to 4m.
    layout = PayloadLayout(m, value_dtype)
    payload[layout.index_bytes : layout.index_bytes + layout.value_bytes].copy_(values[:m].view(torch.uint8))
    send = payload[: layout.nbytes]
    if m:
        layout.padding(send).zero_()
        sent_indices, sent_values = layout.payload_views(send)
    else:
        sent_indices, sent_values = index_view[:0], values[:0]
    return Packed(send, layout, sent_indices, sent_values, fused)


def _sampled_threshold(grad, residual, divisor: float, k: int, generator) -> float:
    """Magnitude of the k-th largest entry of ``acc = grad / divisor (+ residual)``, estimated
    from a ~1% sample (as the sampled selector); exact when the bucket is small. Only the
    sampled entries of acc are computed."""
    n = grad.numel()
    index = slice(None) if sample_size(n) == n else sample_positions(n, generator, grad.device)
    sample = divide_(grad[index].clone(), divisor)  # rounded as the hook's own compensation
    if residual is not None:
        sample.add_(residual[index])
    return float(threshold_of_sample(sample.abs().float(), k, n))


def random_values(call, residual) -> Packed:
    """Random-k: the values at indices drawn from a stream shared by all ranks (per
    parameter name, so the same indices whatever the bucket layout); acc is compensated."""
    state = call.state
    config = state.config
    offsets = [0, *itertools.accumulate(call.numels)]
    indices = torch.cat([
        compress.random_indices(n, k_part, seed=config.seed, step=state.step, stream=zlib.crc32(name.encode()))
        + offset
        for name, n, k_part, offset in zip(call.names, call.numels, call.ks, offsets)
    ]).to(call.grad.device)
    return shared_values(call, residual, indices)


def shared_values(call, residual, indices: torch.Tensor) -> Packed:
    """The values of the compensated acc at ``indices``, which every rank shares (random-k's
    seeded draw, or the shared-index exchange's leader selection), ready to be summed by an
    allreduce; the residual keeps the rest and the wire rounding of what is sent."""
    acc = call.grad
    values = compress.to_wire_dtype(acc[indices], call.value_dtype)
    nonfinite = not bool(torch.isfinite(acc).all())
    if nonfinite and bool(torch.isfinite(values).all()):
        # The shared indices missed this rank's Inf/NaN: send one anyway (at a shared
        # index), so that every rank sees the overflow and the step is skipped.
        values[0] = acc[(~torch.isfinite(acc)).nonzero()[0, 0]].to(values.dtype)
    if residual is not None:
        residual.copy_(acc)
        residual[indices] = acc[indices] - values.to(acc.dtype)
        if nonfinite:
            residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    return Packed(values, None, indices, values, False, nonfinite)
