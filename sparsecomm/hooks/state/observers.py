"""The hook's observers: callables that receive a :class:`~sparsecomm.hooks.state.events.HookEvent`
at every step of every bucket (monitors, fault injectors, tests)."""
import torch.distributed as dist

from sparsecomm.hooks.state.events import HookEvent


class Observers:
    """The observers of one :class:`~sparsecomm.TopKState` (they belong to this process: a
    pickle leaves them behind)."""

    __slots__ = ("callbacks", "rank")

    def __init__(self):
        self.callbacks = []
        self.rank = None  # this process's rank in the hook's group, cached by the first event

    def __len__(self) -> int:
        return len(self.callbacks)

    def __getitem__(self, index):
        return self.callbacks[index]

    def add(self, observer) -> None:
        if not callable(observer):
            raise TypeError(f"observer must be callable, got {type(observer).__name__}")
        self.callbacks.append(observer)

    def remove(self, observer) -> None:
        self.callbacks.remove(observer)

    def need_acc(self) -> bool:
        """Does any observer read acc at the ``packed`` stage (so the kernel may not fuse it away)?"""
        return any(getattr(observer, "needs_acc", True) for observer in self.callbacks)

    def emit(self, state, stage, bucket, names, numels, dense, step=None, layout=None, **tensors) -> None:
        if not self.callbacks:
            return
        if self.rank is None:
            self.rank = dist.get_rank(state.group())
        step = state.step if step is None else step
        event = HookEvent(stage, step, self.rank, bucket.index(), names, numels, dense, tensors, layout)
        for observer in self.callbacks:
            observer(event)
