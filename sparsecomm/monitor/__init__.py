"""Monitors: silent data corruption (SDC) and error-feedback staleness.

Why: faulty cores and memory corrupt training silently and regularly at scale (Llama 3:
six SDC interruptions in 54 days; Gemini: one every week or two), and a top-k +
error-feedback job has state nobody else checks: each rank's residual. Each monitor below
covers one place a fault can hide; none covers all (see reliability.md section 3).

=========================== ================================ ============== ========================= ===================
monitor                     detects                          runs           collective cost           action on detection
=========================== ================================ ============== ========================= ===================
ReplicaDigestMonitor        replicas' weights differ (any    training loop, 1 all-reduce of 3 int64   raise on all ranks
                            bit, e.g. a flip after the       after          per check (every N
                            optimizer step)                  optimizer.step steps; default 10)
GradientAgreementMonitor    ranks received different         training loop, 1 all-reduce of 3 int64   raise on all ranks
                            reduced gradients; also the      between        per checked step
                            step's commit vote after a       backward and   (default every step)
                            local failure                    optimizer.step
FiniteGuard                 NaN/Inf in gradient, residual    hook observer  none                      raise on that rank,
                            or payload, before it is sent    (gradient,                               bucket not sent
                                                             packed)
UpdateSpikeDetector         gradient norm > threshold x      hook observer  none                      raise on that rank
                            median of recent steps (e.g.     (gradient or                             (or record)
                            an exponent bit flip)            packed)
StalenessMonitor            residual entries waiting longer  hook observer  none                      mark run unverified
                            than the policy's staleness      (packed)                                 (or raise)
                            limit; residual/gradient ratio
TopKState(verify_           sent + residual != acc inside    in the hook    none                      ConservationError on
conservation=True)          the hook (E2; lives in hooks/)                                            that rank
=========================== ================================ ============== ========================= ===================

Policy actions. *Stop*: let :class:`CorruptionDetected` propagate; the process exits and
the launcher tears the job down. *Roll back*: catch it on every rank and restore the last
verified checkpoint (``ReplicaDigestMonitor.last_verified_step`` says how recent that may
be); restoring lives in ``sparsecomm.checkpoint``, not here.

A hook observer that raises aborts its bucket on one rank; the other ranks then wait in
that bucket's collective until the process group times out. Wrap ``backward()`` in a
try/except on every rank and pass the error to ``GradientAgreementMonitor.check(step,
local_error=...)``: every rank then raises together and no rank commits the step. The DDP
process group is unusable after such an abort (stop or rebuild the job).

:mod:`~sparsecomm.monitor.fault_injector` holds the bit-flip injectors the tests and the
benchmark use to show that each monitor catches what it claims.
"""
from sparsecomm.monitor.errors import CorruptionDetected, NonFiniteError, StalenessExceeded
from sparsecomm.monitor.fault_injector import BitFlipInjector, ValueInjector, flip_bit
from sparsecomm.monitor.finite_guard import FiniteGuard
from sparsecomm.monitor.gradient_agreement import GradientAgreementMonitor
from sparsecomm.monitor.replica_digest import ReplicaDigestMonitor, gradient_digest, parameter_digest, tensors_digest
from sparsecomm.monitor.spike import UpdateSpikeDetector
from sparsecomm.monitor.staleness import StalenessMonitor

__all__ = [
    "BitFlipInjector",
    "CorruptionDetected",
    "FiniteGuard",
    "GradientAgreementMonitor",
    "NonFiniteError",
    "ReplicaDigestMonitor",
    "StalenessExceeded",
    "StalenessMonitor",
    "UpdateSpikeDetector",
    "ValueInjector",
    "flip_bit",
    "gradient_digest",
    "parameter_digest",
    "tensors_digest",
]
