"""Top-k sparsification with error feedback, as a DDP communication hook.

Usage::

    state = sparsecomm.TopKState(density=0.01, module=ddp_model)
    ddp_model.register_comm_hook(state, sparsecomm.topk_hook)

or ``sparsecomm.register_topk_hook(ddp_model, density=0.01)``, which also guards against
double registration and non-DDP modules. The state (configuration, per-rank memories,
checkpointing) lives in :mod:`sparsecomm.hooks.topk_state`; this module is the hook body.
"""
# No ``from __future__ import annotations`` here: DDP checks the hook's ``bucket``
# annotation by identity, and string annotations fail that check.
import itertools
import math
import time
import zlib

import torch
import torch.distributed as dist

from sparsecomm import compress, ops
from sparsecomm.comm import allgather_future, allreduce_future
from sparsecomm.compress.error_feedback import divide_
from sparsecomm.compress.packing import payload_nbytes
from sparsecomm.compress.sampled_threshold import sample_positions, sample_size, threshold_of_sample
from sparsecomm.hooks.conservation import ConservationAudit
from sparsecomm.hooks.topk_state import (  # noqa: F401  (TopKState and the constants are re-exported)
    HALF_DTYPES,
    K_SCOPES,
    MAX_BUCKET_NUMEL,
    SELECTOR_CHOICES,
    STATE_DICT_FORMAT,
    DenseFallbackWarning,
    TopKState,
)
from sparsecomm.hooks.unused_parameters import SentRecord


class _Call:
    """One bucket's reduction: what every stage of the hook needs to know about it.

    ``grad`` is where acc is formed: the bucket buffer itself, or a float32 copy of it when
    the memories are wider than the bucket (16-bit models). ``out`` is the bucket buffer,
    which receives the reduced result.
    """

    __slots__ = ("state", "bucket", "index", "names", "numels", "group", "world_size", "grad", "out", "ks", "k",
                 "value_dtype")

    def __init__(self, state, bucket, names, numels, group, world_size, grad, out, ks, k, value_dtype):
        self.state, self.bucket, self.index = state, bucket, bucket.index()
        self.names, self.numels, self.group, self.world_size = names, numels, group, world_size
        self.grad, self.out, self.ks, self.k, self.value_dtype = grad, out, ks, k, value_dtype

    def emit(self, stage, dense, step=None, **tensors) -> None:
        self.state._emit(stage, self.bucket, self.names, self.numels, dense, step=step, **tensors)


def topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Reduce a gradient bucket by sending only its largest entries, with error feedback.

    1. Until ``state.warmup_steps`` steps have passed, allreduce the bucket densely
       (DDP rebuilds buckets after the first iteration; residuals start after that).
    2. Compensate: ``acc = grad / world_size + residual`` (dividing first avoids fp16
       overflow), with the velocity in between when momentum correction is on; in
       float32 for 16-bit buckets (``residual_dtype``).
    3. Select k = ceil(density * numel) entries of ``acc`` (exact top-k, sampled
       threshold, or random-k; per bucket or, with ``k_scope="parameter"``, inside each
       parameter) and pack their int32 indices and values into one buffer.
    4. Keep ``acc - sent`` as the new residual (so ``sent + residual == acc`` exactly);
       where acc is not finite the residual (and velocity) become 0, while the Inf/NaN
       itself is sent, so every rank sees the overflow.
    5. All-gather the fixed-size payloads (one collective per bucket) and scatter-add
       them into the bucket buffer in place: the result is the average over ranks of
       what each sent. Random-k allreduces the values instead. With
       ``transport="mpi"`` the all-gather is MPI's ``Iallgatherv``; the sampled selector
       then sends a variable number of entries per rank (sizes exchanged first).
    If the sparse payload would not be smaller than the dense buffer, step 5 becomes a
    dense allreduce of ``acc`` and the residual is cleared. Buckets of sparse gradients
    (``nn.Embedding(sparse=True)``) are allreduced as they are, as DDP's default does.
    The first bucket of a step first settles the previous step (rollback of a skipped
    step, unused parameters, grad scaler) and, on the first call, checks that all ranks
    run the same settings (one small all-gather).

    Args:
        state: a :class:`TopKState`.
        bucket: the gradient bucket DDP hands to the hook.

    Returns:
        Future holding the averaged bucket, shaped like ``bucket.buffer()``.

    Example::
        >>> # xdoctest: +SKIP
        >>> state = TopKState(density=0.01, module=ddp_model)
        >>> ddp_model.register_comm_hook(state, topk_hook)
    """
    if not isinstance(state, TopKState):
        raise TypeError(f"topk_hook: state must be a sparsecomm.TopKState, got {type(state).__name__}")
    buffer = bucket.buffer()
    if state._bypass:
        return _completed(buffer)  # see rebuild_buckets(): no communication, no state change
    memory_dtype = _check_bucket(state, buffer)
    group = state._group()
    if state.transport == "mpi":
        if buffer.device.type != "cpu":
            raise ValueError(f"topk_hook: transport='mpi' needs CPU gradients (this MPI reads host memory), got a "
                             f"bucket on {buffer.device}; use transport='c10d' (NCCL) for GPU buckets")
        state._mpi_transport()  # first call: checks the MPI world against the group
    world_size = dist.get_world_size(group)
    names, numels = state._bucket_layout(bucket)
    if not state._step_open:
        state._begin_step(group, buffer.device)
    # From here until the reduced bucket is delivered the memories are mid-update.
    state._pending += 1
    try:
        if buffer.is_sparse:
            fut, dense = _sparse_gradients(state, bucket, buffer, group, world_size), True
        else:
            fut, dense = _reduce(state, bucket, buffer, names, numels, group, world_size, memory_dtype)
    except BaseException:
        state._pending -= 1
        raise
    step = state.step  # the callback may run after the step counter moved on

    def deliver(done: torch.futures.Future) -> torch.Tensor:
        try:
            reduced = done.value()  # re-raises a failed collective
        finally:
            state._pending -= 1
        if state._pending == 0 and not state._step_open:
            state._close_step_view()
        state._emit("reduced", bucket, names, numels, dense, step=step, reduced=reduced)
        return reduced

    if bucket.is_last():
        state._end_step()
    return fut.then(deliver)


def _check_bucket(state: TopKState, buffer: torch.Tensor) -> torch.dtype:
    """The dtype of the bucket's memories, after refusing buckets the hook cannot reduce."""
    if not buffer.is_floating_point():
        raise TypeError(f"topk_hook: bucket buffer must be floating point, got {buffer.dtype}")
    if buffer.dtype == torch.float16 and state.value_dtype == torch.bfloat16:
        # bf16 rounds fp16 values near 65504 up to 65536, which is Inf back in fp16: the
        # reduced bucket would overflow. Refused on the first call, before any collective.
        raise ValueError("topk_hook: value_dtype=torch.bfloat16 cannot carry float16 gradients losslessly "
                         "(values near 65504 decode to Inf); use value_dtype torch.float16 or torch.float32")
    memory_dtype = state._memory_dtype(buffer.dtype)
    if memory_dtype not in (buffer.dtype, torch.float32):
        raise ValueError(f"topk_hook: residual_dtype={memory_dtype} cannot hold {buffer.dtype} gradients without "
                         f"rounding them (or their range); use residual_dtype None, torch.float32 or {buffer.dtype}")
    return memory_dtype


