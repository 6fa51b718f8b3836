"""The hook's and the averager's figures in a logger (docs/metrics.md).

- :class:`CommFigures` (``figures.py``): a source's figures over the window since the last read.
- :class:`MetricsLogger` (``logger.py``): every N optimizer steps, those figures into sinks.
- :class:`TensorBoardSink`, :class:`WandbSink`, :class:`CallableSink` (``sinks.py``).

TensorBoard and Weights & Biases are imported by their sinks only: ``pip install
'sparsecomm[tensorboard]'`` / ``'sparsecomm[wandb]'``.
"""
from sparsecomm.metrics.figures import CommFigures
from sparsecomm.metrics.logger import MetricsLogger
from sparsecomm.metrics.sinks import CallableSink, Sink, TensorBoardSink, WandbSink

__all__ = ["CallableSink", "CommFigures", "MetricsLogger", "Sink", "TensorBoardSink", "WandbSink"]
