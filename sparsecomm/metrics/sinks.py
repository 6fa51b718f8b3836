"""Where :class:`~sparsecomm.metrics.MetricsLogger` writes the figures: TensorBoard, Weights &
Biases, or any function (the framework integrations hand them to their framework's loggers
that way).

A sink writes ``{tag: value}`` at a step. The package a sink needs is imported when the sink
is built (an ImportError names the pip extra), never by ``import sparsecomm``; what it writes
to is opened at its first write, so a sink built on every rank of a job writes (and creates
files) only where the logger writes: on rank 0 by default.
"""
import os

from sparsecomm.metrics.optional_packages import import_optional, summary_writer_class


class Sink:
    """Takes the figures of one step. Subclass it, or wrap a function in :class:`CallableSink`."""

    def write(self, figures: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Push what was written to its destination (files, a service)."""

    def close(self) -> None:
        """Flush, and release what this sink opened itself (nothing the user passed in)."""
        self.flush()


class TensorBoardSink(Sink):
    """Scalars in TensorBoard event files: ``add_scalar(tag, value, step)``.

    Args:
        log_dir_or_writer: a directory (str or path; its ``SummaryWriter`` is created at the
            first write and closed by :meth:`close`), or a writer you own (a
            ``torch.utils.tensorboard.SummaryWriter``, or anything with ``add_scalar`` and
            ``flush``, e.g. Lightning's ``TensorBoardLogger.experiment``), which is flushed,
            not closed.
    """

    def __init__(self, log_dir_or_writer):
        self._writer_class = summary_writer_class("sparsecomm.metrics.TensorBoardSink")
        if isinstance(log_dir_or_writer, (str, os.PathLike)):
            self.log_dir, self._writer, self._owned = os.fspath(log_dir_or_writer), None, True
        elif callable(getattr(log_dir_or_writer, "add_scalar", None)) and callable(
                getattr(log_dir_or_writer, "flush", None)):
            self.log_dir, self._writer, self._owned = None, log_dir_or_writer, False
        else:
            raise TypeError(f"log_dir_or_writer must be a directory (str or os.PathLike) or a SummaryWriter (with "
                            f"add_scalar and flush), got {type(log_dir_or_writer).__name__}")

    def write(self, figures: dict[str, float], step: int) -> None:
        if self._writer is None:
            self._writer = self._writer_class(log_dir=self.log_dir)
        for tag, value in figures.items():
            self._writer.add_scalar(tag, value, global_step=step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None and self._owned:
            self._writer.close()  # flushes
            self._writer = None
        else:
            self.flush()


class WandbSink(Sink):
    """A Weights & Biases run: ``run.log(figures, step=step)``.

    Args:
        run: the run to log to; None (default): ``wandb.run``, the run ``wandb.init()`` started
            in this process, looked up at each write (so it may start after the sink is built,
            and only on the rank that logs). A write without a run raises a RuntimeError.

    W&B requires steps that never go back: use the step your own ``wandb.log`` calls use (the
    figures then join that step's row). The run stays yours: :meth:`close` does not finish it.
    """

    def __init__(self, run=None):
        self._wandb = import_optional("wandb", "wandb", "wandb", "sparsecomm.metrics.WandbSink")
        if run is not None and not callable(getattr(run, "log", None)):
            raise TypeError(f"run must be a wandb run (with log()) or None for wandb.run, got {type(run).__name__}")
        self.run = run

    def write(self, figures: dict[str, float], step: int) -> None:
        run = self.run if self.run is not None else self._wandb.run
        if run is None:
            raise RuntimeError("WandbSink: no W&B run to log to: call wandb.init(...) on the rank that logs (rank 0) "
                               "before the first write, or pass WandbSink(run=...)")
        run.log(dict(figures), step=step)


class CallableSink(Sink):
    """``fn(figures, step)`` for every write: any logger (the integrations pass their
    framework's: Lightning's ``log_metrics``, ``accelerator.log``, the Trainer's logs)."""

    def __init__(self, fn):
        if not callable(fn):
            raise TypeError(f"fn must be callable as fn(figures: dict, step: int), got {type(fn).__name__}")
        self.fn = fn

    def write(self, figures: dict[str, float], step: int) -> None:
        self.fn(dict(figures), step)