def _reduce(state, bucket, buffer, names, numels, group, world_size, memory_dtype):
    """(future, dense) of one dense bucket: plan, form acc, select, send."""
    warmup = state.step < state.warmup_steps
    value_dtype = state.value_dtype or buffer.dtype
    ks, k = _selection_sizes(state, numels)
    smaller = _sparse_is_smaller(state, buffer.numel(), k, buffer.dtype, value_dtype, world_size)
    dense = warmup or (state.allow_dense_fallback and not smaller)
    if dense and not warmup:  # the warning names the density that would have gone sparse
        bound = _sparse_density_bound(state, buffer.dtype, value_dtype, world_size)
        state._fallback_bound = max(bound, state._fallback_bound or 0.0)
    # During warm-up no residual exists yet: do not allocate one for a layout DDP discards.
    with_residual = state.error_feedback and (not warmup or len(state._residuals) > 0)
    wide = (with_residual or state.momentum > 0) and memory_dtype != buffer.dtype
    grad = state._wide_copy(buffer, memory_dtype) if wide else buffer
    call = _Call(state, bucket, names, numels, group, world_size, grad, buffer, ks, k, value_dtype)
    velocity, residual = _memories(call, with_residual)
    if state._journal is not None:
        state._journal.record(call.index, [m for m in (velocity, residual) if m is not None])
    call.emit("gradient", dense, gradient=buffer)
    if dense:
        return _dense(call, warmup, velocity, residual), True
    if buffer.numel() > MAX_BUCKET_NUMEL:
        raise ValueError(
            f"bucket {call.index} has {buffer.numel()} elements; int32 indices allow at most "
            f"{MAX_BUCKET_NUMEL}: lower bucket_cap_mb"
        )
    if state.selector == "random":
        return _sparse_random(call, velocity, residual), False
    if state.transport == "mpi" and state.selector == "sampled" and state.k_scope == "bucket":
        return _sparse_threshold_variable(call, velocity, residual), False
    return _sparse_topk(call, velocity, residual), False


def _memories(call: _Call, with_residual: bool):
    """(velocity, residual) flat tensors of the bucket, in the memory dtype (None if unused)."""
    state = call.state
    velocity = residual = None
    if state.momentum > 0:
        velocity = state._velocities.bucket_tensor(call.index, call.names, call.numels, call.grad)
    if with_residual:
        residual = state._residuals.bucket_tensor(call.index, call.names, call.numels, call.grad)
    return velocity, residual


# ----- acc ---------------------------------------------------------------------------------


def _compensate(call: _Call, velocity, residual) -> None:
    """``call.grad`` turned in place into ``grad/ws (+ clipping) (+ velocity) + residual``."""
    state, grad = call.state, call.grad
    compress.compensate(grad, None, call.world_size)
    if state.local_clip_norm is not None:
        _clip_locally(grad, call.numels, state.local_clip_norm, call.world_size)
    if velocity is not None:
        if state.nesterov:  # DGC's Nesterov: u = m (u + g); accumulate u + g
            velocity.add_(grad).mul_(state.momentum)
            grad.add_(velocity)
        else:  # u = m u + g; accumulate u
            velocity.mul_(state.momentum).add_(grad)
            grad.copy_(velocity)
    if residual is not None:
        grad.add_(residual)


def _clip_locally(buffer: torch.Tensor, numels, clip_norm: float, world_size: int) -> None:
    """DGC's local clipping of ``buffer = grad / world_size``, per parameter slice, in place.

    The local gradient's norm limit is ``clip_norm / sqrt(world_size)``; on the divided
    buffer that is ``clip_norm / sqrt(world_size) / world_size``.
    """
    limit = clip_norm / math.sqrt(world_size) / world_size
    offset = 0
    for numel in numels:
        part = buffer[offset : offset + numel]
        norm = float(torch.linalg.vector_norm(part.float()))
        if norm > limit:
            part.mul_(limit / norm)
        offset += numel


def _fused(state: TopKState) -> bool:
    """Can the kernel form acc itself (reading grad and residual once, never writing acc)?

    Momentum and local clipping need acc in the bucket, and so do observers that read it
    (see TopKState.add_observer); everything else takes the fast path.
    """
    return state.momentum == 0 and state.local_clip_norm is None and not state._observers_need_acc()


def _drop_nonfinite_velocity(velocity, sent_values: torch.Tensor) -> None:
    """Momentum factor masking zeroed the sent entries, which include every non-finite one
    unless there were more of them than the payload holds: only then is a pass needed."""
    if velocity is not None and not bool(torch.isfinite(sent_values).all()):
        velocity.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


# ----- dense -------------------------------------------------------------------------------


