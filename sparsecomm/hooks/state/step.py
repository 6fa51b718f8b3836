"""What the hook keeps about its steps: where it is in the step (:class:`StepLifecycle`), what it
counted (:class:`HookStats`), and what it can undo (:class:`StepJournal`).

**Counters** (:data:`COUNTERS`): since construction, and for the last finished step. A step's view
closes when its last bucket has been delivered (every collective of the step completed), so it
holds whole steps only. Counters are per rank: bytes are what this rank put on or took off the
wire.

**The journal** undoes one step's changes to the hook's memories, when the training loop skipped
it. A loop that skips a step (``torch.amp.GradScaler`` after an overflow, or a loop that checks
``isfinite`` itself) leaves the weights and the optimizer as they were. Plain DDP has nothing else
to undo. The hook does: it already folded that step's gradient into the error-feedback residual
and the momentum velocity, and it took out the entries it sent. To leave the hook as plain DDP
would be, every bucket's memories are copied before the hook changes them; when the step turns
out to be skipped, the copies go back, and so does the sampled selector's random stream (it draws
every step). Cost: one copy of the residual (and of the velocity with momentum correction) in
memory, and one copy pass over them per step. The copies are allocated once per bucket layout.
"""

import torch


class StepLifecycle:
    __slots__ = ("pending", "open", "settled", "agreed", "bypass", "fallback_bound", "warned_all_dense")

    def __init__(self):
        self.pending = 0  # collectives issued whose result has not been delivered yet
        self.open = False  # a bucket of the current step arrived and its last one has not
        self.settled = True  # the last finished step's overflow, unused parameters, scale are dealt with
        self.agreed = False  # the ranks' settings were compared (first hook call)
        self.bypass = False  # True while rebuild_buckets() runs a pass that must change nothing
        self.fallback_bound = None  # largest density that would have gone sparse this step, for the warning
        self.warned_all_dense = False  # DenseFallbackWarning was given

    def note_fallback(self, density_bound: float) -> None:
        """A bucket went dense because its wire would send more: remember the density that would not."""
        self.fallback_bound = max(density_bound, self.fallback_bound or 0.0)

    def forget(self) -> None:
        """Memories were replaced: nothing of the last step is left to settle; compare the ranks again."""
        self.settled, self.open, self.agreed = True, False, False


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
    "leader_overlap_buckets",  # shared-index buckets whose leader overlap was measured (diagnose_leader_overlap)
    "leader_overlap_sum",  # their overlaps summed: |leader's index set & top k of the summed acc| / k
    "seconds_leader_overlap",  # host time of that diagnostic (its dense allreduce and top-k)
    "skipped_steps",  # steps undone in the hook's memory (overflow, or skip_step())
    "unused_restored",  # parameters whose sent entries went back to the residual (unused by every rank)
)


MEANS = {"leader_overlap": ("leader_overlap_sum", "leader_overlap_buckets")}
"""Figures kept beside the counters: name -> (the counter summed, the counter of what it sums
over); their mean, or None where nothing was counted."""


def with_means(counters: dict) -> dict:
    """``counters`` with every figure of :data:`MEANS` set from them (in place; returned)."""
    for name, (total, count) in MEANS.items():
        counters[name] = counters[total] / counters[count] if counters.get(count) else None
    return counters


class HookStats:
    """Running totals plus the counters of the step in progress and of the last finished one
    (each with the means of :data:`MEANS`: over all steps, and over the last step)."""

    def __init__(self, totals: dict | None = None):
        self.totals = with_means(dict.fromkeys(COUNTERS, 0) | (totals or {}))
        self.totals["residual_reset"] = bool(self.totals.get("residual_reset", False))
        self._current = dict.fromkeys(COUNTERS, 0)
        self.last_step: dict | None = None

    def count(self, **increments) -> None:
        for name, value in increments.items():
            self.totals[name] += value
            self._current[name] += value
        if any(count in increments for _, count in MEANS.values()):
            with_means(self.totals)

    def close_step(self, step: int) -> None:
        """The step ``step`` (0-based) is finished: its counters become ``last_step``."""
        self.last_step = with_means({"step": step, **self._current})
        self._current = dict.fromkeys(COUNTERS, 0)


class StepJournal:
    """Copies of the memories taken before the current step changed them."""

    def __init__(self) -> None:
        # bucket index -> (the live memory tensors, their copies from before this step)
        self._copies: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self._taken: set[int] = set()  # buckets copied during the current step
        # 0-d bool tensors, True where a bucket's reduced gradient was not finite. Tensors,
        # not Python bools: on a GPU reading one is a synchronisation, deferred to undo time.
        self._nonfinite: list[torch.Tensor] = []
        self.skip_requested = False  # the user called TopKState.skip_step()
        # The sampled selector's generator state before the step; None: it had none yet.
        self._generator_state: torch.Tensor | None = None

    def record(self, bucket_index: int, memories: list[torch.Tensor]) -> None:
        """Copy ``memories`` (flat tensors the hook is about to change) of one bucket."""
        cached = self._copies.get(bucket_index)
        if cached is not None and [(c.shape, c.dtype, c.device) for c in cached[1]] == [
            (m.shape, m.dtype, m.device) for m in memories
        ]:
            for copy, memory in zip(cached[1], memories):
                copy.copy_(memory)
            self._copies[bucket_index] = (list(memories), cached[1])
        else:
            self._copies[bucket_index] = (list(memories), [m.clone() for m in memories])
        self._taken.add(bucket_index)

    def note_reduced(self, nonfinite: torch.Tensor) -> None:
        """Record whether a reduced bucket of this step held a non-finite value."""
        self._nonfinite.append(nonfinite)

    def overflowed(self) -> bool:
        """True if a reduced bucket of the step held an Inf or NaN (so every rank skips it)."""
        return any(bool(flag) for flag in self._nonfinite)

    def undo(self, generator: torch.Generator | None) -> torch.Generator | None:
        """Put back every memory copied during the step; returns the sampled selector's
        generator as it was before the step (None if the undone step created it: the next
        step creates it afresh from the seed, as the run without that step would)."""
        for bucket_index in self._taken:
            memories, copies = self._copies[bucket_index]
            for memory, copy in zip(memories, copies):
                memory.copy_(copy)
        if self._generator_state is None:
            return None
        generator.set_state(self._generator_state)
        return generator

    def start_step(self, generator: torch.Generator | None = None) -> None:
        self._taken = set()
        self._nonfinite = []
        self.skip_requested = False
        self._generator_state = None if generator is None else generator.get_state()

    def forget(self) -> None:
        """Drop everything (the memories were replaced, e.g. by a checkpoint load)."""
        self._copies = {}
        self.start_step()
