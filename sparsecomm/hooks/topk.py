"""Top-k sparsification with error feedback, as a DDP communication hook.

Usage::

    state = sparsecomm.TopKState(density=0.01, module=ddp_model)
    ddp_model.register_comm_hook(state, sparsecomm.topk_hook)

or ``sparsecomm.register_topk_hook(ddp_model, density=0.01)``, which also guards against
double registration and non-DDP modules. The state (settings, per-rank memories,
checkpointing) lives in :mod:`sparsecomm.hooks.topk_state`; the stages this body calls, one
file each, in :mod:`sparsecomm.hooks.pipeline`.
"""
# No ``from __future__ import annotations`` here: DDP checks the hook's ``bucket``
# annotation by identity, and string annotations fail that check.
import time

import torch
import torch.distributed as dist

from sparsecomm.compress.chunk_layout import ChunkLayout
from sparsecomm.hooks.conservation import ConservationAudit
from sparsecomm.hooks.pipeline import (acc, decode, dense, exchange, integrity, owner, plan, record, select_encode,
                                      shared_index)
from sparsecomm.hooks.topk_state import (  # noqa: F401  (TopKState and the constants are re-exported)
    K_SCOPES,
    MAX_BUCKET_NUMEL,
    SELECTOR_CHOICES,
    STATE_DICT_FORMAT,
    DenseFallbackWarning,
    TopKState,
)


def topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Reduce a gradient bucket by sending only its largest entries, with error feedback.

    1. Plan: until ``warmup_steps`` steps have passed, or when the sparse payload would not
       be smaller than the dense buffer, allreduce the bucket densely (the residual is sent
       in full and cleared). Otherwise k = ceil(density * numel) entries, per bucket or,
       with ``k_scope="parameter"``, per parameter.
    2. Compensate: ``acc = grad / world_size + residual`` (dividing first avoids fp16
       overflow), with the velocity in between when momentum correction is on; in float32
       for 16-bit buckets (``residual_dtype``). The fused kernel does this in step 3.
    3. Select k entries of ``acc`` (exact top-k, sampled threshold, random-k, or the top
       entries of every chunk) and encode their indices and values into one payload (int32
       indices and float values; chunked: the index and value codecs); the new residual is
       ``acc - decoded`` (so ``decoded + residual == acc`` exactly), and 0 where acc is
       not finite, while the Inf/NaN itself is sent, so every rank sees the overflow.
    4. Update the memories and records: momentum factor masking, the audit
       (``verify_conservation``), what was sent, the counters.
    5. Exchange, from this hook body: all-gather the fixed-size payloads (one collective
       per bucket; MPI's ``Iallgatherv`` with ``transport="mpi"``, where the sampled
       selector sends a variable number of entries after exchanging the sizes); random-k
       allreduces its values.
    6. Decode and accumulate, in the Future's callback: scatter-add every rank's payload
       into the bucket buffer in place, in rank order.

    Buckets of sparse gradients (``nn.Embedding(sparse=True)``) are allreduced as they are,
    as DDP's default does. The first bucket of a step first settles the previous step
    (rollback of a skipped step, unused parameters, grad scaler) and, on the first call,
    checks that all ranks run the same settings (one small all-gather).

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
    memory_dtype = plan.check_bucket(state.config, buffer)
    group = state._group()
    if state.config.transport == "mpi":
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
            fut, is_dense = dense.reduce_sparse_gradients(state, buffer, group, world_size), True
        else:
            call = plan.BucketCall(state, bucket, names, numels, group, world_size)
            fut, is_dense = _reduce(plan.plan_bucket(call, buffer, memory_dtype))
    except BaseException:
        state._pending -= 1
        raise
    step = state.step  # the callback may run after the step counter moved on

    def deliver(done: torch.futures.Future) -> torch.Tensor:
        try:
            reduced = done.value()  # re-raises a failed collective, or a refused payload
        finally:
            state._pending -= 1
            if state._pending == 0 and not state._step_open:
                state._close_step_view()  # a failed step's counters are its own too
        state._emit("reduced", bucket, names, numels, is_dense, step=step, reduced=reduced)
        return reduced

    if bucket.is_last():
        state._end_step()
        # wire_checksum: every rank raises alike if any found a corrupt payload (one small allreduce).
        fut = integrity.agree(state, group, step, buffer.device, fut)
    return fut.then(deliver)


