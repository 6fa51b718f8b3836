"""Update-spike detector: a gradient whose norm jumps far above its recent scale.

Most silent data corruption is finite (NaN/Inf is ~1% of outcomes in injection studies):
a flipped exponent bit turns a gradient entry of 1e-3 into 3e35, a faulty multiply
returns a wrong but ordinary-looking number. The large ones show up as a spike in the
gradient norm (Altenbernd et al., arXiv 2604.00726: grad-norm / update spikes against a
dynamic threshold). This detector keeps the norms of the last ``window`` steps and flags
a step whose norm exceeds ``threshold`` times their median. The median, unlike a mean or
an EMA, is not dragged up by the spike it should catch, and it follows the slow drift of
the gradient scale during training.

Where it runs: as a TopKState observer at stage ``gradient`` (the local gradient before
compression; each rank judges its own data) or ``packed`` (``acc``: gradient/ws plus the
error-feedback residual, which also exposes a corrupted residual). Buckets of one step
add up to the step's global norm; since that sum only grows, the step is flagged as soon
as the partial norm crosses the threshold, before the offending bucket is sent, i.e. in
the same step. Or call :meth:`observe` from the training loop with any norm you already
compute (``clip_grad_norm_`` returns one).

Default threshold: 50. On clean 240-300-step runs of the digits MLP (2 ranks, top-k 1%,
SGD and AdamW, batch 4 to 32 per rank) the largest ratio of a step's norm to the running
median was 2 to 9.2, reached around steps 40-50 when the gradient norm grows as training
takes off (tests/test_monitor_spike.py prints it and asserts it stays below half the
threshold), so 50 leaves a margin of 5x. Flipping bit 30 of one float32 gradient entry of
magnitude < 1 multiplies it by 2**128 (in [1, 2) it becomes Inf or NaN, also flagged), far
above any threshold; bit 27 multiplies by 2**16, which an entry of ~1e-3 of the norm still
crosses. An entry >= 2 shrinks instead, and an entry that is exactly 0 becomes 2.0:
neither is a spike, and neither is caught here. Finite flips of low exponent bits (x2,
x4, x16) or of mantissa bits are far below any usable threshold: a spike detector does
not see them, and no one should claim it does.

Measured at the default settings (experiments/bench_monitors.py, docs/reliability.md,
"Monitors"): a top-exponent flip in the local gradient is flagged in the step it happens
in (15 of 20 flips; the 5 misses hit entries that were exactly 0); one in a weight or in
the residual shows up one or two steps later, through the gradients it causes.

Cost: one norm per bucket and a host read of it (a device synchronisation on GPU).
"""
import math
import statistics
from collections import deque

import torch

from sparsecomm.monitor.errors import CorruptionDetected

DEFAULT_THRESHOLD = 50.0
DEFAULT_WARMUP = 20
DEFAULT_WINDOW = 50
ACTIONS = ("raise", "record")
STAGES = {"gradient": "gradient", "packed": "acc"}  # observed stage -> tensor judged


