"""Variable-size all-gather over MPI (mpi4py ``Iallgatherv``), returned as a torch Future.

Why a second transport: c10d's all-gather needs the same size from every rank, so a
payload whose length differs per rank (a threshold selection sends what passes the
threshold) must be padded to a common capacity. ``MPI_Iallgatherv`` takes one count per
rank and lays the payloads out back to back, in rank order.

How it works:

* The tensors' memory is handed to MPI as numpy views (zero copy); CPU tensors only.
  A non-CUDA-aware MPI (the ``mpich`` wheel) cannot read GPU memory.
* One progress thread per transport takes the requests in issue order and completes each
  request's Future when MPI reports it done. It polls with ``MPI_Test`` and a short,
  growing sleep instead of blocking in ``MPI_Wait``, because MPICH's blocking wait
  busy-polls a whole core, and on a machine with one core per rank that core is the
  training's. Needs ``MPI_THREAD_MULTIPLE`` (mpi4py asks for it by default).
* The collectives run on a duplicate of ``COMM_WORLD``, so they never match a user's own
  MPI traffic.

Issue every call from the hook body, in bucket order (docs/architecture.md, "Rules"): MPI, like gloo,
requires all ranks to issue collectives on a communicator in the same order. When the
counts are not known in advance, :meth:`MPIAllgatherv.allgather_counts` exchanges them
first; it blocks until every rank has reached it (a small collective, issued from the
hook body as well).
"""
import queue
import threading
import time
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist

TRANSPORTS = ("c10d", "mpi")
# Polling interval of the progress thread: starts short (a request that completes soon
# after issue is delivered within tens of microseconds) and doubles up to the cap, which
# bounds the delay after a late peer arrives.
_POLL_FIRST_S = 20e-6
_POLL_MAX_S = 500e-6


def import_mpi():
    """``mpi4py.MPI``, initialised with ``MPI_THREAD_MULTIPLE``; else a RuntimeError saying why."""
    try:
        from mpi4py import MPI
    except ImportError as error:
        raise RuntimeError(
            f"transport='mpi' needs mpi4py and an MPI library ({error}): pip install mpi4py mpich "
            "(or sparsecomm[mpi]); accepted transports: " + ", ".join(map(repr, TRANSPORTS))
        ) from None
    provided = MPI.Query_thread()
    if provided < MPI.THREAD_MULTIPLE:
        names = {MPI.THREAD_SINGLE: "SINGLE", MPI.THREAD_FUNNELED: "FUNNELED", MPI.THREAD_SERIALIZED: "SERIALIZED"}
        raise RuntimeError(
            f"transport='mpi' needs MPI_THREAD_MULTIPLE (a progress thread completes requests), but MPI "
            f"was initialised with MPI_THREAD_{names.get(provided, provided)}: do not set "
            "mpi4py.rc.thread_level below 'multiple' before importing mpi4py.MPI"
        )
    return MPI


def check_matches_process_group(group: dist.ProcessGroup, comm, *, compare_ranks: bool = True) -> None:
    """Raise ValueError unless ``group`` is the default group and ``comm`` ranks it the same way.

    Every rank reaches the same verdict: the group and the sizes are the same everywhere,
    and the rank mapping is compared after an all-gather over ``comm`` (a collective:
    skipped with ``compare_ranks=False``).
    """
    world = dist.get_world_size()
    if group is not dist.group.WORLD:
        members = dist.get_process_group_ranks(group)
        raise ValueError(
            f"transport='mpi' runs on MPI COMM_WORLD and needs the default process group; got another group "
            f"(global ranks {members[:8]}{'...' if len(members) > 8 else ''}): pass process_group=None, "
            "or use transport='c10d' with other groups"
        )
    if comm.Get_size() != world:
        raise ValueError(
            f"transport='mpi': MPI COMM_WORLD has {comm.Get_size()} process(es) but the process group has "
            f"{world}: launch with mpiexec -n {world} (torchrun does not start MPI), or use transport='c10d'"
        )
    if not compare_ranks:
        return
    ranks = comm.allgather(dist.get_rank())
    if ranks != list(range(world)):
        raise ValueError(
            f"transport='mpi': the torch ranks of MPI ranks 0..{world - 1} are {ranks}; they must be equal "
            "(initialise torch.distributed from the MPI ranks, e.g. sparsecomm.dist.init_distributed), "
            "or use transport='c10d'"
        )


