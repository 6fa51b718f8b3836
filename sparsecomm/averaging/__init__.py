"""Averaging the weights instead of the gradients: local steps with a sparse outer sync."""
from sparsecomm.averaging.sparse_delta import SparseDeltaAverager
from sparsecomm.averaging.sync_guard import NonFiniteSyncError

__all__ = ["NonFiniteSyncError", "SparseDeltaAverager"]
