"""One FSDP module's shard buffer, handed to :func:`sparsecomm.topk_hook` as DDP hands it a
bucket, and the count that tells the hook which module's buffer closes a step."""
import torch


class ShardBucket:
    """What :func:`~sparsecomm.topk_hook` reads of a ``dist.GradBucket``: the flat buffer
    (reduced in place), its index (the module's position in the model, alike on every rank),
    whether it is the step's last, and its "parameters": one placeholder tensor of the
    buffer's size, whose name keys the module's memories."""

    __slots__ = ("_buffer", "_index", "_placeholder", "_last")

    def __init__(self, buffer: torch.Tensor, index: int, placeholder: torch.Tensor, last: bool):
        self._buffer, self._index, self._placeholder, self._last = buffer, index, placeholder, last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def parameters(self) -> list[torch.Tensor]:
        return [self._placeholder]


class ShardArrivals:
    """Which modules have reduced in the current step. FSDP calls the hook once per module
    per step; the step closes (the hook's ``is_last``) when every module has. A module that
    reduces twice before that means a step in which some module reduced nothing (all its
    parameters unused), which the hook cannot see from inside a call: refused by name."""

    __slots__ = ("names", "arrived")

    def __init__(self, names: list[str]):
        self.names = names
        self.arrived: set[int] = set()

    def arrive(self, index: int) -> bool:
        """Record module ``index``; True when it is the step's last."""
        if index in self.arrived:
            missing = [self.names[i] or "<root>" for i in range(len(self.names)) if i not in self.arrived]
            raise RuntimeError(
                f"FSDP module {self.names[index] or '<root>'!r} reduced its gradients twice in one step while "
                f"{missing} did not: the HSDP hook needs every FSDP module to reduce once per step (a module whose "
                "parameters all went unused reduces nothing; give it no fully_shard of its own, or use it every step)"
            )
        self.arrived.add(index)
        if len(self.arrived) < len(self.names):
            return False
        self.arrived = set()
        return True
