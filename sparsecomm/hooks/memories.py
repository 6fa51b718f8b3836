"""The hook's per-rank memories: the error-feedback residuals, the momentum-correction
velocities, the owner exchange's second-level residuals and the shared-mask exchange's
rates and ages (the same on every rank: ``wires/shared_mask.py``), each keyed by parameter name
(:class:`~sparsecomm.hooks.parameter_memory.ParameterMemory`), and the float32 scratch in
which a 16-bit bucket's acc is formed."""
import torch

from sparsecomm.hooks.parameter_memory import ParameterMemory


class HookMemories:
    __slots__ = ("residuals", "velocities", "owner_residuals", "mask_rates", "mask_ages", "owner_ranges", "scratch")

    def __init__(self):
        self.residuals = ParameterMemory()  # error feedback
        self.velocities = ParameterMemory()  # momentum correction (DGC)
        self.owner_residuals = ParameterMemory()  # exchange="owner": what an owner did not send on
        self.mask_rates = ParameterMemory()  # exchange="shared-mask": synced gradient per step
        self.mask_ages = ParameterMemory()  # exchange="shared-mask": steps since last sent
        # bucket index -> (names, numels, owned range, world size) the owner memory is folded for
        self.owner_ranges: dict[int, tuple] = {}
        self.scratch = None  # float32 scratch of the largest 16-bit bucket (wide memories), or None

    def all(self) -> tuple[ParameterMemory, ...]:
        """The memories that hold gradients, in the grad scaler's units (the rates too; not the ages)."""
        return self.residuals, self.velocities, self.owner_residuals, self.mask_rates

    def clear(self) -> None:
        for memory in (*self.all(), self.mask_ages):
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
