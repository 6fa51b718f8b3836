"""The alpha-beta formulas of collectives: seconds and bytes of one exchange on a link.

A link is a rate (bytes/s) and a per-message latency ``alpha_s``. The hook's
``exchange="auto"`` picks each bucket's exchange with these, and the lab's cost model
(:mod:`sparsecomm.lab.costmodel`) projects whole runs with them; they need nothing but
the standard library.
"""
import math


def ring_allreduce_bytes(nbytes: int, p: int) -> int:
    """Bytes a ring allreduce of ``nbytes`` brings into each rank: 2 (p-1)/p x nbytes (rounded)."""
    return round(2 * (p - 1) * nbytes / p)


def ring_allreduce_seconds(nbytes: float, p: int, *, rate_bytes_per_s: float, alpha_s: float,
                           collectives: float = 1) -> float:
    """Ring allreduce of ``nbytes`` over ``p`` workers, split into ``collectives`` messages' worth of latency."""
    return 2 * (p - 1) * alpha_s * collectives + 2 * (p - 1) / p * nbytes / rate_bytes_per_s


def ring_allgather_seconds(nbytes_per_rank: float, p: int, *, rate_bytes_per_s: float, alpha_s: float,
                           collectives: float = 1) -> float:
    """Ring allgather of ``nbytes_per_rank`` from each of ``p`` workers."""
    return (p - 1) * alpha_s * collectives + (p - 1) * nbytes_per_rank / rate_bytes_per_s


def owner_exchange_seconds(nbytes_per_rank: float, p: int, *, rate_bytes_per_s: float, alpha_s: float,
                           collectives: float = 1) -> float:
    """The owner exchange (``exchange="owner"``) of a payload of ``nbytes_per_rank``: an
    all-to-all sending each of the p-1 other owners its 1/p (pairwise: p-1 messages), then
    a ring all-gather of the owners' replies, 1/p of a payload each. Per rank about
    2 (p-1)/p payloads cross the link whatever p is: the cost of a ring allreduce of the
    payload."""
    share = nbytes_per_rank / p
    scatter = (p - 1) * alpha_s * collectives + (p - 1) * share / rate_bytes_per_s
    return scatter + ring_allgather_seconds(share, p, rate_bytes_per_s=rate_bytes_per_s, alpha_s=alpha_s,
                                            collectives=collectives)


def broadcast_seconds(nbytes: float, p: int, *, rate_bytes_per_s: float, alpha_s: float) -> float:
    """Broadcast of ``nbytes`` from one rank along a binomial tree: ceil(log2 p) rounds."""
    return math.ceil(math.log2(p)) * (alpha_s + nbytes / rate_bytes_per_s) if p > 1 else 0.0


def exchange_bytes_received(exchange: str, payload_bytes: float, dense_bytes: float, p: int) -> float:
    """Bytes one rank takes in per bucket: ``dense`` (ring allreduce of the buffer),
    ``allgather`` (every other rank's payload), ``owner`` (the p-1 messages for its range,
    then the p-1 other replies, each 1/p of a payload)."""
    if exchange == "dense":
        return 2 * (p - 1) / p * dense_bytes
    if exchange == "allgather":
        return (p - 1) * payload_bytes
    if exchange == "owner":
        return 2 * (p - 1) * payload_bytes / p
    raise ValueError(f"exchange must be 'dense', 'allgather' or 'owner', got {exchange!r}")


def falls_back_to_dense(sparse_bytes_per_rank: float, dense_bytes: float, p: int) -> bool:
    """The hook's dense-fallback rule: allreduce densely when p payloads together are not
    smaller than the buffer (every wire asks it: ``sparsecomm.hooks.wires``; a wire whose
    traffic does not grow with p passes p = 1 and the bytes one rank moves)."""
    return p * sparse_bytes_per_rank >= dense_bytes


def unpack_seconds(k_per_rank: float, p: int, adds_per_s: float) -> float:
    """Scatter-adding ``p`` gathered payloads of ``k_per_rank`` entries each."""
    return p * k_per_rank / adds_per_s
