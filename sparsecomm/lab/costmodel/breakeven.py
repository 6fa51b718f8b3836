"""Break-even against dense: the density, and the link rate, below which an arm's modelled
cost is lower than dense's (or "always", "never"), found on a log grid and refined by bisection."""
import math
from dataclasses import dataclass

from sparsecomm.comm.link_model import falls_back_to_dense
from sparsecomm.lab.costmodel.inputs import ArmInputs, RunInputs
from sparsecomm.lab.costmodel.projection import project_arm
from sparsecomm.lab.costmodel.scenario import Scenario, format_rate
from sparsecomm.links.spec import RATE_RANGE_BITS

# Bisection stops when the bracket is this narrow (relative): the projected times at the
# returned break-even then agree to ~1e-12 relative.
_BISECT_RTOL = 1e-13


@dataclass(frozen=True)
class BreakEven:
    """Where an arm's modelled cost equals dense's. ``kind``: below / above / always / never / n/a."""

    quantity: str  # "density" or "link rate"
    boundary: str
    kind: str
    value: float | None  # the crossing (density fraction, or bits/s)
    text: str

    def to_json(self) -> dict:
        return {"quantity": self.quantity, "boundary": self.boundary, "kind": self.kind, "value": self.value,
                "text": self.text, "modelled": True}


def _bisect(f, lo: float, hi: float) -> float:
    """A root of ``f`` in [lo, hi] (signs differ at the ends), bisecting in log space."""
    flo = f(lo)
    for _ in range(400):
        mid = math.sqrt(lo * hi)
        fmid = f(mid)
        if fmid == 0:
            return mid
        if (fmid < 0) == (flo < 0):
            lo, flo = mid, fmid
        else:
            hi = mid
        if hi / lo - 1 < _BISECT_RTOL:
            break
    return math.sqrt(lo * hi)


def _crossings(f, lo: float, hi: float, num: int = 400) -> tuple[list[float], list[bool]]:
    """Roots of ``f`` on [lo, hi] (log grid + bisection) and whether ``f < 0`` on each grid point."""
    grid = [lo * (hi / lo) ** (i / (num - 1)) for i in range(num)]
    values = [f(x) for x in grid]
    roots = [_bisect(f, a, b) for a, b, fa, fb in zip(grid, grid[1:], values, values[1:]) if (fa < 0) != (fb < 0)]
    return roots, [v < 0 for v in values]


def _weights(arm: ArmInputs, dense: ArmInputs, boundary: str) -> tuple[float, float] | None:
    if boundary == "step":
        return 1.0, 1.0
    if arm.steps_to_target is None or dense.steps_to_target is None:
        return None
    return arm.steps_to_target, dense.steps_to_target


def _describe(quantity: str, boundary: str, roots, wins, lo, hi, fmt, upper_note: str) -> BreakEven:
    if all(wins):
        return BreakEven(quantity, boundary, "always", None,
                         f"always: {quantity} {fmt(lo)}..{fmt(hi)}{upper_note}, cheaper everywhere")
    if not any(wins):
        return BreakEven(quantity, boundary, "never", None,
                         f"never: dense is as cheap or cheaper at every {quantity} {fmt(lo)}..{fmt(hi)}{upper_note}")
    if len(roots) == 1:
        kind = "below" if wins[0] else "above"
        return BreakEven(quantity, boundary, kind, roots[0], f"{kind} {fmt(roots[0])}")
    return BreakEven(quantity, boundary, "intervals", roots[0],
                     f"cheaper on several intervals; crossings at {', '.join(fmt(r) for r in roots)}")


def break_even_density(arm: ArmInputs, dense: ArmInputs, run: RunInputs, scenario: Scenario,
                       boundary: str = "step") -> BreakEven:
    """The density below which ``arm`` (top-k) is cheaper than dense at ``scenario``.

    Searched between one entry per bucket and the dense-fallback density (above it the
    hook allreduces densely, so the arm is dense with its own compute/compress). For
    ``time_to_target`` both arms' measured steps-to-target weight their steps: the steps
    ratio measured at the run's density is assumed to hold at every density.
    """
    if not arm.sparse:
        raise ValueError(f"arm {arm.arm!r} sends no top-k payload: it has no density to solve for")
    weights = _weights(arm, dense, boundary)
    if weights is None:
        return BreakEven("density", boundary, "n/a", None, "n/a: the target was not reached by both arms")
    w_arm, w_dense = weights
    dense_step = project_arm(dense, run, scenario).step.value

    def f(density):
        return w_arm * project_arm(arm, run, scenario, density).step.value - w_dense * dense_step

    fallback = arm.bytes_dense / (scenario.workers * arm.elements_per_step * arm.payload_element_bytes)
    hi = min(1.0, fallback) * (1 - 1e-9)
    lo = min(run.buckets_per_step / arm.elements_per_step, hi / 10)
    roots, wins = _crossings(f, lo, hi)
    note = f" (dense fallback from {fallback:.3g})" if fallback <= 1 else ""
    return _describe("density", boundary, roots, wins, lo, hi, lambda d: f"{d:.3g}", note)


def break_even_rate(arm: ArmInputs, dense: ArmInputs, run: RunInputs, scenario: Scenario,
                    boundary: str = "step") -> BreakEven:
    """The link rate (bits/s) below which ``arm`` at its measured density is cheaper than dense."""
    weights = _weights(arm, dense, boundary)
    if weights is None:
        return BreakEven("link rate", boundary, "n/a", None, "n/a: the target was not reached by both arms")
    if arm.sparse and falls_back_to_dense(arm.bytes_sent, arm.bytes_dense, scenario.workers):
        return BreakEven("link rate", boundary, "n/a", None,
                         f"n/a: at {scenario.workers} workers density {arm.density:.3g} falls back to dense")
    w_arm, w_dense = weights

    def f(bits):
        at = scenario.with_rate(bits)
        return w_arm * project_arm(arm, run, at).step.value - w_dense * project_arm(dense, run, at).step.value

    lo, hi = RATE_RANGE_BITS
    roots, wins = _crossings(f, lo, hi)
    return _describe("link rate", boundary, roots, wins, lo, hi, format_rate, "")

