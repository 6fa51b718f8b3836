"""Optimizers for sparse synchronisation: :class:`AdamS` (Adam without the second moment)."""
from sparsecomm.optim.adams import AdamS

__all__ = ["AdamS"]
