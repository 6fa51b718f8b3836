"""Step 2: acc = grad / world_size (+ local clipping) (+ momentum) + residual.

Divided first, as torch's allreduce hook does, so fp16 sums do not overflow. With the
fused kernel (no momentum, no clipping, no observer that reads acc) this stage is done by
the kernel itself in the same pass as the selection, and acc is never written.
"""
import math

import torch

from sparsecomm import compress


def memories(call, with_residual: bool):
    """(velocity, residual) flat tensors of the bucket, in the memory dtype (None if unused)."""
    state, config = call.state, call.state.config
    velocity = residual = None
    if config.momentum > 0:
        velocity = state.memories.velocities.bucket_tensor(call.index, call.names, call.numels, call.grad)
    if with_residual:
        residual = state.memories.residuals.bucket_tensor(call.index, call.names, call.numels, call.grad)
    return velocity, residual


def fused(state) -> bool:
    """Can the kernel form acc itself (reading grad and residual once, never writing acc)?

    Momentum, local clipping and the model budget while it counts (steps of several buckets)
    need acc in the bucket, and so do observers that read it (see TopKState.add_observer);
    everything else takes the fast path.
    """
    config, budget = state.config, state.model_budget
    return config.momentum == 0 and config.local_clip_norm is None and not (budget is not None and budget.counting) \
        and not (state.observers.callbacks and state.observers.need_acc())


def kernel_arguments(world_size: int, residual: torch.Tensor | None, fused: bool) -> tuple[float, bool]:
    """(divisor, add_residual) for a kernel that takes ``grad``: fused, it forms
    ``acc = grad / world_size + residual`` itself in the same pass as the selection;
    otherwise ``grad`` already holds acc (compensated in place), to be taken as it is."""
    return (float(world_size), residual is not None) if fused else (1.0, False)


def compensate(call, velocity, residual) -> None:
    """``call.grad`` turned in place into ``grad/ws (+ clipping) (+ velocity) + residual``."""
    config, grad = call.state.config, call.grad
    compress.compensate(grad, None, call.world_size)
    if config.local_clip_norm is not None:
        clip_locally(grad, call.numels, config.local_clip_norm, call.world_size)
    if velocity is not None:
        if config.nesterov:  # DGC's Nesterov: u = m (u + g); accumulate u + g
            velocity.add_(grad).mul_(config.momentum)
            grad.add_(velocity)
        else:  # u = m u + g; accumulate u
            velocity.mul_(config.momentum).add_(grad)
            grad.copy_(velocity)
    if residual is not None:
        grad.add_(residual)


def clip_locally(buffer: torch.Tensor, numels, clip_norm: float, world_size: int) -> None:
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
