"""The hook's per-rank memories: the error-feedback residuals, the momentum-correction
velocities and the owner exchange's second-level residuals, each keyed by parameter name
(:class:`~sparsecomm.hooks.parameter_memory.ParameterMemory`), and the float32 scratch in
which a 16-bit bucket's acc is formed."""
import torch

from sparsecomm.hooks.parameter_memory import ParameterMemory


class HookMemories:
    __slots__ = ("residuals", "velocities", "owner_residuals", "owner_ranges", "scratch")

    def __init__(self):
        self.residuals = ParameterMemory()  # error feedback
        self.velocities = ParameterMemory()  # momentum correction (DGC)
        self.owner_residuals = ParameterMemory()  # exchange="owner": what an owner did not send on
        # bucket index -> (names, numels, owned range, world size) the owner memory is folded for
        self.owner_ranges: dict[int, tuple] = {}
        self.scratch = None  # float32 scratch of the largest 16-bit bucket (wide memories), or None

    def all(self) -> tuple[ParameterMemory, ParameterMemory, ParameterMemory]:
        return self.residuals, self.velocities, self.owner_residuals

    def clear(self) -> None:
        for memory in self.all():
            memory.clear()
        self.owner_ranges = {}

    def scale_(self, factor: float) -> None:
        for memory in self.all():
            memory.scale_(factor)

    def wide_copy(self, buffer: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``buffer`` converted to ``dtype`` in the shared scratch (used within one hook call only)."""
        scratch = self.scratch
        if scratch is None or scratch.numel() < buffer.numel() or scratch.dtype != dtype or scratch.device != buffer.device:
            size = max(buffer.numel(), 0 if scratch is None else scratch.numel())
            self.scratch = torch.empty(size, dtype=dtype, device=buffer.device)
        wide = self.scratch[: buffer.numel()]
        wide.copy_(buffer)
        return wide
