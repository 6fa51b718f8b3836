"""Top-k sparsification with error feedback, as a DDP communication hook.

Usage::

    state = sparsecomm.TopKState(density=0.01, module=ddp_model)
    ddp_model.register_comm_hook(state, sparsecomm.topk_hook)

or ``sparsecomm.register_topk_hook(ddp_model, density=0.01)``, which also guards against
double registration and non-DDP modules. The state (settings, per-rank memories, steps)
lives in :mod:`sparsecomm.hooks.topk_state`; the steps this body calls in
:mod:`sparsecomm.hooks.pipeline`, and the ways a bucket travels in :mod:`sparsecomm.hooks.wires`.
"""
# No ``from __future__ import annotations`` here: DDP checks the hook's ``bucket``
# annotation by identity, and string annotations fail that check.
import time

import torch
import torch.distributed as dist

from sparsecomm.hooks.pipeline import steps
from sparsecomm.hooks.state.conservation import ConservationAudit
from sparsecomm.hooks.wires import dense, integrity
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

    1. Plan: k = ceil(density * numel) entries, per bucket or, with ``k_scope="parameter"``,
       per parameter, and the wire the bucket travels by (:mod:`sparsecomm.hooks.wires`):
       the all-gather of fixed payloads (``exchange="allgather"``, the default; int32 +
       float entries, or the index and value codecs), the variable all-gather (sampled
       selector over MPI), the owner exchange (``"owner"``), the shared index set
       (``"shared-index"``), SCAPE's per-tensor mask chosen by the tensors' owners one step
       before (``"shared-mask"``, under AdamS: the first moment is what is synchronised), random-k, or the cheapest of all-gather, owner and
       shared-index on ``link`` (``"auto"``). Dense instead until ``warmup_steps`` steps have passed, or when the
       wire would not move fewer bytes than a dense allreduce: the bucket is then
       allreduced as a whole (the residual is sent in full and cleared).
    2. Compensate: ``acc = grad / world_size + residual`` (dividing first avoids fp16
       overflow), with the velocity in between when momentum correction is on; in float32
       for 16-bit buckets (``residual_dtype``). A kernel that forms acc itself does this
       in step 3 (``stats()["fused_calls"]``).
    3. Encode: select k entries of acc (exact top-k, sampled threshold, random-k, the top
       entries of every chunk, or, shared-index, the leader's selection, which it
       broadcasts first, or, shared-mask, the mask agreed the step before) and encode them into the wire's payload, sealed with a checksum
       (``wire_checksum``); the new residual is ``acc - decoded`` (so ``decoded + residual
       == acc`` exactly), and 0 where acc is not finite, while the Inf/NaN itself is sent,
       so every rank sees the overflow.
    4. Record: momentum factor masking, the audit (``verify_conservation``), what was sent.
    5. Exchange, from this hook body, in bucket order: the wire's collectives (an
       all-gather; sizes then ``Iallgatherv``; an all-to-all, the owners' reduce, then an
       all-gather of their replies; an allreduce of values). The counters take the bytes
       the wire sent and received.
    6. Decode and accumulate, in the Future's callback: check every payload's checksum,
       then decode every rank's contribution into the bucket buffer in place, in rank order.

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
    lifecycle = state.lifecycle
    if lifecycle.bypass:
        return _completed(buffer)  # see rebuild_buckets(): no communication, no state change
    memory_dtype = steps.check_bucket(state.config, buffer)
    if state.config.exchange == "shared-mask" and not state.adams_link.attached:  # before any collective
        raise ValueError("topk_hook: exchange='shared-mask' synchronises AdamS's first moment: register with "
                         "register_topk_hook(ddp, ..., optimizer=sparsecomm.optim.AdamS(...)) or call "
                         "state.attach_optimizer(adams) before the first step")
    group = state.group()
    if state.config.transport == "mpi":
        if buffer.device.type != "cpu":
            raise ValueError(f"topk_hook: transport='mpi' needs CPU gradients (this MPI reads host memory), got a "
                             f"bucket on {buffer.device}; use transport='c10d' (NCCL) for GPU buckets")
        state.mpi_transport()  # first call: checks the MPI world against the group
    world_size = dist.get_world_size(group)
    names, numels = state.names.of_bucket(bucket)
    if not lifecycle.open:
        state.begin_step(group, buffer.device)
    # From here until the reduced bucket is delivered the memories are mid-update.
    lifecycle.pending += 1
    try:
        if buffer.is_sparse:
            fut, is_dense = dense.reduce_sparse_gradients(state, buffer, group, world_size), True
        else:
            call = steps.plan_bucket(steps.BucketCall(state, bucket, names, numels, group, world_size), buffer,
                                     memory_dtype)  # 1.
            fut, is_dense = _reduce(call), call.dense
    except BaseException:
        lifecycle.pending -= 1
        raise
    step = state.step  # the callback may run after the step counter moved on

    def deliver(done: torch.futures.Future) -> torch.Tensor:
        try:
            reduced = done.value()  # re-raises a failed collective, or a refused payload
        finally:
            lifecycle.pending -= 1
            if lifecycle.pending == 0 and not lifecycle.open:
                state.close_step_view()  # a failed step's counters are its own too
        if state.observers.callbacks:
            state.observers.emit(state, "reduced", bucket, names, numels, is_dense, step=step, reduced=reduced)
        return reduced

    if bucket.is_last():
        if state.model_budget is not None:  # budget="model": the next step's k per bucket (one small allreduce)
            sent = state.model_budget.agree(group)
            state.count(bytes_sent=sent, bytes_budget=sent)
        state.end_step()
        # wire_checksum: every rank raises alike if any found a corrupt payload (one small allreduce).
        fut = integrity.agree(state.wire_context(), group, step, buffer.device, fut)
    return fut.then(deliver)


def _reduce(call: steps.BucketCall) -> torch.futures.Future:
    """Steps 2-6 for one planned bucket: the future of the reduced bucket."""
    state, config, wire = call.state, call.state.config, call.wire
    velocity, residual = steps.memories(call, call.with_residual)
    kept = wire.prepare(call, residual)  # what the exchange keeps besides the residual
    if state.journal is not None:
        state.journal.record(call.index, [m for m in (velocity, residual, *kept) if m is not None])
    call.emit("gradient", call.dense, gradient=call.out)
    if wire.dense:
        steps.compensate(call, velocity, residual)  # 2.
        return wire.follow(call, wire.reduce(call, velocity, residual), None)  # 3.-6., an allreduce of the bucket
    started = time.perf_counter()
    if config.verify_conservation:
        call.audit = ConservationAudit(state, call.grad, call.numels, call.world_size, velocity, residual)
    fused = wire.fuses_compensation(call)
    if not fused:
        steps.compensate(call, velocity, residual)  # 2.
    if state.model_budget is not None:  # fused: acc is not in the bucket, and the budget is not counting
        state.model_budget.observe(call.names, call.numels, call.plain_k, None if fused else call.grad)
    packed = wire.encode(call, residual, fused)  # 3.
    steps.after_packing(call, packed, velocity, residual)  # 4.
    seconds_select_pack = time.perf_counter() - started
    fut = wire.exchange(call, packed)  # 5.
    steps.count_sparse_call(call, packed, seconds_select_pack)
    fut = fut.then(wire.accumulate(call, packed))  # 6.
    if wire.sealed:
        state.seals.futures.append(fut)  # checked when it arrives; agreed on at the step's last bucket
    return wire.follow(call, fut, packed.indices)


def _completed(tensor: torch.Tensor) -> torch.futures.Future:
    fut = torch.futures.Future()
    fut.set_result(tensor)
    return fut
