"""Exceptions sparsecomm raises for conditions that are not bad arguments."""


class SparsecommError(Exception):
    """Base class of sparsecomm's own errors."""


class ConservationError(SparsecommError):
    """Error feedback lost or invented gradient mass: ``sent + residual != grad/ws + old_residual``."""


class WireIntegrityError(SparsecommError):
    """A payload received on a sparse wire does not match the checksum its sender sealed it with."""


class NonFiniteSyncError(SparsecommError):
    """An outer sync would have put Inf or NaN into the weights; refused on every rank alike.

    Nothing changed: the weights, the anchor, the error buffer and the step count are those
    of before the ``step()`` call that raised. ``ranks``: the ranks whose payload held a
    non-finite value (empty when every payload was finite and their mean, or the outer step,
    overflowed float32); ``step``: the optimizer step of the sync."""

    def __init__(self, message: str, ranks: list[int], step: int):
        super().__init__(message)
        self.ranks, self.step = ranks, step