class MPIAllgatherv:
    """All-gather of variable-size CPU tensors over MPI, completed by one progress thread.

    Args:
        comm: the communicator to duplicate (default ``MPI.COMM_WORLD``). Duplicating is a
            collective: build the transport on every rank at the same point.

    Example::
        >>> # xdoctest: +SKIP
        >>> transport = MPIAllgatherv()
        >>> counts = transport.allgather_counts(send.numel())
        >>> fut = transport.allgatherv(send, recv, counts)  # recv[:sum(counts)] when done
    """

    def __init__(self, comm=None):
        MPI = import_mpi()
        self._MPI = MPI
        self.comm = (comm or MPI.COMM_WORLD).Dup()
        self.rank = self.comm.Get_rank()
        self.world_size = self.comm.Get_size()
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=_progress, args=(self._requests,), name="sparsecomm-mpi-progress",
                                        daemon=True)
        self._thread.start()
        self._closed = False
        # Runs at close(), garbage collection or interpreter exit (weakref's atexit hook),
        # which comes before mpi4py finalises MPI (a C-level exit handler).
        self._finalizer = weakref.finalize(self, _stop, self._requests, self._thread)

    def allgather_counts(self, count: int) -> list[int]:
        """Every rank's ``count``, in rank order. Blocks until all ranks have called it."""
        return [int(c) for c in self.comm.allgather(int(count))]

    def allgatherv(self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int]) -> torch.futures.Future:
        """Gather rank r's ``send`` (``counts[r]`` elements) into ``recv``, back to back in rank order.

        ``recv`` needs at least ``sum(counts)`` elements; the Future holds
        ``recv[:sum(counts)]``. Both tensors must stay untouched until the Future completes
        (they are shared with MPI, not copied).
        """
        if self._closed:
            raise RuntimeError("MPIAllgatherv.allgatherv after close()")
        counts = [int(c) for c in counts]
        if len(counts) != self.world_size:
            raise ValueError(f"counts must have one entry per rank ({self.world_size}), got {len(counts)}")
        if counts[self.rank] != send.numel():
            raise ValueError(f"counts[{self.rank}]={counts[self.rank]} but this rank sends {send.numel()} elements")
        total = sum(counts)
        for name, tensor in (("send", send), ("recv", recv)):
            if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.dim() != 1:
                raise ValueError(f"{name} must be a contiguous 1-D CPU tensor (MPI reads host memory), got "
                                 f"{tuple(tensor.shape)} on {tensor.device}")
        if recv.dtype != send.dtype:
            raise ValueError(f"recv dtype {recv.dtype} differs from send dtype {send.dtype}")
        if recv.numel() < total:
            raise ValueError(f"recv holds {recv.numel()} elements, the counts add up to {total}")
        itemsize = send.element_size()
        byte_counts = [c * itemsize for c in counts]
        displacements = [0] * self.world_size
        for r in range(1, self.world_size):
            displacements[r] = displacements[r - 1] + byte_counts[r - 1]
        # Byte views: zero copy, and dtypes numpy lacks (bfloat16) travel as raw bytes.
        send_bytes = _byte_view(send)
        recv_bytes = _byte_view(recv)
        MPI = self._MPI
        request = self.comm.Iallgatherv([send_bytes, MPI.BYTE], [recv_bytes, (byte_counts, displacements), MPI.BYTE])
        future = torch.futures.Future()
        # The tensors ride along so their memory outlives the request.
        self._requests.put((request, future, recv.narrow(0, 0, total), (send, send_bytes, recv_bytes)))
        return future

    def alltoallv(self, send: torch.Tensor, recv: torch.Tensor, send_counts: Sequence[int],
                  recv_counts: Sequence[int]) -> None:
        """Blocking all-to-all of bytes (the owner exchange): ``send_counts[r]`` bytes of the
        uint8 ``send``, back to back in rank order, go to rank r; ``recv_counts[r]`` bytes
        from rank r land in ``recv`` in rank order. Requests still in flight (all-gathers
        issued earlier) keep completing on the progress thread meanwhile."""
        if self._closed:
            raise RuntimeError("MPIAllgatherv.alltoallv after close()")
        send_counts, recv_counts = [int(c) for c in send_counts], [int(c) for c in recv_counts]
        if len(send_counts) != self.world_size or len(recv_counts) != self.world_size:
            raise ValueError(f"send_counts and recv_counts must have one entry per rank ({self.world_size})")
        for name, tensor, counts in (("send", send, send_counts), ("recv", recv, recv_counts)):
            if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.dtype != torch.uint8:
                raise ValueError(f"{name} must be a contiguous uint8 CPU tensor (MPI reads host memory), got "
                                 f"{tensor.dtype} on {tensor.device}")
            if tensor.numel() < sum(counts):
                raise ValueError(f"{name} holds {tensor.numel()} bytes, its counts add up to {sum(counts)}")

        def displacements(counts):
            return [sum(counts[:r]) for r in range(len(counts))]

        MPI = self._MPI
        self.comm.Alltoallv([_byte_view(send), (send_counts, displacements(send_counts)), MPI.BYTE],
                            [_byte_view(recv), (recv_counts, displacements(recv_counts)), MPI.BYTE])

    def close(self) -> None:
        """Finish the requests in flight, stop the progress thread and free the communicator."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()
        if not self._MPI.Is_finalized():
            self.comm.Free()


def _byte_view(tensor: torch.Tensor):
    return tensor.detach().view(torch.uint8).numpy()


def _progress(requests: queue.SimpleQueue) -> None:
    """Complete each request's Future, in issue order, until the None sentinel."""
    while True:
        item = requests.get()
        if item is None:
            return
        request, future, result, _keepalive = item
        try:
            pause = _POLL_FIRST_S
            while not request.Test():
                time.sleep(pause)
                pause = min(2 * pause, _POLL_MAX_S)
        except Exception as error:  # MPI errors surface in the Future, like a failed c10d collective
            future.set_exception(RuntimeError(f"MPI Iallgatherv failed: {error}"))
        else:
            # Callbacks chained with .then() (the hook's unpack) run here, on this thread.
            future.set_result(result)


def _stop(requests: queue.SimpleQueue, thread: threading.Thread) -> None:
    requests.put(None)
    # The last reference to the transport may go on the progress thread itself: a callback it
    # ran (the hook's decode holds its wire context, and so the transport) is released there.
    # That thread stops at the sentinel on its own; joining it from itself would raise.
    if thread is not threading.current_thread():
        thread.join()
