"""What a loss curve does not show: the bytes, the density and the memory of a top-k hook or a
sparse averager, as a flat ``dict[str, float]`` a logger can take (docs/metrics.md).

:meth:`CommFigures.read` returns, for this rank:

- over the **window** since the previous read (the first: since the tracker was built):
  ``bytes_sent_per_step``, ``bytes_received_per_step``, ``bytes_dense_per_step`` (bytes per
  optimizer step, as the source's ``stats()`` counts them), ``compression`` (bytes sent /
  dense bytes), ``effective_density`` (entries sent / entries in sparse reductions),
  ``skipped_steps`` (the hook's steps undone in the window), ``leader_overlap`` (where it was
  measured), ``syncs`` (the averager's outer syncs);
- **now**: ``steps`` (the source's step counter), ``density`` (the density it sends at this
  step), ``residual_norm`` (L2 norm of this rank's error-feedback memory: the hook's
  residuals, the averager's error buffer), ``residual_max_age`` (the hook's, when a
  :class:`~sparsecomm.monitor.StalenessMonitor` watches it).

A figure that is undefined is left out, never None: a window without a step has no per-step
figure, a window without a sparse reduction no ``effective_density``, a hook without error
feedback no ``residual_norm``, a hook without a staleness monitor no ``residual_max_age``
(ages need one int32 per gradient entry kept at every step: the monitor is that memory, and
nothing cheaper bounds an age honestly), the averager no ``skipped_steps`` (it counts only
the steps the loop took) and no ``residual_max_age``. A read after the source's
``load_state_dict`` replaced its counters has no window figures; the next read has them again.

Reading starts no collective and costs one pass over the residuals (and the monitor's
report). A hook's read with a collective in flight (inside ``backward()``) is refused with a
RuntimeError: its counters and residuals are mid-step; read after ``optimizer.step()``. An
averager with a sync in flight (``overlap=True``) reads the last applied sync: the sync in
flight is counted, and its error buffer taken, when the next step applies it.
"""
import torch

from sparsecomm.averaging.sparse_delta import SparseDeltaAverager
from sparsecomm.hooks.topk import TopKState
from sparsecomm.metrics.window import CounterWindow
from sparsecomm.monitor.staleness import StalenessMonitor


class CommFigures:
    """The figures of ``source`` (a :class:`~sparsecomm.TopKState` or a
    :class:`~sparsecomm.SparseDeltaAverager`) over the window since the previous :meth:`read`.

    Build it after the source's ``load_state_dict`` (a resumed run): the first window then
    starts at the checkpoint's step.
    """

    def __init__(self, source):
        if isinstance(source, TopKState):
            self._reader = HookReader(source)
        elif isinstance(source, SparseDeltaAverager):
            self._reader = AveragerReader(source)
        else:
            raise TypeError(f"source must be a sparsecomm.TopKState or a sparsecomm.SparseDeltaAverager, got "
                            f"{type(source).__name__}")
        self.source = source
        self._window = CounterWindow(*self._reader.counters())

    def read(self) -> dict[str, float]:
        """This rank's figures now and over the window since the previous read (see the
        module's docstring); the window restarts here."""
        self._reader.check_readable()
        grown = self._window.advance(*self._reader.counters())
        figures = self._reader.now()
        if grown is not None:
            figures.update(self._reader.over(grown))
        return figures


def per_step(grown: dict, steps: int, elements: str) -> dict[str, float]:
    """The byte and density figures of a window of ``steps`` steps (``elements``: the counter
    of entries in sparse reductions)."""
    figures = {}
    if steps > 0:
        for name in ("bytes_sent", "bytes_received", "bytes_dense"):
            figures[f"{name}_per_step"] = grown[name] / steps
    if grown["bytes_dense"]:
        figures["compression"] = grown["bytes_sent"] / grown["bytes_dense"]
    if grown[elements]:
        figures["effective_density"] = grown["elements_sent"] / grown[elements]
    return figures


def mean_overlap(grown: dict, measured: str) -> dict[str, float]:
    """The leader overlap's mean over the window's measured buckets (or syncs), if any."""
    return {"leader_overlap": grown["leader_overlap_sum"] / grown[measured]} if grown[measured] else {}


def l2_norm(tensors) -> float:
    """The L2 norm of all ``tensors`` together: one pass over each, one host transfer."""
    norms = [torch.linalg.vector_norm(t, dtype=torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else None)
             .double() for t in tensors if t.numel()]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0


class HookReader:
    """The figures of a :class:`~sparsecomm.TopKState`."""

    COUNTERS = ("steps", "skipped_steps", "bytes_sent", "bytes_received", "bytes_dense", "elements_sent",
                "elements_sparse", "leader_overlap_sum", "leader_overlap_buckets")

    def __init__(self, state: TopKState):
        self.state = state

    def check_readable(self) -> None:
        pending = self.state.pending_collectives
        if pending:
            raise RuntimeError(f"CommFigures.read(): the hook has {pending} collective(s) in flight, so its counters "
                               "and residuals are mid-step; read between steps, after optimizer.step()")

    def counters(self) -> tuple[object, dict]:
        # The marker: load_state_dict replaces the state's totals and, with them, its PlanCache
        # (``wires``), the one public part it replaces and no step does.
        stats = self.state.stats()
        return self.state.wires, {name: stats[name] for name in self.COUNTERS}

    def now(self) -> dict[str, float]:
        state = self.state
        figures = {"steps": float(state.step), "density": float(state.current_density())}
        if state.config.error_feedback:
            residuals = state.memories.residuals
            figures["residual_norm"] = l2_norm(residuals.get(name) for name in residuals.names())
        ages = [observer.report()["max_age"] for observer in state.observers.callbacks
                if isinstance(observer, StalenessMonitor)]
        if ages:
            figures["residual_max_age"] = float(max(ages))
        return figures

    def over(self, grown: dict) -> dict[str, float]:
        # A skipped step ran (and sent) before rollback took its step back: the steps that ran
        # are the counter's growth plus the steps undone.
        ran = grown["steps"] + grown["skipped_steps"]
        return {**per_step(grown, ran, "elements_sparse"), "skipped_steps": float(grown["skipped_steps"]),
                **mean_overlap(grown, "leader_overlap_buckets")}


class AveragerReader:
    """The figures of a :class:`~sparsecomm.SparseDeltaAverager` (bytes per optimizer step,
    amortised over its period, as its ``stats()``; ``bytes_dense``: an fp32 allreduce of the
    weights at every sync)."""

    COUNTERS = ("steps", "syncs", "bytes_sent", "bytes_received", "bytes_dense", "elements_sent", "elements_total",
                "leader_overlap_sum", "leader_overlap_syncs")

    def __init__(self, averager: SparseDeltaAverager):
        self.averager = averager

    def check_readable(self) -> None:
        """Always readable: a sync in flight (overlap) is counted when it is applied."""

    def counters(self) -> tuple[object, dict]:
        # The marker: load_state_dict assigns a new counters dict.
        stats = self.averager.stats()
        return self.averager.counters, {name: stats[name] for name in self.COUNTERS}

    def now(self) -> dict[str, float]:
        averager = self.averager
        return {"steps": float(averager.step_count), "density": float(averager.density),
                "residual_norm": l2_norm([averager.error])}

    def over(self, grown: dict) -> dict[str, float]:
        return {**per_step(grown, grown["steps"], "elements_total"), "syncs": float(grown["syncs"]),
                **mean_overlap(grown, "leader_overlap_syncs")}
