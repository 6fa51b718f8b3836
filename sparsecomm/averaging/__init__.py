"""Averaging the weights instead of the gradients: local steps with a sparse outer sync."""
from sparsecomm.averaging.sparse_delta import SparseDeltaAverager

__all__ = ["SparseDeltaAverager"]
