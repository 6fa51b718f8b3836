"""Transports: the collectives the hooks issue, each returning a Future.

``collectives``: c10d (gloo/NCCL) allreduce and fixed-size all-gather.
``mpi_allgatherv``: variable-size all-gather over MPI; mpi4py is optional and imported
only when an :class:`MPIAllgatherv` is built, so importing this package never starts MPI.
"""
from sparsecomm.comm.collectives import allgather_future, allreduce_future
from sparsecomm.comm.mpi_allgatherv import TRANSPORTS, MPIAllgatherv

__all__ = ["MPIAllgatherv", "TRANSPORTS", "allgather_future", "allreduce_future"]
