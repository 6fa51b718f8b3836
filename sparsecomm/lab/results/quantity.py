"""A number the lab prints, with what it means: value, unit, boundary, link, and whether it
was measured or modelled.

- **Boundary**: what the number covers. ``step`` (one training step), ``steps_to_target``,
  ``time_to_target`` (wall clock to the target, evaluation included) or ``end_to_end``
  (setup + step x steps + checkpoint + expected recovery).
- **Link**: the link between the ranks the number belongs to (measured over, or modelled on).
- **Kind**: ``measured`` (the ledger, from a run's result files) or ``modelled`` (the cost
  model's projections, :mod:`sparsecomm.lab.costmodel`). The model only computes a step and
  a time to target, so a modelled quantity takes only those two boundaries.

Adding or dividing two quantities that differ in any of kind, boundary, unit or link raises
:class:`BoundaryError`: a step never adds to a total, a 1 Gb/s figure never divides a
loopback one, and a modelled figure never adds to or divides a measured one. The one
cross-boundary product, step x steps, is the ledger's own line item
(:func:`sparsecomm.lab.ledger.step_cost_to_target`). ``value=None`` is not known (not measured
yet, or not computable); it is never zero, and a sum with it is not known either.

Needs no torch.
"""
from dataclasses import dataclass

MEASURED, MODELLED = "measured", "modelled"
BOUNDARIES = ("step", "steps_to_target", "time_to_target", "end_to_end")
MODEL_BOUNDARIES = ("step", "time_to_target")
_BOUNDARIES_OF = {MEASURED: BOUNDARIES, MODELLED: MODEL_BOUNDARIES}


class BoundaryError(TypeError):
    """Two quantities of different kinds, boundaries, units or links were combined."""


def format_value(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.1f} s"
    if unit == "B":
        for scale, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
            if value >= scale:
                return f"{value / scale:.2f} {name}"
        return f"{value:.0f} B"
    return f"{value:g} {unit}"


@dataclass(frozen=True)
class Quantity:
    """A value with its unit, boundary, link and kind; ``value=None`` means not known."""

    value: float | None
    unit: str
    boundary: str
    note: str = ""
    link: str | None = "loopback"  # None: a modelled figure not tied to a named link
    kind: str = MEASURED

    def __post_init__(self):
        if self.kind not in _BOUNDARIES_OF:
            raise ValueError(f"kind must be {MEASURED!r} or {MODELLED!r}, got {self.kind!r}")
        allowed = _BOUNDARIES_OF[self.kind]
        if self.boundary not in allowed:
            raise ValueError(f"boundary must be one of {allowed}, got {self.boundary!r}")

    @classmethod
    def modelled(cls, value: float | None, unit: str, boundary: str, note: str = "",
                 link: str | None = None) -> "Quantity":
        """A figure computed by the cost model: boundary ``step`` or ``time_to_target``."""
        return cls(value, unit, boundary, note, link, MODELLED)

    @property
    def known(self) -> bool:
        return self.value is not None

    @property
    def measured(self) -> bool:
        """A measured quantity with a value (the ledger's "measured", as opposed to "not measured")."""
        return self.kind == MEASURED and self.known

    def describe(self) -> str:
        """The unit with what it is: ``s [boundary: step, link: loopback]``; a modelled one says so."""
        prefix = "modelled, " if self.kind == MODELLED else ""
        return f"{self.unit} [{prefix}boundary: {self.boundary}, link: {self.link}]"

    def _check_compatible(self, other: "Quantity", operation: str) -> None:
        if not isinstance(other, Quantity):
            raise BoundaryError(f"cannot {operation} a {self.kind} quantity and {type(other).__name__}")
        if (self.kind, self.boundary, self.unit, self.link) != (other.kind, other.boundary, other.unit, other.link):
            why = f" (a {MODELLED} figure never combines with a {MEASURED} one)" if self.kind != other.kind else ""
            raise BoundaryError(f"cannot {operation} {self.describe()} and {other.describe()}{why}")

    def __add__(self, other: "Quantity") -> "Quantity":
        self._check_compatible(other, "add")
        if not (self.known and other.known):
            return Quantity(None, self.unit, self.boundary, f"not {self.kind}: a summand is not {self.kind}",
                            self.link, self.kind)
        return Quantity(self.value + other.value, self.unit, self.boundary, link=self.link, kind=self.kind)

    def speedup_over(self, baseline: "Quantity") -> "Speedup":
        """``baseline / self`` (a cost ratio: > 1 means this is cheaper)."""
        self._check_compatible(baseline, "divide")
        if not (self.known and baseline.known) or self.value == 0:
            return Speedup(None, self.boundary, self.link, self.kind)
        return Speedup(baseline.value / self.value, self.boundary, self.link, self.kind)

    @property
    def label(self) -> str:
        """What a modelled figure is printed with, everywhere: ``[modelled, boundary: step]``."""
        return f"[{self.kind}, boundary: {self.boundary}]"

    @property
    def shown(self) -> str:
        """The value with its unit, without the label; ``not measured`` or ``n/a`` without one."""
        if self.known:
            return format_value(self.value, self.unit)
        return "not measured" if self.kind == MEASURED else "n/a"

    def __str__(self) -> str:
        # A measured figure prints its value alone (the ledger's legend names the boundaries
        # once); a modelled one always carries its label, so it is never read as measured.
        return self.shown if self.kind == MEASURED else f"{self.shown} {self.label}"

    def to_json(self) -> dict:
        return {"value": self.value, "unit": self.unit, "boundary": self.boundary, "kind": self.kind,
                "note": self.note}


@dataclass(frozen=True)
class Speedup:
    ratio: float | None
    boundary: str
    link: str | None = "loopback"
    kind: str = MEASURED

    def __str__(self) -> str:
        shown = "n/a" if self.ratio is None else f"{self.ratio:.2f}x"
        prefix = "modelled, " if self.kind == MODELLED else ""
        return f"{shown} ({prefix}boundary: {self.boundary}, link: {self.link})"
