"""Transports: the collectives the hooks issue, each returning a Future."""
from sparsecomm.comm.collectives import allgather_future, allreduce_future

__all__ = ["allgather_future", "allreduce_future"]
