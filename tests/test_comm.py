"""The transports' Futures report failed collectives instead of handing back stale buffers."""
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from rank_processes import run_on_ranks
from sparsecomm.comm import allgather_future

pytestmark = pytest.mark.timeout(60)


def _one_rank_skips(rank, world_size):
    group = dist.new_group(timeout=timedelta(seconds=2))
    dist.barrier(group=group)  # both ranks finished connecting before rank 1 walks away
    out = torch.full((world_size * 4,), 7, dtype=torch.uint8)  # "stale" bytes from an earlier step
    if rank == 1:
        return "skipped"
    try:
        allgather_future(out, torch.zeros(4, dtype=torch.uint8), group).wait()
    except RuntimeError as error:
        return f"raised: {type(error).__name__}"
    return "returned stale bytes"


def test_a_timed_out_allgather_raises_instead_of_returning_the_old_buffer():
    # Regression: the Future used to complete with `out` without reading the collective's
    # result, so a timed-out all-gather silently reused the previous step's payloads.
    assert run_on_ranks(_one_rank_skips) == ["raised: RuntimeError", "skipped"]


def test_the_mpi_transport_stops_when_its_last_reference_goes_on_its_progress_thread():
    """A callback the progress thread ran (the hook's decode, holding its wire context) can drop
    the transport's last reference there: the finalizer then runs on that thread, which must
    not join itself ("cannot join current thread", then an abort at interpreter exit)."""
    import queue
    import threading

    from sparsecomm.comm import mpi_allgatherv

    requests, errors = queue.SimpleQueue(), []

    def progress_thread_dropping_the_last_reference():
        try:
            mpi_allgatherv._stop(requests, threading.current_thread())
        except Exception as error:  # noqa: BLE001  (what the finalizer would raise, reported here)
            errors.append(error)

    thread = threading.Thread(target=progress_thread_dropping_the_last_reference)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive() and errors == []
    assert requests.get_nowait() is None  # the sentinel that stops the progress loop was sent
