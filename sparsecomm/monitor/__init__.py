"""Monitors: silent data corruption (SDC) and error-feedback staleness.

Why: faulty cores and memory corrupt training silently and regularly at scale (Llama 3:
six SDC interruptions in 54 days; Gemini: one every week or two), and a top-k +
error-feedback job has state nobody else checks: each rank's residual. Each monitor below
covers one place a fault can hide; none covers all (docs/reliability.md, "Monitors").

Each monitor: what it detects; where it runs; collective cost; action on detection.

- ``ReplicaDigestMonitor``: replicas' weights differ in any bit (a flip in one rank's
  weights after the optimizer step, E1; and any fault that made the replicas apply
  different updates). Training loop, after ``optimizer.step()``, every N steps (default
  10). One all-reduce of three int64 per check, plus one small all-gather on a mismatch.
  Raises :class:`CorruptionDetected` on every rank.
- ``GradientAgreementMonitor``: ranks hold different reduced gradients (a fault after the
  collective, E3); also the step's commit vote after a local failure. Training loop,
  between ``backward()`` and ``optimizer.step()``, every N steps (default 10, on the
  replica digest's steps; ``every=1`` votes on every step, ``window=True`` compares every
  step since the last vote). One all-reduce of three int64 per vote. Raises on every
  rank; the voted step is not committed.
- ``FiniteGuard``: NaN/Inf in the gradient, the new residual, the sent values (and the
  compensated bucket when the hook writes it) (E4). Hook observer (stages ``gradient``
  and ``packed``); keeps the hook's fused kernel. No collective. Raises
  :class:`NonFiniteError` on that rank before the bucket is sent.
- ``UpdateSpikeDetector``: a gradient norm above ``threshold`` x the median of recent
  steps (large exponent flips, E5). Hook observer (``gradient``, the default, which keeps
  the fused kernel, or ``packed``) or ``observe()`` from the loop. No collective. Raises
  on that rank, or records.
- ``StalenessMonitor``: residual entries waiting longer than the policy's staleness limit;
  residual-to-gradient ratio (drift). Hook observer (``packed``); keeps the fused kernel.
  No collective. Marks the run unverified in ``report()`` (or raises
  :class:`StalenessExceeded`).
- ``TopKState(verify_conservation=True)`` (in ``sparsecomm.hooks``, not here): ``sent +
  residual != acc`` inside the hook (E2). Raises ``ConservationError`` on that rank.

The default settings (the five monitors above, each as constructed without arguments, the
staleness monitor every 10 steps) are sized to cost at most 5% of the default task's step
(a 0.25M-parameter GPT, 2 gloo ranks on 2 CPU cores); what they catch, how many steps
after the fault, and what they cost are measured by ``experiments/bench_monitors.py`` and
listed in docs/reliability.md ("Monitors"). In short: a flip in one replica's weights or
in the reduced gradient one rank received is caught by the next check on the 10-step
cadence (or at once by the spike detector when it is large); a flip in the reduced
gradient is stopped before the optimizer applies it only on a vote step, and a low
mantissa flip there that does not change the weights within 10 steps is not caught
(``window=True``: always caught, at the next vote; ``every=1``: always stopped).

Policy actions. *Stop*: let :class:`CorruptionDetected` propagate; the process exits and
the launcher tears the job down. *Roll back*: catch it on every rank and restore the last
verified checkpoint (``ReplicaDigestMonitor.last_verified_step`` says how recent that may
be); restoring lives in ``sparsecomm.checkpoint``, not here.

A hook observer that raises aborts its bucket on one rank; the other ranks then wait in
that bucket's collective until the process group times out. Wrap ``backward()`` in a
try/except on every rank and pass the error to ``GradientAgreementMonitor.check(step,
local_error=...)``: on a vote step every rank then raises together and no rank commits the
step (between votes the error is raised on its own rank, and the others see their
collective fail; ``every=1`` makes every step a vote). The DDP process group is unusable
after such an abort (stop or rebuild the job).

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
