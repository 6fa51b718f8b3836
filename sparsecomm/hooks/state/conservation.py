"""The error-feedback audit (``TopKState(verify_conservation=True)``), with its own oracle.

The invariant: every entry the hook takes in comes out either on the wire or in the new
residual, ``sent + new_residual == acc``, where acc is what the hook should have formed
from this step's raw gradient and its memories from before the step::

    acc = grad / world_size   (local clipping, momentum correction as configured)  + old_residual
    acc = (beta1 m + (1 - beta1) grad) / world_size + old_residual    (exchange="shared-mask")

acc is rebuilt here from copies of the raw gradient and of the old residual and velocity,
taken before the hook touched them, not read back from the hook's own intermediate value:
so a wrong divisor, a lost residual or a mis-applied momentum in the hook (or a kernel)
breaks the check instead of cancelling out. The roundings are the contract's
(``csrc/README.md``): divide, then add, in the memory dtype. Where acc is not finite the
residual must be exactly 0 (the non-finite rule); NaN never passes.

The owner exchange is checked at both levels; with ``owner_dropped="sender"`` a sender takes
back what its owner did not deliver, so "sent" there means sent for good: the payload less
those entries, checked again once they are back in the residual
(:meth:`ConservationAudit.check_taken_back`), and the owner level checks its sum only where its
reply delivers (:func:`check_owner_conservation`).
"""
import math

import torch

from sparsecomm.compress.error_feedback import divide_
from sparsecomm.errors import ConservationError


class ConservationAudit:
    """Copies taken before a sparse call; :meth:`check` compares the call's outcome."""

    def __init__(self, state, grad: torch.Tensor, numels, world_size: int, velocity, residual):
        self.grad = grad.clone()
        self.velocity = None if velocity is None else velocity.clone()
        self.residual = None if residual is None else residual.clone()
        self.numels = numels
        self.world_size = world_size
        self.momentum, self.nesterov, self.clip = state.momentum, state.nesterov, state.local_clip_norm
        self.carried = None  # exchange="shared-mask": (AdamS's first moment, beta1), see carry_momentum

    def carry_momentum(self, previous: torch.Tensor, beta1) -> None:
        """The shared mask sends the corrected momentum: acc = (beta1 m + (1 - beta1) grad) / p
        + old_residual, with ``previous`` = m as the hook read it (copied here)."""
        self.carried = (previous.clone(), beta1)

    def expected_acc(self) -> torch.Tensor:
        acc = self.grad.clone()
        if self.carried is not None:
            previous, beta1 = self.carried
            acc = acc * (1.0 - beta1) + previous * beta1
        acc = divide_(acc, self.world_size)
        if self.clip is not None:  # DGC: each rank's gradient norm <= clip / sqrt(p), on grad / p
            limit = self.clip / math.sqrt(self.world_size) / self.world_size
            for part in acc.split(list(self.numels)):
                norm = float(torch.linalg.vector_norm(part.float()))
                if norm > limit:
                    part.mul_(limit / norm)
        if self.velocity is not None:
            if self.nesterov:
                velocity = (self.velocity + acc) * self.momentum
                acc = acc + velocity
            else:
                acc = self.velocity * self.momentum + acc
        if self.residual is not None:
            acc = acc + self.residual
        return acc

    def check(self, sent: torch.Tensor, new_residual: torch.Tensor, bucket_index: int, step: int) -> None:
        """Raise ConservationError unless ``sent + new_residual == acc`` where acc is finite and
        ``new_residual == 0`` where it is not."""
        acc = self.expected_acc()
        finite = torch.isfinite(acc)
        reconstructed = sent + new_residual
        wrong = finite & (reconstructed != acc)
        kept_nonfinite = ~finite & (new_residual != 0)
        if bool(wrong.any()):
            bad = wrong.nonzero().flatten()
            raise ConservationError(
                f"step {step}, bucket {bucket_index}: sent + residual != grad/ws + old_residual at "
                f"{bad.numel()} of {acc.numel()} entries; first indices {bad[:5].tolist()}: "
                f"expected {acc[bad[:5]].tolist()}, got {reconstructed[bad[:5]].tolist()}"
            )
        if bool(kept_nonfinite.any()):
            bad = kept_nonfinite.nonzero().flatten()
            raise ConservationError(
                f"step {step}, bucket {bucket_index}: the residual kept {new_residual[bad[:5]].tolist()} where acc is "
                f"{acc[bad[:5]].tolist()} (indices {bad[:5].tolist()}): non-finite entries must leave 0"
            )

    def check_taken_back(self, sent: torch.Tensor, taken_back: torch.Tensor, new_residual: torch.Tensor,
                         bucket_index: int, step: int) -> None:
        """The owner exchange with ``owner_dropped="sender"``, once the replies are decoded: what
        was sent for good is ``sent`` (this rank's decoded payload) less the entries at
        ``taken_back`` (sent, not delivered by their owner, and added back into the residual), and
        :meth:`check` holds for it with the residual after they came back. ``sent`` is consumed."""
        self.check(sent.index_fill_(0, taken_back, 0), new_residual, bucket_index, step)