def _dense(call: _Call, warmup: bool, velocity, residual) -> torch.futures.Future:
    """Allreduce the compensated bucket; any residual is sent in full and cleared."""
    state, grad, out = call.state, call.grad, call.out
    _compensate(call, velocity, residual)
    if velocity is not None and not bool(torch.isfinite(grad).all()):
        velocity.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    if grad is not out:  # memories wider than the bucket: the wire carries the bucket's dtype
        out.copy_(grad)
        if residual is not None:  # what rounding to the bucket's dtype lost stays behind
            residual.copy_(grad).sub_(out).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    elif residual is not None:
        residual.zero_()
    if state._unused is not None and residual is not None:
        state._unused.record(call.index, SentRecord(call.names, call.numels, dense=out.clone()))
    call.emit("packed", True, acc=grad, residual=residual, indices=None, payload=out)
    nbytes = out.numel() * out.element_size()
    state._count(
        **{"warmup_calls" if warmup else "fallback_calls": 1},
        elements_total=out.numel(),
        bytes_dense=nbytes,
        bytes_sent=nbytes,
        bytes_received=_ring_bytes(nbytes, call.world_size),
    )
    fut = allreduce_future(out, call.group)
    if state._journal is None:
        return fut

    def note(done: torch.futures.Future) -> torch.Tensor:
        reduced = done.value()
        state._journal.note_reduced(~torch.isfinite(reduced).all())
        return reduced

    return fut.then(note)


def _sparse_gradients(state, bucket, buffer, group, world_size) -> torch.futures.Future:
    """A bucket of sparse (COO) gradients: averaged by a sparse allreduce, as DDP's default
    hook does. It is already as compact as its non-zero rows; there is no residual."""
    buffer.div_(world_size)
    nbytes = buffer._values().numel() * buffer.element_size() + buffer._indices().numel() * 8
    state._count(sparse_gradient_calls=1, elements_total=buffer.numel(), bytes_sent=nbytes,
                 bytes_dense=buffer.numel() * buffer.element_size(), bytes_received=(world_size - 1) * nbytes)
    return allreduce_future(buffer, group)


# ----- sparse: exact top-k / sampled threshold, fixed-size payloads -------------------------


def _sparse_topk(call: _Call, velocity, residual) -> torch.futures.Future:
    """All-gather (index, value) payloads of the selected entries; scatter-add them."""
    state, k, value_dtype = call.state, call.k, call.value_dtype
    started = time.perf_counter()
    payload, gathered = state._wire_buffers(call.index, k, value_dtype, call.world_size, call.out.device)
    fused = state.selector == "exact" and _fused(state)  # the sampled selector has no fused kernel
    audit = (ConservationAudit(state, call.grad, call.numels, call.world_size, velocity, residual)
             if state.verify_conservation else None)
    if not fused:
        _compensate(call, velocity, residual)
    if state.selector == "exact":
        indices = _exact_topk_pack(call, residual, not fused, payload)
    else:
        # The residual is rewritten from acc, so read the old one only through acc.
        indices = ops.select_and_pack(call.grad, k, _selector(state, call.ks, call.numels), payload, value_dtype,
                                      residual_out=residual, generator=state._generator(call.out.device))
    index_view, value_view = (view[0] for view in ops.payload_views(payload, k, value_dtype))
    sent_values = value_view[: indices.numel()]
    if velocity is not None:
        velocity[indices] = 0  # momentum factor masking (DGC): sent velocity starts over
        _drop_nonfinite_velocity(velocity, sent_values)
    call.emit("packed", False, acc=None if fused else call.grad, residual=residual, indices=indices,
              payload=payload, values=sent_values)
    if audit is not None:
        sent = ops.unpack_payloads(payload, torch.zeros_like(residual), k, value_dtype)
        audit.check(sent, residual, call.index, state.step)
    if state._unused is not None and residual is not None:
        state._unused.record(call.index, SentRecord(call.names, call.numels, index_view, value_view))
    _count_sparse_call(call, indices.numel(), payload.numel(), (call.world_size - 1) * payload.numel(), started,
                       fused)

    def unpack(fut: torch.futures.Future) -> torch.Tensor:
        unpack_started = time.perf_counter()
        out = ops.unpack_payloads(fut.value(), call.out, k, value_dtype)  # in place: no second bucket-size tensor
        state._count(seconds_unpack=time.perf_counter() - unpack_started)
        if state._journal is not None:
            _note_sparse_result(state, out, ops.payload_views(fut.value(), k, value_dtype)[0])
        return out

    if state.transport == "mpi":  # same bytes as c10d, so the same result bit for bit
        fut = state._mpi.allgatherv(payload, gathered, [payload.numel()] * call.world_size)
    else:
        fut = allgather_future(gathered, payload, call.group)
    return fut.then(unpack)


