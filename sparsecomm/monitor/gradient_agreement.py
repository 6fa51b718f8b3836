"""Aggregated-gradient agreement: did every rank receive the same reduced gradient?

After DDP's reduction every rank must hold bitwise the same ``.grad`` (the hook hands
every rank the same averaged bucket). A fault between the collective and the optimizer
(a corrupt receive buffer, a faulty decompression on one rank, a bit flip in ``.grad``)
breaks that silently: the replicas take different optimizer steps and drift apart. The
replica digest would notice only at its next check, after the bad step is committed.
Checking the gradients right before ``optimizer.step()`` stops the step instead.

It also serves as the step's commit vote (torchft's ``should_commit``): a rank whose
backward raised (a guard in the hook, a failed collective) passes the error as
``local_error``; the same all-reduce then tells every rank that the step must not be
committed, so all of them raise instead of one rank stopping while the others step on.

Runs in the training loop, never in the hook: it issues a collective, and collectives
issued from Future callbacks run in arbitrary order across ranks (docs/architecture.md, "Rules"). Cost
per checked step: one pass over the gradients and one all-reduce of three int64.
"""
import torch

from sparsecomm.hooks.validation import check_int
from sparsecomm.monitor._consensus import compare_across_ranks
from sparsecomm.monitor.replica_digest import tensors_digest


class GradientAgreementMonitor:
    """Check that all ranks hold identical gradients, between ``backward()`` and ``optimizer.step()``.

    Usage on every rank::

        error = None
        try:
            loss.backward()
        except Exception as caught:     # a guard in the hook, a failed collective
            error = caught
        monitor.check(step, local_error=error)   # raises on every rank if any rank failed
        optimizer.step()

    Args:
        module: the DDP model or the module it wraps.
        every: check when ``step % every == 0`` (same on every rank). A local error on an
            unchecked step is re-raised on that rank only: its peers learn of it from
            their next collective (a timeout or a peer-closed error).
        group: process group of the replicas; None means the default group.
        reference_rank: tie-break for naming suspects when no strict majority exists
            (see :class:`~sparsecomm.monitor.replica_digest.ReplicaDigestMonitor`).
    """

    def __init__(self, module: torch.nn.Module, *, every: int = 1, group=None, reference_rank: int | None = None):
        self.module = module
        self.every = check_int("every", every, 1)
        self.group = group
        self.reference_rank = reference_rank
        self.checks = 0

    def check(self, step: int, *, local_error: BaseException | None = None) -> int | None:
        """Compare the gradients at ``step``; the agreed digest, or None when not a check step.

        Raises:
            CorruptionDetected: ``check="gradient_agreement"`` on every rank when the
                gradients differ or any rank passed ``local_error``.
        """
        if step % self.every:
            if local_error is not None:
                raise local_error
            return None
        if local_error is None:
            digest = tensors_digest([p.grad for p in self.module.parameters()])
        else:
            # The gradients of a failed step mean nothing; only the failure flag counts.
            device = next(self.module.parameters()).device
            digest = torch.zeros((), dtype=torch.int64, device=device)
        agreed = compare_across_ranks(
            digest, group=self.group, check="gradient_agreement", step=step, what="gradient digest",
            failure=local_error, reference_rank=self.reference_rank,
        )
        self.checks += 1
        return agreed
