"""Checkpoint errors: all subclasses of Exception (unlike DCP's CheckpointException, a
BaseException that ``except Exception`` does not catch)."""
from sparsecomm.errors import SparsecommError


class CheckpointError(SparsecommError):
    """Base class of checkpoint errors."""


class CheckpointRefused(CheckpointError):
    """Saving now would not capture one consistent cut (or would overwrite a checkpoint)."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint failed verification: checksum, structure or semantic fingerprint."""


class CheckpointMismatch(CheckpointError):
    """A checkpoint belongs to another job shape or configuration (world size, config hash)."""


class NoCheckpoint(CheckpointError):
    """No committed checkpoint where one was required."""
