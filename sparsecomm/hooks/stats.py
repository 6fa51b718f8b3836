"""Counters of what the top-k hook did: since construction, and for the last finished step.

A step's view closes when its last bucket has been delivered (every collective of the
step completed), so it holds whole steps only. Counters are per rank: bytes are what this
rank put on or took off the wire.
"""
COUNTERS = (
    "sparse_calls",  # bucket reductions that went sparse
    "warmup_calls",  # dense because the step was inside warm-up
    "fallback_calls",  # dense because the sparse payload would not have been smaller
    "sparse_gradient_calls",  # buckets of sparse (torch.sparse) gradients, allreduced as DDP does
    "fused_calls",  # sparse calls where the fused kernel computed acc itself (the fast path)
    "elements_total",  # gradient elements reduced, all calls
    "elements_sparse",  # gradient elements in sparse calls
    "elements_sent",  # elements this rank put on the wire in sparse calls
    "bytes_dense",  # bytes a dense allreduce would have taken from this rank
    "bytes_sent",  # bytes this rank actually contributed (payload or dense buffer)
    "bytes_received",  # bytes of other ranks' data this rank took in (see TopKState.stats)
    "bytes_budget",  # bytes of budget="model"'s counts all-reduce (also in bytes_sent)
    "seconds_select_pack",  # host time: error feedback + selection + packing
    "seconds_unpack",  # host time: scatter-add of the gathered payloads
    "seconds_wire_checksum",  # host time checking received payloads (wire_checksum; sealing: in select_pack)
    "seconds_count_exchange",  # host time blocked exchanging payload sizes (transport="mpi", sampled)
    "allgather_calls",  # sparse calls whose payloads were all-gathered (every selector but random-k)
    "owner_calls",  # sparse calls that went through range owners (exchange="owner")
    "seconds_owner_scatter",  # host time blocked in the owner exchange's all_to_all_single
    "seconds_owner_reduce",  # host time of the owner's decode + sum + select + encode
    "shared_index_calls",  # sparse calls on the leader's index set (exchange="shared-index")
    "seconds_index_broadcast",  # host time blocked in the shared-index exchange's broadcast
    "shared_mask_calls",  # sparse calls on the mask every rank derives alike (exchange="shared-mask")
    "skipped_steps",  # steps undone in the hook's memory (overflow, or skip_step())
    "unused_restored",  # parameters whose sent entries went back to the residual (unused by every rank)
)


class HookStats:
    """Running totals plus the counters of the step in progress and of the last finished one."""

    def __init__(self, totals: dict | None = None):
        self.totals = dict.fromkeys(COUNTERS, 0) | (totals or {})
        self.totals["residual_reset"] = bool(self.totals.get("residual_reset", False))
        self._current = dict.fromkeys(COUNTERS, 0)
        self.last_step: dict | None = None

    def count(self, **increments) -> None:
        for name, value in increments.items():
            self.totals[name] += value
            self._current[name] += value

    def close_step(self, step: int) -> None:
        """The step ``step`` (0-based) is finished: its counters become ``last_step``."""
        self.last_step = {"step": step, **self._current}
        self._current = dict.fromkeys(COUNTERS, 0)
