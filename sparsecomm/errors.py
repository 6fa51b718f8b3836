"""Exceptions sparsecomm raises for conditions that are not bad arguments."""


class SparsecommError(Exception):
    """Base class of sparsecomm's own errors."""


class ConservationError(SparsecommError):
    """Error feedback lost or invented gradient mass: ``sent + residual != grad/ws + old_residual``."""


class WireIntegrityError(SparsecommError):
    """A payload received on a sparse wire does not match the checksum its sender sealed it with."""
