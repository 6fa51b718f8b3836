"""Aggregated-gradient agreement: did every rank receive the same reduced gradients?

After DDP's reduction every rank must hold bitwise the same ``.grad`` (the hook hands
every rank the same averaged bucket). A fault between the collective and the optimizer
(a corrupt receive buffer, a faulty decompression on one rank, a bit flip in ``.grad``)
breaks that silently: the replicas take different optimizer steps and drift apart.

Every ``every`` steps (a vote step) each rank takes an exact digest of its gradients and
one all-reduce of three int64 compares them, before ``optimizer.step()``: a fault on a
vote step is stopped before any rank commits it. Two cadences:

- ``every=1``: every step is voted on; every fault in the reduced gradients is stopped
  before the optimizer applies it. Costs a digest (one pass over the gradients) and an
  all-reduce per step: about 4% of the default task's step (the vote every 10 steps: 0.4%).
- the default, ``every=10``: a tenth of that. A fault on one of the 9 steps between votes
  is not seen by the vote; the optimizer applies it on one rank, and the replica digest
  (:class:`~sparsecomm.monitor.replica_digest.ReplicaDigestMonitor`, on the same steps by
  default) finds it at its next check if it changed the weights. In the detection
  benchmark a top-exponent flip in one rank's reduced gradient was found 0-8 steps later
  (median 3.5; 20 of 20), a low mantissa flip only when it fell on a vote step (3 of 20:
  the others moved no weight). ``window=True`` closes that gap for the price of a digest
  per step: every step's digest is folded into a running digest of the window (no
  collective), and the vote compares the windows, so a flip on any step is found at the
  window's vote, at most ``every - 1`` steps later (20 of 20 for both bits, median 3.5
  and 4 steps; see "The window digest").

Measured figures and how: docs/reliability.md, "Monitors" (``experiments/bench_monitors.py``).

It also serves as the step's commit vote (torchft's ``should_commit``): a rank whose
backward raised (a guard in the hook, a failed collective) passes the error as
``local_error``; on a vote step the same all-reduce then tells every rank that the step
must not be committed, so all of them raise instead of one rank stopping while the
others step on. Between votes the error is raised on its rank only.

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
modulo 2**64. A window of one step is that step's digest itself.
"""
import torch

from sparsecomm.hooks.state.settings import check_int
from sparsecomm.monitor.consensus import compare_across_ranks
from sparsecomm.monitor import replica_digest
from sparsecomm.monitor.replica_digest import tensors_digest

# The replica digest's cadence: both checks fall on the same steps, so a step that passes
# both is one point a roll-back can return to.
DEFAULT_EVERY = replica_digest.DEFAULT_EVERY
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
        every: vote when ``step % every == 0`` (same on every rank). A local error on a
            step without a vote is re-raised on that rank only: its peers learn of it from
            their next collective (a timeout or a peer-closed error).
        window: False (default): a vote compares the gradients of its own step. True: it
            compares every step since the previous vote (each step's digest folded into a
            running digest; one digest per step).
        group: process group of the replicas; None means the default group.
        reference_rank: tie-break for naming suspects when no strict majority exists
            (see :class:`~sparsecomm.monitor.replica_digest.ReplicaDigestMonitor`).

    Attributes:
        last_agreed_step: the last vote step at which all ranks agreed (None before).
            With ``window=True`` the gradients of every step up to it were identical on all
            ranks, and a fault found at a later vote happened after it.
        window_start: the first step folded into the coming vote (None when none yet).
        checks: votes taken.
    """

    def __init__(self, module: torch.nn.Module, *, every: int = DEFAULT_EVERY, window: bool = False, group=None,
                 reference_rank: int | None = None):
        if not isinstance(window, bool):
            raise TypeError(f"window must be True or False, got {window!r}")
        self.module = module
        self.every = check_int("every", every, 1)
        self.window = window
        self.group = group
        self.reference_rank = reference_rank
        self.checks = 0
        self.last_agreed_step: int | None = None
        self.window_start: int | None = None
        self._running: torch.Tensor | None = None

    def check(self, step: int, *, local_error: BaseException | None = None) -> int | None:
        """Fold ``step``'s gradients into the coming vote (every step with ``window=True``,
        vote steps only otherwise); on a vote step compare them across ranks.

        Returns the agreed (running) digest on a vote step, else None.

        Raises:
            CorruptionDetected: ``check="gradient_agreement"`` on every rank, on a vote
                step, when any rank's gradients of a folded step differ or any rank passed
                ``local_error``. The next vote starts afresh, whatever the outcome.
        """
        vote = step % self.every == 0
        if local_error is not None and not vote:
            raise local_error
        if not vote and not self.window:
            return None
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
