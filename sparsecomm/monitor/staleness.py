"""Residual staleness: how long has gradient mass waited in the error-feedback memory?

Error feedback makes top-k lossless *over time*: what is not sent stays in the residual
and is added again next step. The promise holds only if every entry is eventually sent.
An entry whose accumulated value never reaches the top k (a slowly learning layer next to
a fast one, a density set too low) holds gradient for hundreds of steps, and the update
it finally gets is stale. The signed policy bounds that wait (``Policy.staleness_limit``);
this monitor measures it and marks the run *unverified* when the bound is exceeded.

What it keeps, per gradient element, is an int32 age: the number of steps the entry has
held a non-zero residual without being sent. On an observed sparse step every age grows
by the steps elapsed since the previous observation, then drops to 0 where the entry was
sent (``indices``) or where the residual is exactly zero (nothing is waiting: a dead unit
whose gradient is always 0 is not stale). A dense step sends everything: all ages reset.

Memory: one int32 per gradient element, i.e. as much as an fp32 residual (+4 bytes per
parameter). Time per observed step: about five passes over the bucket (add, compare,
fill, scatter, and two norms); ``every`` > 1 observes every ``every``-th step only.
Observing a subset of steps never under-reports: ages grow by the full elapsed step count,
while sends on unobserved steps are missed, so the reported age is an upper bound on the
true one (exact with ``every=1``).

Drift: ``ratio`` = ||residual|| / ||gradient / world_size|| over the last observed step,
i.e. how many steps' worth of gradient the residual holds back (0 on dense steps; grows
roughly like sqrt(1/density) in a steady state). ``held_fraction`` = ||residual|| /
||acc||, the share of the compensated bucket that was not sent (in [0, 1], because top-k
splits ``acc`` into sent and kept entries). Both are per rank: residuals differ by rank.
"""
import math

import torch
import torch.distributed as dist

from sparsecomm.monitor.payload_view import locate
from sparsecomm.monitor.errors import StalenessExceeded

ACTIONS = ("record", "raise")