def check_owner_conservation(part, received: torch.Tensor, old_memory, reply: torch.Tensor, new_memory,
                             bucket_index: int, step: int, delivered_as: torch.dtype | None = None) -> None:
    """The owner exchange's second level: ``decoded reply + new owner residual == sum of the
    decoded messages + old owner residual``, with the sum rebuilt here by the reference
    decoder (rank order, onto zeros, in the owner residual's dtype), not read from the hook.

    ``part`` is the owner's ChunkLayout, ``received`` the p messages back to back;
    ``old_memory``/``new_memory`` the owner residual slice before/after (the audit needs
    error feedback, so both exist). ``delivered_as`` (``owner_dropped="sender"``: the reduced
    bucket's dtype) limits that to the entries the reply delivers (non-zero once in that
    dtype): the senders take the others back, where the owner residual must be the old one."""
    dtype = new_memory.dtype
    acc = torch.zeros(part.numel, dtype=dtype, device=reply.device)
    for row in received.view(-1, part.nbytes):
        indices, values = part.decode(row)
        acc.index_add_(0, indices, values.to(dtype))
    acc = acc + old_memory
    indices, values = part.decode(reply)
    sent = torch.zeros_like(acc).index_put_((indices,), values.to(dtype))
    finite = torch.isfinite(acc)
    delivered = torch.ones_like(finite)
    if delivered_as is not None:
        delivered = torch.zeros_like(finite).index_fill_(0, indices[values.to(delivered_as) != 0], True)
        moved = ~delivered & (new_memory != old_memory)
        if bool(moved.any()):
            bad = moved.nonzero().flatten()
            raise ConservationError(
                f"step {step}, bucket {bucket_index}, owner level: the owner residual changed from "
                f"{old_memory[bad[:5]].tolist()} to {new_memory[bad[:5]].tolist()} at entries its reply does not "
                f"deliver (indices {bad[:5].tolist()}), whose senders take them back (owner_dropped='sender')")
    wrong = delivered & finite & (sent + new_memory != acc)
    if bool(wrong.any()):
        bad = wrong.nonzero().flatten()
        raise ConservationError(
            f"step {step}, bucket {bucket_index}, owner level: reply + owner residual != sum of the messages + old "
            f"owner residual at {bad.numel()} of {acc.numel()} entries; first indices {bad[:5].tolist()}: expected "
            f"{acc[bad[:5]].tolist()}, got {(sent + new_memory)[bad[:5]].tolist()}")
    kept = delivered & ~finite & (new_memory != 0)
    if bool(kept.any()):
        bad = kept.nonzero().flatten()
        raise ConservationError(
            f"step {step}, bucket {bucket_index}, owner level: the owner residual kept {new_memory[bad[:5]].tolist()} "
            f"where the sum is {acc[bad[:5]].tolist()}: non-finite entries must leave 0")
