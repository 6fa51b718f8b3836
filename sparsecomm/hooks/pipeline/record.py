"""Step 4: after encoding, bring the memories and the records up to date.

Momentum factor masking (DGC: the velocity of what went out starts over), no non-finite
value left in the velocity, the packed event for observers, the conservation audit, what
was sent (for parameters DDP may drop as unused); and, once the exchange is issued, the
call's counters from the wire's own byte counts.
"""
import torch

from sparsecomm.hooks.unused_parameters import SentRecord


def after_packing(call, packed, velocity, residual) -> None:
    state = call.state
    if velocity is not None:
        # Momentum factor masking (DGC): the velocity of what was sent starts over. Only where a
        # value went out: a quantizing codec decodes the small entries of a selection to 0
        # (int2: those under a quarter of their group's largest), which sends nothing of them
        # (their whole acc stays in the residual), so their velocity carries on.
        velocity[packed.indices.long()[packed.values != 0]] = 0
        # Masking zeroed the sent entries, which include every non-finite one unless there
        # were more of them than the payload holds (random-k: unless the draw missed them).
        if packed.nonfinite if packed.nonfinite is not None else not bool(torch.isfinite(packed.values).all()):
            velocity.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    call.emit("packed", False, acc=None if packed.fused else call.grad, residual=residual, indices=packed.indices,
              payload=packed.send, values=packed.values)
    if call.audit is not None:
        call.audit.check(call.wire.sent_dense(packed, residual), residual, call.index, state.step)
    if state.unused is not None and residual is not None:
        state.unused.record(call.index, SentRecord(call.names, call.numels, packed.indices, packed.values))


def count_sparse_call(call, packed, seconds_select_pack: float) -> None:
    """Count one sparse call: its elements, and the bytes its wire sent and received."""
    numel, wire = call.out.numel(), call.wire
    calls = {f"{wire.name}_calls": 1} if wire.name else {}
    call.state.count(
        sparse_calls=1,
        fused_calls=int(packed.fused),
        elements_total=numel,
        elements_sparse=numel,
        elements_sent=packed.count,
        bytes_dense=numel * call.out.element_size(),
        bytes_sent=wire.bytes_sent(call, packed),
        bytes_received=wire.bytes_received(call, packed),
        seconds_select_pack=seconds_select_pack,
        **calls,
    )