class StalenessMonitor:
    """TopKState observer tracking residual ages against a staleness limit (steps).

    Usage::

        monitor = StalenessMonitor(policy.staleness_limit, every=10)
        state.add_observer(monitor)
        ...
        report = monitor.report()  # max_age, mean_age, ratio, exceeded, unverified_reason

    Args:
        limit_steps: the most steps an entry may wait (``Policy.staleness_limit``).
        every: observe steps with ``step % every == 0``.
        action: ``"record"`` (default: never raises, :meth:`report` marks the run
            unverified) or ``"raise"`` :class:`StalenessExceeded` at the packed stage of
            the bucket that exceeds it, before it is sent. Ages differ per rank, so only
            the rank that exceeds raises; its peers then wait in that bucket's collective
            (see FiniteGuard's note). Record is the safer default.
        world_size: divisor of the gradient for ``ratio``; None reads the default group's.
    """

    # Reads only the residual, the indices and the sent values: the hook keeps its fused
    # kernel while this monitor watches (see TopKState.add_observer).
    needs_acc = False

    def __init__(self, limit_steps: int, *, every: int = 1, action: str = "record", world_size: int | None = None):
        if not isinstance(limit_steps, int) or isinstance(limit_steps, bool) or limit_steps < 1:
            raise ValueError(f"limit_steps must be an integer >= 1 (steps), got {limit_steps!r}")
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"every must be an integer >= 1 (steps), got {every!r}")
        if action not in ACTIONS:
            raise ValueError(f"action must be one of {ACTIONS}, got {action!r}")
        self.limit_steps = limit_steps
        self.every = every
        self.action = action
        self.world_size = world_size
        self._flats: dict[int, tuple[tuple[str, ...], torch.Tensor]] = {}  # bucket index -> (names, ages)
        self._ages: dict[str, torch.Tensor] = {}  # parameter name -> view into a bucket's ages
        self._last_seen: dict[str, int] = {}  # parameter name -> last observed step
        self._norms_step: int | None = None
        self._squares = {"gradient": 0.0, "residual": 0.0, "acc": 0.0}
        self._last_norms: dict[str, float] | None = None
        self.steps_observed = 0

    @classmethod
    def from_policy(cls, policy, **kwargs) -> "StalenessMonitor":
        """A monitor enforcing ``policy.staleness_limit``."""
        return cls(policy.staleness_limit, **kwargs)

    # ----- observer --------------------------------------------------------------------

    def __call__(self, event) -> None:
        if event.step % self.every or event.stage == "reduced":
            return
        if event.step != self._norms_step:
            self._close_norms()
            self._norms_step = event.step
            self.steps_observed += 1
        tensors = event.tensors
        if event.stage == "gradient":
            self._squares["gradient"] += _square(tensors["gradient"])
            return
        residual = tensors.get("residual")
        if tensors.get("acc") is not None:
            self._squares["acc"] += _square(tensors["acc"])
        elif residual is not None:
            # The fused kernel never materialises acc; top-k splits it into the sent and
            # the kept entries, so its squared norm is the sum of theirs (exact for a wire
            # as wide as the bucket, up to the tiny rounding remainders otherwise).
            self._squares["acc"] += _square(residual) + _square(tensors["values"])
        if residual is None:
            return  # no error feedback: nothing is ever held back
        self._squares["residual"] += _square(residual)
        ages = self._bucket_ages(event)
        # Steps since these entries were last looked at (``every`` the first time: the
        # residual has existed for at least one step when the first sparse step runs).
        elapsed = max(event.step - self._last_seen.get(name, event.step - self.every) for name in event.names)
        for name in event.names:
            self._last_seen[name] = event.step
        if event.dense:
            ages.zero_()  # the dense path sends (and clears) everything
            return
        ages.add_(elapsed)
        ages.masked_fill_(residual == 0, 0)
        ages[tensors["indices"]] = 0
        if self.action == "raise":
            oldest = int(ages.max())
            if oldest > self.limit_steps:
                name, element = locate(event.names, event.numels, int(ages.argmax()))
                raise StalenessExceeded(
                    f"step {event.step}, rank {event.rank}: residual entry {name}[{element}] has waited "
                    f"{oldest} steps unsent, over the staleness limit of {self.limit_steps}"
                )

    def _bucket_ages(self, event) -> torch.Tensor:
        """This bucket's flat age tensor; re-homes ages by name when DDP changed the layout."""
        cached = self._flats.get(event.bucket_index)
        if cached is not None and cached[0] == event.names:
            return cached[1]
        device = event.tensors["residual"].device
        parts = [
            self._ages[name].to(device) if name in self._ages else torch.zeros(numel, dtype=torch.int32, device=device)
            for name, numel in zip(event.names, event.numels)
        ]
        ages = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32, device=device)
        # Drop cached buckets that held any of these parameters: they now live here.
        moved = set(event.names)
        for index in [i for i, (names, _) in self._flats.items() if moved.intersection(names)]:
            del self._flats[index]
        self._flats[event.bucket_index] = (event.names, ages)
        offset = 0
        for name, numel in zip(event.names, event.numels):
            self._ages[name] = ages[offset : offset + numel]
            offset += numel
        return ages

    def _close_norms(self) -> None:
        if self._norms_step is None:
            return
        self._last_norms = {key: math.sqrt(value) for key, value in self._squares.items()}
        self._last_norms["step"] = self._norms_step
        self._squares = dict.fromkeys(self._squares, 0.0)
        self._norms_step = None

    # ----- report ----------------------------------------------------------------------

    def ages(self) -> dict[str, torch.Tensor]:
        """A copy of every tracked parameter's age counters (flat int32, by name)."""
        return {name: ages.clone() for name, ages in self._ages.items()}

    def report(self) -> dict:
        """Ages and drift so far, for this rank.

        Ages are as of the last observed step (``step``). Keys: ``max_age``, ``mean_age``, ``oldest`` (``"name[element]"`` of the oldest
        entry, None when nothing waits), ``ratio``, ``held_fraction``, ``step`` (of the
        norms), ``limit``, ``exceeded`` (max_age > limit), ``unverified_reason`` (a
        sentence when exceeded, else None), ``steps_observed``, ``tracked_elements``,
        ``memory_bytes`` (of the age counters).
        """
        if self._norms_step is not None:
            self._close_norms()
        max_age, total, count, oldest = 0, 0, 0, None
        for names, ages in self._flats.values():
            if ages.numel() == 0:
                continue
            bucket_max = int(ages.max())
            total += int(ages.sum(dtype=torch.int64))
            count += ages.numel()
            if bucket_max > max_age:
                name, element = locate(names, [self._ages[n].numel() for n in names], int(ages.argmax()))
                max_age, oldest = bucket_max, f"{name}[{element}]"
        norms = self._last_norms or {}
        gradient = norms.get("gradient", 0.0) / self._world_size()
        residual = norms.get("residual", 0.0)
        exceeded = max_age > self.limit_steps
        return {
            "max_age": max_age,
            "mean_age": total / count if count else 0.0,
            "oldest": oldest,
            "ratio": residual / gradient if gradient > 0 else (0.0 if residual == 0 else math.inf),
            "held_fraction": residual / norms["acc"] if norms.get("acc") else 0.0,
            "step": norms.get("step"),
            "limit": self.limit_steps,
            "exceeded": exceeded,
            "unverified_reason": (
                f"residual entry {oldest} waited {max_age} steps unsent, over the staleness limit of "
                f"{self.limit_steps} steps" + (" (upper bound: observed every {} steps)".format(self.every) if self.every > 1 else "")
                if exceeded
                else None
            ),
            "steps_observed": self.steps_observed,
            "tracked_elements": count,
            "memory_bytes": count * 4,
        }

    def _world_size(self) -> int:
        if self.world_size is None:
            self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        return self.world_size


def _square(tensor: torch.Tensor) -> float:
    dtype = torch.float32 if tensor.dtype in (torch.float16, torch.bfloat16) else None
    return float(torch.linalg.vector_norm(tensor, dtype=dtype)) ** 2
