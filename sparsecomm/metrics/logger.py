"""Every N optimizer steps, the hook's (or the averager's) figures into one or more sinks::

    from sparsecomm.metrics import MetricsLogger, TensorBoardSink

    state = sparsecomm.register_topk_hook(ddp_model, density=0.01)
    metrics = MetricsLogger(state, every=10, sinks=[TensorBoardSink("tb/run1")])
    for step, batch in enumerate(loader, start=1):
        ...
        optimizer.step()
        metrics.step(step)
    metrics.close()
"""
import torch.distributed as dist

from sparsecomm.hooks.state.settings import check_bool, check_int
from sparsecomm.metrics.figures import CommFigures
from sparsecomm.metrics.sinks import Sink


class MetricsLogger:
    """Writes ``prefix + name`` of every figure of :class:`~sparsecomm.metrics.CommFigures` to
    each sink at every ``every``-th step.

    Args:
        source: a :class:`~sparsecomm.TopKState` or a :class:`~sparsecomm.SparseDeltaAverager`
            (build the logger after its ``load_state_dict``, if any).
        every: write at the steps that are positive multiples of ``every`` (an integer >= 1);
            each write covers the steps since the previous one.
        sinks: one or more :class:`~sparsecomm.metrics.Sink` (``TensorBoardSink``, ``WandbSink``,
            ``CallableSink``, or your subclass).
        prefix: put before every figure's name (a str; default ``"sparsecomm/"``).
        rank_zero_only: True (default): only global rank 0 reads and writes (the figures are
            rank 0's; loggers usually live there); the other ranks' :meth:`step` does nothing.
            False: every rank writes its own figures (give each rank its own sink).
    """

    def __init__(self, source, *, every: int = 10, sinks=(), prefix: str = "sparsecomm/",
                 rank_zero_only: bool = True):
        self.every = check_int("every", every, 1)
        self.sinks = _checked_sinks(sinks)
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str (put before every figure's name), got {type(prefix).__name__}")
        self.prefix = prefix
        self.rank_zero_only = check_bool("rank_zero_only", rank_zero_only)
        self.figures = CommFigures(source)
        self.last_step: int | None = None  # the step of the last write
        self._writes: bool | None = None  # whether this rank writes (known once a step comes)
        self._closed = False

    def step(self, step: int) -> dict[str, float] | None:
        """Call once per optimizer step, after ``optimizer.step()``, with the number of steps
        taken (1 after the first). At a positive multiple of ``every`` (and not twice for the
        same step), reads the figures and writes them to every sink; returns what it wrote
        (with the prefix), else None."""
        check_int("step", step, 0)
        if self._closed:
            raise RuntimeError("MetricsLogger.step() after close()")
        if self._writes is None:
            self._writes = not self.rank_zero_only or not dist.is_initialized() or dist.get_rank() == 0
        if not self._writes or step == 0 or step % self.every or step == self.last_step:
            return None
        written = {self.prefix + name: value for name, value in self.figures.read().items()}
        for sink in self.sinks:
            sink.write(written, step)
        self.last_step = step
        return written

    def flush(self) -> None:
        for sink in self.sinks:
            sink.flush()

    def close(self) -> None:
        """Flush every sink and close what they opened themselves (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for sink in self.sinks:
            sink.close()


def _checked_sinks(sinks) -> tuple[Sink, ...]:
    sinks = (sinks,) if isinstance(sinks, Sink) else sinks
    try:
        sinks = tuple(sinks)
    except TypeError:
        raise TypeError(f"sinks must be a Sink or a sequence of them, got {type(sinks).__name__}") from None
    if not sinks:
        raise ValueError("sinks must name at least one sink (TensorBoardSink, WandbSink, CallableSink), got none")
    for index, sink in enumerate(sinks):
        if not isinstance(sink, Sink):
            raise TypeError(f"sinks[{index}] must be a sparsecomm.metrics.Sink (TensorBoardSink, WandbSink, CallableSink "
                            f"or a subclass), got {type(sink).__name__}; wrap a function in CallableSink(fn)")
    return sinks
