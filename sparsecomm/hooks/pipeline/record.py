"""Stage 4: after packing, bring the memories and the records up to date.

Momentum factor masking (DGC: sent velocity starts over), no non-finite value left in the
velocity, the packed event for observers, the conservation audit, what was sent (for
parameters DDP may drop as unused), and the call's counters.
"""
import time

import torch

from sparsecomm.hooks.unused_parameters import SentRecord
from sparsecomm.hooks.pipeline import decode


def after_packing(call, packed, velocity, residual, audit) -> None:
    state = call.state
    if velocity is not None:
        velocity[packed.indices.long()] = 0  # momentum factor masking (DGC): sent velocity starts over
        # Masking zeroed the sent entries, which include every non-finite one unless there
        # were more of them than the payload holds (random-k: unless the draw missed them).
        if packed.nonfinite if packed.nonfinite is not None else not bool(torch.isfinite(packed.values).all()):
            velocity.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    call.emit("packed", False, acc=None if packed.fused else call.grad, residual=residual, indices=packed.indices,
              payload=packed.send, values=packed.values)
    if audit is not None:
        audit.check(decode.sent(packed, residual), residual, call.index, state.step)
    if state._unused is not None and residual is not None:
        state._unused.record(call.index, SentRecord(call.names, call.numels, packed.indices, packed.values))


def count_sparse_call(call, packed, bytes_received: int, started: float) -> None:
    """Count one sparse call; host time since ``started`` is select + pack."""
    numel = call.out.numel()
    call.state._count(
        sparse_calls=1,
        fused_calls=int(packed.fused),
        elements_total=numel,
        elements_sparse=numel,
        elements_sent=packed.count,
        bytes_dense=numel * call.out.element_size(),
        bytes_sent=packed.wire.numel() * packed.wire.element_size(),
        bytes_received=bytes_received,
        seconds_select_pack=time.perf_counter() - started,
    )
