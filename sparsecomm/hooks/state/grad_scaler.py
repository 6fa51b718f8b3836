"""Keep error-feedback memories in the units of a ``torch.amp.GradScaler``'s current scale.

With a scaler the hook sees gradients multiplied by the loss scale S. Its residual and
velocity hold scaled gradient too, so when the scaler changes S (halving after an
overflow, doubling after ``growth_interval`` clean steps) the memories must change by the
same factor: otherwise the next step adds residual in units of the old S to gradient in
units of the new one, and the unscaled update is off by that factor. The scaler's factors
are powers of two by default, so the rescale is exact (barring under- or overflow).

The scale is read once per step, when its first bucket arrives, after ``scaler.update()``
of the previous step. On a GPU that read is a synchronisation (``GradScaler.get_scale``
calls ``.item()``).
"""


class ScaleTracker:
    """The scale the memories are expressed in, and the scaler that sets it."""

    def __init__(self, scaler) -> None:
        if not callable(getattr(scaler, "get_scale", None)):
            raise TypeError(
                f"grad_scaler must be a torch.amp.GradScaler (anything with get_scale()), got {type(scaler).__name__}"
            )
        self.scaler = scaler
        self.memory_scale: float | None = None  # None until the first step: memories are empty

    def current(self) -> float:
        return float(self.scaler.get_scale())

    def decreased(self) -> bool:
        """True if the scaler lowered its scale since the memories were last synced: it
        found an overflow and skipped the step (GradScaler only ever lowers it then)."""
        return self.memory_scale is not None and self.current() < self.memory_scale

    def factor(self) -> float | None:
        """The factor that brings the memories to the current scale, or None if none is needed."""
        scale = self.current()
        if self.memory_scale is None or scale == self.memory_scale:
            self.memory_scale = scale
            return None
        factor, self.memory_scale = scale / self.memory_scale, scale
        return factor
