"""Aggregated-gradient agreement: did every rank receive the same reduced gradients?

After DDP's reduction every rank must hold bitwise the same ``.grad`` (the hook hands
every rank the same averaged bucket). A fault between the collective and the optimizer
(a corrupt receive buffer, a faulty decompression on one rank, a bit flip in ``.grad``)
breaks that silently: the replicas take different optimizer steps and drift apart.

Every step, each rank folds an exact digest of its gradients into a running digest of
the current window (no collective); every ``every`` steps one all-reduce of three int64
compares the windows. Every single-bit flip in any rank's gradients of any step of the
window changes that rank's running digest (see "The window digest" below), so the vote
catches it at the window's last step, on every rank alike: at most ``every - 1`` steps
after the fault, ``(every - 1) / 2`` on average for a fault at a random step. With
``every=1`` each step is its own window and the vote stops the faulty step before
``optimizer.step()``.

What the default window (``every=10``) gives up against a vote on every step, to cost
one all-reduce per 10 steps instead of one per step: a fault on one of the 9 steps that
end no window is found after the optimizer applied it (the weights of the replicas may
already differ: recover by rolling back to a checkpoint no newer than
:attr:`GradientAgreementMonitor.last_agreed_step`), and the commit vote (below) happens on
the last step of a window only. Each step still costs one digest of the gradients (one
pass over them).

It also serves as the step's commit vote (torchft's ``should_commit``): a rank whose
backward raised (a guard in the hook, a failed collective) passes the error as
``local_error``; on the last step of a window the same all-reduce then tells every rank
that the step must not be committed, so all of them raise instead of one rank stopping
while the others step on.

Runs in the training loop, never in the hook: it issues a collective, and collectives
issued from Future callbacks run in arbitrary order across ranks (docs/architecture.md,
"Rules").

The window digest
-----------------
``running = running * M + digest(step's gradients)`` modulo 2**64, from 0 at the start of
each window, with ``M`` odd and ``digest`` the exact digest of
:func:`~sparsecomm.monitor.replica_digest.tensors_digest`. A single-bit flip changes one
step's digest by ``d = odd * 2**b`` with ``b < 64`` (see that module), hence the running
digest by ``d * M**j``: ``M**j`` is odd, so the change is again ``odd * 2**b``, never 0
modulo 2**64. With ``every=1`` the running digest is the step's digest itself.
"""
import torch

from sparsecomm.hooks.validation import check_int
from sparsecomm.monitor._consensus import compare_across_ranks
from sparsecomm.monitor.replica_digest import tensors_digest

DEFAULT_EVERY = 10
_MUL_STEP = 0xD6E8FEB86659FD93 - (1 << 64)  # odd, as a signed int64


class GradientAgreementMonitor:
    """Check that all ranks hold identical gradients, between ``backward()`` and ``optimizer.step()``.

    Usage on every rank, every step::

        error = None
        try:
            loss.backward()
        except Exception as caught:     # a guard in the hook, a failed collective
            error = caught
        monitor.check(step, local_error=error)   # a vote step: raises on every rank if any failed
        optimizer.step()

    Args:
        module: the DDP model or the module it wraps.
        every: the window: each step's gradients are folded into a running digest, which
            all ranks compare when ``step % every == 0`` (same on every rank). ``every=1``
            compares every step's gradients before that step is committed. A local error on
            a step that ends no window is re-raised on that rank only: its peers learn of it
            from their next collective (a timeout or a peer-closed error).
        group: process group of the replicas; None means the default group.
        reference_rank: tie-break for naming suspects when no strict majority exists
            (see :class:`~sparsecomm.monitor.replica_digest.ReplicaDigestMonitor`).

    Attributes:
        last_agreed_step: the last vote step at which all ranks agreed (None before): the
            gradients of every step up to it were identical on all ranks. A fault found at
            a later vote happened after it.
        window_start: the first step folded into the current window (None when empty).
        checks: votes taken.
    """

    def __init__(self, module: torch.nn.Module, *, every: int = DEFAULT_EVERY, group=None,
                 reference_rank: int | None = None):
        self.module = module
        self.every = check_int("every", every, 1)
        self.group = group
        self.reference_rank = reference_rank
        self.checks = 0
        self.last_agreed_step: int | None = None
        self.window_start: int | None = None
        self._running: torch.Tensor | None = None

    def check(self, step: int, *, local_error: BaseException | None = None) -> int | None:
        """Fold ``step``'s gradients into the window; on a vote step compare the windows.

        Returns the agreed running digest on a vote step, else None.

        Raises:
            CorruptionDetected: ``check="gradient_agreement"`` on every rank, on a vote
                step, when any rank's gradients of any step of the window differ or any
                rank passed ``local_error``. The window starts afresh after every vote.
        """
        vote = step % self.every == 0
        if local_error is not None and not vote:
            raise local_error
        if local_error is None:
            digest = tensors_digest([p.grad for p in self.module.parameters()])
            self._running = digest if self._running is None else self._running * _MUL_STEP + digest
            if self.window_start is None:
                self.window_start = step
        if not vote:
            return None
        first, running = self.window_start, self._running
        self.window_start, self._running = None, None
        if local_error is not None:
            # The gradients of a failed step mean nothing; only the failure flag counts.
            device = next(self.module.parameters()).device
            running = torch.zeros((), dtype=torch.int64, device=device)
        window = f"step {step}" if first in (None, step) else f"steps {first}..{step}"
        agreed = compare_across_ranks(
            running, group=self.group, check="gradient_agreement", step=step, what=f"gradient digest of {window}",
            failure=local_error, reference_rank=self.reference_rank,
        )
        self.checks += 1
        self.last_agreed_step = step
        return agreed
