"""Error feedback: what is not sent this step is kept and added to the next step.

Reference twin of the fused kernel (residual update + select + pack). Memory traffic of
this reference: it reads ``acc`` three times and writes the residual and the payload; the
native kernel reads the gradient and residual once.

The invariant that makes error feedback lossless over time, and that tests check exactly::

    sent + new_residual == acc            where acc = grad / world_size + old_residual

at every entry where acc is finite. ``sent`` is the dense tensor the payload decodes to.
Values cast to a narrower dtype keep their rounding error in the residual, so the cast is
also compensated.

Non-finite policy: NaN and Inf are sent (top-k selects them first; the value goes on the
wire unchanged), so every rank sees the overflow and the training loop, or
torch.amp.GradScaler, skips the step. Their residual becomes +0, whether they were sent or
not: acc - sent would be Inf - Inf = NaN, which ranks above everything and would be sent
again on every later step (one overflow step would poison training for good), and an
unsent Inf kept as-is would do the same. Finite values beyond the range of a narrower wire
dtype (fp16 tops out at 65504) saturate instead of turning into Inf on the wire, and the
excess stays in the residual (:func:`to_wire_dtype`).
"""
from typing import Callable

import torch

from sparsecomm.compress.packing import pack_into

Selector = Callable[[torch.Tensor, int, torch.Generator | None], torch.Tensor]


def compensate(grad: torch.Tensor, residual: torch.Tensor | None, world_size: int) -> torch.Tensor:
    """``grad / world_size + residual``, in place in ``grad`` (the bucket buffer).

    Dividing first, as torch's allreduce hook does, keeps fp16 sums from overflowing.
    """
    divide_(grad, world_size)
    if residual is not None:
        grad.add_(residual)
    return grad


def residual_after_sending(residual: torch.Tensor, acc: torch.Tensor, indices: torch.Tensor, sent: torch.Tensor,
                           *, keep_unusable: bool = False) -> None:
    """The error-feedback update, in place: ``residual = acc - sent`` at ``indices`` (``sent``:
    what the receivers decode there), ``acc`` elsewhere, and +0 wherever acc is not finite.

    ``acc - sent`` is exact in acc's dtype when ``sent`` is acc rounded to a narrower one,
    so ``sent + residual == acc`` bit for bit. ``keep_unusable`` (the scaled codecs'
    contract): where ``sent`` is not finite but acc is (a group's scale overflowed), nothing
    usable was sent, and the residual keeps acc; without it (the float wires' contract,
    ``csrc/README.md``) the residual there is ``acc - sent``, the overflow's sign.
    """
    kept = acc[indices]
    wide = sent.to(acc.dtype)
    residual.copy_(acc)
    residual[indices] = torch.where(torch.isfinite(wide), kept - wide, kept) if keep_unusable else kept - wide
    # Non-finite acc, sent or not, leaves +0 (see the non-finite policy above).
    residual.masked_fill_(~torch.isfinite(acc), 0.0)


def divide_(tensor: torch.Tensor, divisor: float) -> torch.Tensor:
    """``tensor /= divisor`` in place, with IEEE division (correctly rounded) on every device.

    On CUDA, torch divides by a Python scalar by multiplying with its reciprocal, which
    rounds differently when the divisor is not a power of two; a device-side divisor
    gets true division, the same bits as on CPU and in the native kernels.
    """
    if tensor.device.type == "cpu":
        return tensor.div_(divisor)
    return tensor.div_(torch.full((), float(divisor), device=tensor.device))


def to_wire_dtype(values: torch.Tensor, value_dtype: torch.dtype) -> torch.Tensor:
    """``values`` cast to ``value_dtype``, saturating finite values the dtype cannot hold.

    A finite value beyond ``value_dtype``'s largest, L, goes out as +-s: L rounded down to a
    multiple of the value's ulp in its own dtype T (``values.dtype``), so that s and
    ``value - s`` are multiples of that ulp below the value's magnitude, both exact in T, and
    ``sent + residual == acc`` holds for every finite acc. L itself would not do: fp16's
    65504 is 2047 x 32, and float32 values from 2^29 on have an ulp of 64 or more. s is L
    while the ulp divides it (fp16: float32 below 2^29; bf16: every float32), smaller beyond,
    and 0 once the ulp exceeds L (fp16: float32 from 2^39, bfloat16 from 2^23 on): then the
    whole value stays in the residual. Details: docs/precision.md.
    """
    if value_dtype == values.dtype or torch.finfo(value_dtype).max >= torch.finfo(values.dtype).max:
        return values.to(value_dtype)
    limit = torch.finfo(value_dtype).max
    # In float32, which holds every T exactly, and L and s too (a bf16 tensor would round
    # fp16's 65504 up to 65536, Inf on the wire). 2^exponent: the value's bits with the
    # mantissa cleared (normal: |value| > L); times eps, 2^-(T's mantissa bits): the ulp.
    wide = values.float()
    ulp = (wide.view(torch.int32) & 0x7F800000).view(torch.float32) * torch.finfo(values.dtype).eps
    saturated = torch.copysign(torch.floor(limit / ulp) * ulp, wide)
    return torch.where(torch.isfinite(wide) & (wide.abs() > limit), saturated, wide).to(value_dtype)


def select_and_pack(
    acc: torch.Tensor,
    k: int,
    selector: Selector,
    payload: torch.Tensor,
    value_dtype: torch.dtype,
    residual_out: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Select up to ``k`` entries of ``acc``, pack them into ``payload``, update the residual.

    Args:
        acc: 1-D compensated gradient (see :func:`compensate`).
        k: payload capacity; the selector returns at most k indices.
        selector: e.g. :func:`~sparsecomm.compress.topk.topk_indices`.
        payload: uint8 buffer of :func:`~sparsecomm.compress.packing.payload_nbytes` bytes.
        value_dtype: dtype of the values on the wire.
        residual_out: if given, receives ``acc - sent`` (error feedback), +0 where acc is not
            finite; may alias nothing.
        generator: passed to the selector (sampled selectors draw from it).

    Returns:
        The selected indices (int64), for accounting and checks.
    """
    indices = selector(acc, k, generator)
    values = to_wire_dtype(acc[indices], value_dtype)
    pack_into(payload, indices, values, k)
    if residual_out is not None:
        residual_after_sending(residual_out, acc, indices, values)
    return indices
