"""Undo one step's changes to the hook's memories, when the training loop skipped it.

A loop that skips a step (``torch.amp.GradScaler`` after an overflow, or a loop that
checks ``isfinite`` itself) leaves the weights and the optimizer as they were. Plain DDP
has nothing else to undo. The hook does: it already folded that step's gradient into the
error-feedback residual and the momentum velocity, and it took out the entries it sent. To
leave the hook as plain DDP would be, every bucket's memories are copied before the hook
changes them; when the step turns out to be skipped, the copies go back, and so does the
sampled selector's random stream (it draws every step).

Cost: one copy of the residual (and of the velocity with momentum correction) in memory,
and one copy pass over them per step. The copies are allocated once per bucket layout.
"""
import torch


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