def _exact_topk_pack(call: _Call, residual, compensated: bool, payload) -> torch.Tensor:
    """Fused error feedback + exact top-k + pack through the kernel dispatch point.

    ``compensated``: ``call.grad`` already holds ``acc`` (the residual is then only
    written); otherwise the kernel computes ``grad / world_size + residual`` itself in the
    same pass, leaving ``call.grad`` as it is (the unpack overwrites the bucket anyway).
    Returns the payload's int32 index view (bucket-relative indices of the sent entries).
    """
    state, buffer, k = call.state, call.grad, call.k
    divisor, add_residual = (1.0, False) if compensated else (float(call.world_size), residual is not None)
    index_view, value_view = (view[0] for view in ops.payload_views(payload, k, call.value_dtype))
    if state.k_scope == "bucket":
        ops.ef_topk_pack(buffer, residual, divisor, add_residual, k, index_view, value_view, 0)
    else:  # one selection per parameter slice, into consecutive parts of the payload
        offset = position = 0
        for k_part, numel in zip(call.ks, call.numels):
            part = slice(offset, offset + numel)
            ops.ef_topk_pack(buffer[part], None if residual is None else residual[part], divisor, add_residual,
                             k_part, index_view[position : position + k_part],
                             value_view[position : position + k_part], offset)
            offset, position = offset + numel, position + k_part
    payload[index_view.numel() * 4 + value_view.numel() * value_view.element_size() :].zero_()  # alignment pad
    return index_view


def _note_sparse_result(state, out: torch.Tensor, index_rows: torch.Tensor) -> None:
    """Rollback mode: was the reduced bucket finite? Only entries some rank sent can be
    otherwise (a sent Inf/NaN, or a sum that overflowed), so only those are read."""
    state._journal.note_reduced(~torch.isfinite(out.index_select(0, index_rows.reshape(-1).long())).all())


# ----- sparse: sampled threshold over MPI, a variable number of entries per rank -------------


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


