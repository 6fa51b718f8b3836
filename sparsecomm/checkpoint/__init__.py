"""Consistent, verified checkpoints of a DDP job with per-rank error-feedback state."""
from sparsecomm.checkpoint.background import PendingSave
from sparsecomm.checkpoint.bucket_rebuild import rebuild_buckets
from sparsecomm.checkpoint.errors import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointMismatch,
    CheckpointRefused,
    NoCheckpoint,
)
from sparsecomm.checkpoint.manager import CheckpointManager, LoadedCheckpoint, committed_steps, step_directory

__all__ = [
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointMismatch",
    "CheckpointRefused",
    "LoadedCheckpoint",
    "NoCheckpoint",
    "PendingSave",
    "committed_steps",
    "rebuild_buckets",
    "step_directory",
]