def _reduce(call: plan.BucketCall) -> tuple[torch.futures.Future, bool]:
    """Steps 2-6 for one planned bucket: (future of the reduced bucket, dense)."""
    state, config = call.state, call.state.config
    velocity, residual = acc.memories(call, call.with_residual)
    owner_memory = owner.owner_residual(call, residual) if config.exchange in ("owner", "auto") else None
    if state._journal is not None:
        state._journal.record(call.index, [m for m in (velocity, residual, owner_memory) if m is not None])
    call.emit("gradient", call.dense, gradient=call.out)
    if call.dense:
        return dense.reduce_dense(call, velocity, residual), True
    started = time.perf_counter()
    audit = (ConservationAudit(state, call.grad, call.numels, call.world_size, velocity, residual)
             if config.verify_conservation else None)
    variable = config.transport == "mpi" and config.selector == "sampled" and config.k_scope == "bucket"
    if call.exchange == "owner":
        return _reduce_through_owners(call, velocity, residual, owner_memory, audit, started), False
    if call.exchange == "shared-index":
        return _reduce_on_shared_indices(call, velocity, residual, audit, started), False
    # 2. acc, unless the kernel forms it (exact top-k; the threshold pack over MPI; the native chunk encoder).
    chunked = isinstance(call.layout, ChunkLayout)  # chunked selection, or exact top-k on the compact wire
    fused = (select_encode.chunk_fused(call) if chunked
             else acc.fused(state) and (config.selector == "exact" or variable))
    if not fused:
        acc.compensate(call, velocity, residual)
    # 3. select + encode, then seal (wire_checksum: the checksum covers what the encoder wrote).
    if config.selector == "random":
        packed = select_encode.random_values(call, residual)  # allreduced: a sum carries no checksum
    else:
        buffer, gathered = state._wire_buffers(call.index, call.layout, call.world_size, call.out.device)
        payload = buffer[: call.layout.nbytes]
        if variable:
            packed = select_encode.variable_payload(call, residual, fused, payload, gathered)
        elif chunked:
            packed = select_encode.chunk_payload(call, residual, fused, payload)
        else:
            packed = select_encode.fixed_payload(call, residual, fused, payload)
        packed.seal(buffer, integrity.trailer_bytes(config))
    # 4. memories and records.
    record.after_packing(call, packed, velocity, residual, audit)
    record.count_sparse_call(call, packed, 0, started)
    # 5. exchange (here, in the hook body) and 6. decode + accumulate (in the callback).
    if config.selector == "random":
        fut, received = exchange.allreduce_values(call, packed)
        accumulate = decode.scatter_values(call, packed.indices)
    elif variable:
        fut, counts, received = exchange.allgather_variable(call, packed, gathered)
        accumulate = decode.variable(call, counts, call.value_dtype)
    else:
        fut, received = exchange.allgather_fixed(call, packed, gathered)
        accumulate = decode.fixed(call, call.layout)
    state._count(bytes_received=received, allgather_calls=int(config.selector != "random"))
    fut = fut.then(accumulate)
    if packed.sealed is not None:
        state._seals.futures.append(fut)  # checked when it arrives; agreed on at the step's last bucket
    return fut, False


def _reduce_through_owners(call: plan.BucketCall, velocity, residual, owner_memory, audit,
                           started) -> torch.futures.Future:
    """Steps 2-6 with ``exchange="owner"`` (:mod:`sparsecomm.hooks.pipeline.owner`)."""
    state = call.state
    bufs = owner.buffers(call, call.grad.dtype if residual is None else residual.dtype)
    fused = select_encode.chunk_fused(call)
    if not fused:
        acc.compensate(call, velocity, residual)
    packed = owner.encode(call, residual, fused, bufs.send)
    record.after_packing(call, packed, velocity, residual, audit)
    record.count_sparse_call(call, packed, 0, started)
    fut, received = owner.exchange(call, packed, bufs, owner_memory, audit=audit is not None)
    rank = state._rank_and_world_size()[0]
    state._count(owner_calls=1, bytes_received=received,
                 bytes_sent=owner.sent_bytes(call.layout, rank) - packed.send.numel())
    fut = fut.then(owner.accumulate(call, call.layout, bufs))
    if call.layout.trailer:
        state._seals.futures.append(fut)
    return fut


def _reduce_on_shared_indices(call: plan.BucketCall, velocity, residual, audit, started) -> torch.futures.Future:
    """Steps 2-6 with ``exchange="shared-index"`` (:mod:`sparsecomm.hooks.pipeline.shared_index`)."""
    state = call.state
    acc.compensate(call, velocity, residual)
    indices, index_bytes, led, verdict = shared_index.shared_indices(call, state.current_density())
    packed = shared_index.with_verdict(select_encode.shared_values(call, residual, indices), verdict)
    record.after_packing(call, packed, velocity, residual, audit)
    record.count_sparse_call(call, packed, 0, started)
    fut, received = exchange.allreduce_values(call, packed)
    state._count(shared_index_calls=1, bytes_received=received + (0 if led else index_bytes),
                 bytes_sent=index_bytes if led else 0)
    return fut.then(shared_index.accumulate(call, packed.indices, verdict is not None))


def _completed(tensor: torch.Tensor) -> torch.futures.Future:
    fut = torch.futures.Future()
    fut.set_result(tensor)
    return fut
