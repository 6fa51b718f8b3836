"""Density schedules: how the fraction of each bucket that is sent changes over steps.

Starting sparse from step one hurts quality most early in training, when gradients
change fastest; DGC (Lin et al., ICLR 2018, section 3.3 "warm-up training") therefore
raises sparsity in stages: 75%, 93.75%, 98.4375%, 99.6%, then the target 99.9%, i.e.
each stage sends about a quarter of the previous one. Two schedules, both ending at the
state's target density:

* :meth:`DensitySchedule.exponential`: ``stages`` equal stages over ``steps`` steps with
  densities ``target ** ((i + 1) / (stages + 1))``; for target 0.001 and 4 stages exactly
  DGC's 0.25, 0.0625, 0.0156, 0.0039;
* :meth:`DensitySchedule.piecewise`: a user list of ``(first_step, density)`` pairs.

Densities are piecewise constant, so the hook's payload buffers are reallocated only when
a stage changes (a few times), not every step.
"""
import bisect
from dataclasses import dataclass

from sparsecomm.hooks.validation import check_int, check_real


@dataclass(frozen=True)
class DensitySchedule:
    """Piecewise-constant density by step: ``density(step)`` is the value of the last
    ``(first_step, density)`` pair with ``first_step <= step``; the last pair is the target."""

    points: tuple[tuple[int, float], ...]

    def __post_init__(self):
        if not self.points:
            raise ValueError("density schedule: needs at least one (first_step, density) pair, got none")
        for pair in self.points:
            if len(pair) != 2:
                raise ValueError(f"density schedule: entries must be (first_step, density) pairs, got {pair!r}")
            check_int("density schedule step", pair[0], 0)
            check_real("density schedule density", pair[1], 0.0, 1.0, low_open=True, high_open=False)
        steps = [step for step, _ in self.points]
        if steps[0] != 0:
            raise ValueError(f"density schedule: the first pair must start at step 0, got {steps[0]}")
        if any(b <= a for a, b in zip(steps, steps[1:])):
            raise ValueError(f"density schedule: first steps must increase strictly, got {steps}")

    @classmethod
    def constant(cls, density: float) -> "DensitySchedule":
        return cls(((0, density),))

    @classmethod
    def exponential(cls, target: float, steps: int, stages: int = 4) -> "DensitySchedule":
        """DGC's warm-up: ``stages`` equal stages over ``steps`` steps, then ``target``."""
        check_real("target density", target, 0.0, 1.0, low_open=True, high_open=False)
        check_int("steps", steps, 1)
        check_int("stages", stages, 1)
        if stages > steps:
            raise ValueError(f"stages must be <= steps ({steps}), got {stages}")
        points = [(steps * i // stages, target ** ((i + 1) / (stages + 1))) for i in range(stages)]
        return cls((*points, (steps, target)))

    @classmethod
    def piecewise(cls, points, target: float) -> "DensitySchedule":
        """A user list of ``(first_step, density)``; it must end at ``target``."""
        points = tuple(tuple(pair) for pair in points)
        schedule = cls(points)
        if points[-1][1] != target:
            raise ValueError(
                f"density schedule must end at the target density {target}, but its last pair is {points[-1]}"
            )
        return schedule

    def __call__(self, step: int) -> float:
        index = bisect.bisect_right([s for s, _ in self.points], step) - 1
        return self.points[max(index, 0)][1]

    @property
    def target(self) -> float:
        return self.points[-1][1]

    def to_list(self) -> list[list]:
        return [[step, density] for step, density in self.points]
