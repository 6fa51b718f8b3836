"""Stage 5: the collective that carries a bucket's packed entries, issued in the hook body.

Issued here, in bucket order, never from a Future callback: callbacks run on other
threads in any order, and gloo fails or hangs when ranks issue collectives in different
orders. A transport that needs two collectives (the sizes, then the payloads) issues both
here. Returns the future of what arrives and the bytes this rank takes in.
"""
from sparsecomm.comm import allgather_future, allreduce_future
from sparsecomm.compress.layout import PayloadLayout
from sparsecomm.hooks.pipeline.integrity import trailer_bytes


def ring_bytes(nbytes: int, world_size: int) -> int:
    """Bytes a ring allreduce of ``nbytes`` brings into each rank: 2 (p-1)/p x nbytes."""
    return round(2 * (world_size - 1) * nbytes / world_size)


def allgather_fixed(call, packed, gathered):
    """Every rank's equal-size payload (sealed: ``packed.wire``), in rank order (c10d all-gather
    or MPI Iallgatherv)."""
    state, nbytes = call.state, packed.wire.numel()
    if state.config.transport == "mpi":  # same bytes as c10d, so the same result bit for bit
        fut = state._mpi.allgatherv(packed.wire, gathered, [nbytes] * call.world_size)
    else:
        fut = allgather_future(gathered, packed.wire, call.group)
    return fut, (call.world_size - 1) * nbytes


def allgather_variable(call, packed, gathered):
    """Payloads of a different size per rank over MPI: the sizes first (blocking, here in the
    hook body), then the payloads back to back in rank order. Returns (future, entries per
    rank, bytes received)."""
    import time

    state = call.state
    exchange_started = time.perf_counter()
    counts = state._mpi.allgather_counts(packed.count)
    state._count(seconds_count_exchange=time.perf_counter() - exchange_started)
    trailer = trailer_bytes(state.config)
    byte_counts = [PayloadLayout(count, call.value_dtype).nbytes + trailer for count in counts]
    fut = state._mpi.allgatherv(packed.wire, gathered, byte_counts)
    return fut, counts, sum(byte_counts) - packed.wire.numel()


def allreduce_values(call, packed):
    """Random-k and the shared-index exchange: the values are summed (every rank sent the same
    indices). A sum is no rank's payload: nothing to seal."""
    nbytes = packed.send.numel() * packed.send.element_size()
    return allreduce_future(packed.send, call.group), ring_bytes(nbytes, call.world_size)