class UpdateSpikeDetector:
    """Flag steps whose gradient norm exceeds ``threshold`` x the median of recent steps.

    Usage (hook observer)::

        state.add_observer(UpdateSpikeDetector())

    Args:
        threshold: ratio of a step's norm to the running median that counts as a spike.
        warmup: steps recorded before any judgement (the median needs a history; the
            first steps of training also move fastest).
        window: number of recent step norms whose median is the scale.
        action: ``"raise"`` :class:`CorruptionDetected` (``check="update_spike"``, naming
            this rank) or ``"record"`` the alarm in :attr:`alarms` and carry on.
        stage: ``"gradient"`` (local gradient) or ``"packed"`` (gradient/ws + residual).

    A flagged step's norm is kept out of the history, so one spike cannot raise the scale
    and hide the next. Non-finite norms are always flagged (after warm-up or not).

    Attributes:
        alarms: one dict per flagged step: step, rank, norm, scale, ratio.
        steps_seen: steps whose norm entered the history.
        max_clean_ratio: the largest norm / median ratio judged and not flagged (the
            margin a clean run leaves below ``threshold``).
    """

    def __init__(
        self,
        *,
        threshold: float = DEFAULT_THRESHOLD,
        warmup: int = DEFAULT_WARMUP,
        window: int = DEFAULT_WINDOW,
        action: str = "raise",
        stage: str = "gradient",
    ):
        if not (isinstance(threshold, (int, float)) and math.isfinite(threshold) and threshold > 1):
            raise ValueError(f"threshold must be a finite number > 1, got {threshold!r}")
        if not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"warmup must be an integer >= 1 (steps), got {warmup!r}")
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an integer >= 1 (steps), got {window!r}")
        if action not in ACTIONS:
            raise ValueError(f"action must be one of {ACTIONS}, got {action!r}")
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {tuple(STAGES)}, got {stage!r}")
        self.threshold = float(threshold)
        self.warmup = warmup
        self.action = action
        self.stage = stage
        self.alarms: list[dict] = []
        self.steps_seen = 0
        self.max_clean_ratio = 0.0  # largest judged ratio that was not a spike: the margin
        self._history: deque[float] = deque(maxlen=window)
        self._scale: float | None = None  # median of _history, cached until it changes
        self._step: int | None = None  # step being accumulated from bucket events
        self._squares = 0.0
        self._flagged = False
        self._rank: int | None = None

    @property
    def needs_acc(self) -> bool:
        """Only stage ``packed`` judges acc; at stage ``gradient`` the hook keeps its fused
        kernel (see TopKState.add_observer)."""
        return self.stage == "packed"

    # ----- observer --------------------------------------------------------------------

    def __call__(self, event) -> None:
        if event.stage != self.stage:
            return
        tensor = event.tensors[STAGES[self.stage]]
        if event.step != self._step:
            self._finish_step()
            self._step, self._squares, self._flagged = event.step, 0.0, False
        self._rank = event.rank
        self._squares += _norm(tensor) ** 2
        if not self._flagged:
            self._judge(event.step, math.sqrt(self._squares), where=f"bucket {event.bucket_index}")

    def _finish_step(self) -> None:
        if self._step is not None and not self._flagged:
            self._record(math.sqrt(self._squares))
        self._step = None

    # ----- training-loop interface -----------------------------------------------------

    def observe(self, step: int, norm: float, *, rank: int | None = None) -> bool:
        """Judge one complete step's ``norm``; True if it is a spike (after recording or
        raising per ``action``)."""
        self._finish_step()
        self._rank = rank if rank is not None else self._rank
        flagged = self._judge(step, float(norm), where="training loop")
        if not flagged:
            self._record(float(norm))
        return flagged

    # ----- judgement -------------------------------------------------------------------

    @property
    def scale(self) -> float | None:
        """Median of the recent step norms (None before any step completed)."""
        if self._scale is None and self._history:
            self._scale = statistics.median(self._history)
        return self._scale

    def _record(self, norm: float) -> None:
        self._history.append(norm)
        self._scale = None
        self.steps_seen += 1

    def _judge(self, step: int, norm: float, *, where: str) -> bool:
        finite = math.isfinite(norm)
        if finite and self.steps_seen < self.warmup:
            return False
        scale = self.scale
        if finite and (scale is None or norm <= self.threshold * scale):
            if scale:
                self.max_clean_ratio = max(self.max_clean_ratio, norm / scale)
            return False
        self._flagged = True
        ratio = norm / scale if scale else math.inf
        alarm = {"step": step, "rank": self._rank, "norm": norm, "scale": scale, "ratio": ratio}
        self.alarms.append(alarm)
        if self.action == "raise":
            ranks = () if self._rank is None else (self._rank,)
            raise CorruptionDetected(
                "update_spike",
                step,
                ranks,
                f"{self.stage} norm {norm:.4g} is {ratio:.3g}x the median {scale} of the last "
                f"{len(self._history)} steps (threshold {self.threshold:g}x; {where})",
            )
        return True


def _norm(tensor: torch.Tensor) -> float:
    # Low-precision buckets: accumulate in float32 so the norm itself does not overflow.
    dtype = torch.float32 if tensor.dtype in (torch.float16, torch.bfloat16) else None
    return float(torch.linalg.vector_norm(tensor, dtype=dtype))