def _sparse_threshold_variable(call: _Call, velocity, residual) -> torch.futures.Future:
    """Sampled selector over MPI: send the entries above this rank's threshold, however many.

    The threshold is estimated from a sample (DGC), so the count differs per rank and step;
    it is capped at the payload capacity k (entries beyond it, lowest indices kept, stay in
    the residual). Each rank's payload is ``[m int32 indices | m values | pad to 8 bytes]``;
    the sizes are exchanged first (blocking, here in the hook body), then the payloads are
    all-gathered back to back in rank order and scatter-added in rank order.
    """
    state, k, value_dtype, buffer = call.state, call.k, call.value_dtype, call.grad
    started = time.perf_counter()
    payload, gathered = state._wire_buffers(call.index, k, value_dtype, call.world_size, call.out.device)
    fused = _fused(state)
    audit = (ConservationAudit(state, buffer, call.numels, call.world_size, velocity, residual)
             if state.verify_conservation else None)
    if not fused:
        _compensate(call, velocity, residual)
    divisor, add_residual = (float(call.world_size), residual is not None) if fused else (1.0, False)
    threshold = _sampled_threshold(buffer, residual if add_residual else None, divisor, k,
                                   state._generator(buffer.device))
    index_view = ops.payload_views(payload, k, value_dtype)[0][0]
    # Scratch for the values: the front of this bucket's gather buffer, idle until the
    # all-gather below is issued (the last step's unpack has finished), so no allocation.
    values = gathered[: k * value_dtype.itemsize].view(value_dtype)
    m = int(ops.ef_threshold_pack(buffer, residual, divisor, add_residual, threshold, index_view, values))
    # Compact to [m indices | m values | pad]: the values move from offset 4k down to 4m.
    nbytes = payload_nbytes(m, value_dtype)
    value_bytes = m * value_dtype.itemsize
    payload[4 * m : 4 * m + value_bytes].copy_(values[:m].view(torch.uint8))
    payload[4 * m + value_bytes : nbytes].zero_()
    send = payload[:nbytes]
    sent_indices, sent_values = (view[0] for view in ops.payload_views(send, m, value_dtype)) if m else (
        index_view[:0], values[:0])
    if velocity is not None:
        velocity[sent_indices.long()] = 0  # momentum factor masking (DGC): sent velocity starts over
        _drop_nonfinite_velocity(velocity, sent_values)
    call.emit("packed", False, acc=None if fused else buffer, residual=residual, indices=sent_indices, payload=send,
              values=sent_values)
    if audit is not None:
        sent = _unpack_variable(send, [m], torch.zeros_like(residual), value_dtype)
        audit.check(sent, residual, call.index, state.step)
    if state._unused is not None and residual is not None:
        state._unused.record(call.index, SentRecord(call.names, call.numels, sent_indices, sent_values))
    exchange_started = time.perf_counter()
    counts = state._mpi.allgather_counts(m)  # entries per rank
    state._count(seconds_count_exchange=time.perf_counter() - exchange_started)
    byte_counts = [payload_nbytes(count, value_dtype) for count in counts]
    _count_sparse_call(call, m, nbytes, sum(byte_counts) - nbytes, started, fused)

    def unpack(fut: torch.futures.Future) -> torch.Tensor:
        unpack_started = time.perf_counter()
        out = _unpack_variable(fut.value(), counts, call.out, value_dtype)
        state._count(seconds_unpack=time.perf_counter() - unpack_started)
        if state._journal is not None:
            _note_sparse_result(state, out, _variable_indices(fut.value(), counts, value_dtype))
        return out

    return state._mpi.allgatherv(send, gathered, byte_counts).then(unpack)


def _unpack_variable(gathered: torch.Tensor, counts, out: torch.Tensor, value_dtype) -> torch.Tensor:
    """Overwrite ``out`` with the sum of back-to-back payloads of ``counts[r]`` entries, in rank order."""
    out.zero_()
    offset = 0
    for m in counts:
        nbytes = payload_nbytes(m, value_dtype)
        if m:  # onto zeros in rank order: the same additions as the fixed-size unpack
            indices, values = ops.payload_views(gathered[offset : offset + nbytes], m, value_dtype)
            ops.unpack_add(indices, values, out, False)
        offset += nbytes
    return out


def _variable_indices(gathered: torch.Tensor, counts, value_dtype) -> torch.Tensor:
    """Every index in back-to-back variable payloads (for the finiteness check)."""
    parts, offset = [torch.zeros(1, dtype=torch.int32, device=gathered.device)], 0
    for m in counts:
        nbytes = payload_nbytes(m, value_dtype)
        if m:
            parts.append(ops.payload_views(gathered[offset : offset + nbytes], m, value_dtype)[0][0])
        offset += nbytes
    return torch.cat(parts)


# ----- sparse: random-k, shared indices ----------------------------------------------------


