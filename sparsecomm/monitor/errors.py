"""What the monitors raise.

:class:`CorruptionDetected` means "the numbers can no longer be trusted": a replica
disagrees, a gradient is not finite, an update is implausibly large. The policy action is
*stop* (let it propagate: the job ends, torchrun or the scheduler restarts it) or *roll
back* (catch it on every rank and restore the last verified checkpoint; see
:attr:`ReplicaDigestMonitor.last_verified_step`). Both start from the same exception.

Each error carries the check that fired, the step, the suspect ranks and a human-readable
detail, as attributes, so a caller can log or route them without parsing the message. The
errors pickle with all their fields (they cross process boundaries in tests and launchers).
"""
from sparsecomm.errors import SparsecommError


class CorruptionDetected(SparsecommError):
    """A monitor found evidence of silent data corruption.

    Attributes:
        check: name of the check that fired (``"replica_digest"``, ``"gradient_agreement"``,
            ``"finite"``, ``"update_spike"``, ...).
        step: the training step (hook step counter or the caller's step) it fired at.
        ranks: suspect ranks, in ascending order; may be empty when no rank can be blamed.
        detail: what was seen, for the log.
    """

    def __init__(self, check: str, step: int, ranks=(), detail: str = ""):
        self.check = check
        self.step = step
        self.ranks = tuple(sorted(int(r) for r in ranks))
        self.detail = detail
        super().__init__(f"{check} check failed at step {step}; suspect ranks {list(self.ranks)}: {detail}")

    def __reduce__(self):
        # Exception pickling re-calls __init__ with self.args (the message only); pass the
        # fields instead and restore any extra attributes of subclasses from __dict__.
        return (_rebuild, (type(self), self.check, self.step, self.ranks, self.detail), self.__dict__)


class NonFiniteError(CorruptionDetected):
    """A NaN or Inf in a gradient, an error-feedback residual or a payload.

    Extra attributes (None when unknown): ``stage`` (hook stage), ``bucket_index``,
    ``tensor`` (``"gradient"``, ``"acc"``, ``"residual"`` or ``"payload"``), ``parameter``
    (name of the first parameter holding a bad entry), ``element`` (its flat index inside
    that parameter) and ``count`` (number of bad entries in the tensor).
    """

    def __init__(self, check: str = "finite", step: int = -1, ranks=(), detail: str = "", **where):
        for key in ("stage", "bucket_index", "tensor", "parameter", "element", "count"):
            setattr(self, key, where.pop(key, None))
        if where:
            raise TypeError(f"NonFiniteError: unexpected fields {sorted(where)}")
        super().__init__(check, step, ranks, detail)


class StalenessExceeded(SparsecommError):
    """An error-feedback residual entry waited longer than the policy's staleness limit.

    Not corruption: the run is still correct arithmetic, but it no longer satisfies the
    signed policy. Raised only by ``StalenessMonitor(action="raise")``; by default the
    monitor marks the run unverified instead.
    """


def _rebuild(cls, check, step, ranks, detail):
    error = cls.__new__(cls)
    CorruptionDetected.__init__(error, check, step, ranks, detail)
    return error