def _sparse_random(call: _Call, velocity, residual) -> torch.futures.Future:
    """Allreduce the values at indices every rank drew from the same seeded stream."""
    state, acc = call.state, call.grad
    started = time.perf_counter()
    audit = (ConservationAudit(state, acc, call.numels, call.world_size, velocity, residual)
             if state.verify_conservation else None)
    _compensate(call, velocity, residual)
    # One stream per parameter name: the same indices whatever the bucket layout.
    offsets = [0, *itertools.accumulate(call.numels)]
    indices = torch.cat([
        compress.random_indices(n, k_part, seed=state.seed, step=state.step, stream=zlib.crc32(name.encode())) + offset
        for name, n, k_part, offset in zip(call.names, call.numels, call.ks, offsets)
    ]).to(acc.device)
    values = compress.to_wire_dtype(acc[indices], call.value_dtype)
    nonfinite = not bool(torch.isfinite(acc).all())
    if nonfinite and bool(torch.isfinite(values).all()):
        # The random indices missed this rank's Inf/NaN: send one anyway (at a shared
        # index), so that every rank sees the overflow and the step is skipped.
        values[0] = acc[(~torch.isfinite(acc)).nonzero()[0, 0]].to(values.dtype)
    if residual is not None:
        residual.copy_(acc)
        residual[indices] = acc[indices] - values.to(acc.dtype)
        if nonfinite:
            residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        if audit is not None:
            sent = torch.zeros_like(acc).index_put_((indices,), values.to(acc.dtype))
            audit.check(sent, residual, call.index, state.step)
    if velocity is not None:
        velocity[indices] = 0
        if nonfinite:
            velocity.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    call.emit("packed", False, acc=acc, residual=residual, indices=indices, payload=values, values=values)
    if state._unused is not None and residual is not None:
        state._unused.record(call.index, SentRecord(call.names, call.numels, indices, values))
    value_bytes = values.numel() * values.element_size()
    _count_sparse_call(call, call.k, value_bytes, _ring_bytes(value_bytes, call.world_size), started, False)

    def scatter(fut: torch.futures.Future) -> torch.Tensor:
        reduced = fut.value()
        if state._journal is not None:
            state._journal.note_reduced(~torch.isfinite(reduced).all())
        call.out.zero_()
        call.out[indices] = reduced.to(call.out.dtype)
        return call.out

    return allreduce_future(values, call.group).then(scatter)


# ----- sizes and accounting ------------------------------------------------------------------


def _sparse_is_smaller(state, numel: int, k: int, buffer_dtype, value_dtype, world_size: int) -> bool:
    dense_bytes = numel * buffer_dtype.itemsize
    if state.selector == "random":
        return k * value_dtype.itemsize < dense_bytes
    return world_size * payload_nbytes(k, value_dtype) < dense_bytes


def _sparse_density_bound(state, buffer_dtype, value_dtype, world_size: int) -> float:
    """The density below which a bucket's sparse reduction sends fewer bytes than dense."""
    if state.selector == "random":
        return buffer_dtype.itemsize / value_dtype.itemsize
    return buffer_dtype.itemsize / (world_size * (4 + value_dtype.itemsize))


def _ring_bytes(nbytes: int, world_size: int) -> int:
    """Bytes a ring allreduce of ``nbytes`` brings into each rank: 2 (p-1)/p x nbytes."""
    return round(2 * (world_size - 1) * nbytes / world_size)


def _selection_sizes(state, numels: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """(entries per parameter, payload capacity k) of a bucket.

    Per parameter when the scope is "parameter" or the selector is random-k (which always
    draws per parameter); otherwise k is taken over the whole bucket.
    """
    density = state.current_density()
    ks = tuple(compress.num_selected(n, density) for n in numels)
    if state.k_scope == "parameter" or state.selector == "random":
        return ks, sum(ks)
    return ks, compress.num_selected(sum(numels), density)


def _selector(state, ks, numels):
    selector = compress.SELECTORS[state.selector]
    if state.k_scope == "parameter":
        return compress.per_parameter(selector, ks, numels)
    return selector


def _count_sparse_call(call: _Call, elements_sent: int, bytes_sent: int, bytes_received: int, started: float,
                       fused: bool) -> None:
    """Count one sparse call; host time since ``started`` is select + pack."""
    numel = call.out.numel()
    call.state._count(
        sparse_calls=1,
        fused_calls=int(fused),
        elements_total=numel,
        elements_sparse=numel,
        elements_sent=elements_sent,
        bytes_dense=numel * call.out.element_size(),
        bytes_sent=bytes_sent,
        bytes_received=bytes_received,
        seconds_select_pack=time.perf_counter() - started,
    )


def _completed(tensor: torch.Tensor) -> torch.futures.Future:
    fut = torch.futures.Future()
    fut.set_result(tensor)
    return fut
