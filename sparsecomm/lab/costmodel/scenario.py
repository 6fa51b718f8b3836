"""Where a run is projected to: p workers on a link, the per-message cost alpha, and the
model's switches (overlap, unpack rate, how the top-k payloads travel)."""
import math
from dataclasses import dataclass, replace

from sparsecomm.links.spec import Link, parse_link

# One TCP message over ethernet through the kernel and gloo: ~25 us is a typical one-way
# cost when the link names no latency of its own. An assumption, printed as such.
DEFAULT_ALPHA_S = 25e-6
MAX_WORKERS = 1_000_000
MAX_ALPHA_US = 1_000_000.0
PROJECTED_EXCHANGES = ("allgather", "owner", "auto")
"""How ``sparsecomm project`` may send a run's top-k payloads, whatever exchange the run used."""
MEASURED_EXCHANGES = (*PROJECTED_EXCHANGES, "shared-mask")
"""Exchanges a scenario may also model for arms measured on them (``sparsecomm scale --model-link``):
the shared mask's measured bytes, which no all-gather payload can stand for."""


def format_rate(bits_per_s: float) -> str:
    for scale, name in ((1e12, "Tbit/s"), (1e9, "Gbit/s"), (1e6, "Mbit/s"), (1e3, "kbit/s")):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:.3g} {name}"
    return f"{bits_per_s:.3g} bit/s"



@dataclass(frozen=True)
class Scenario:
    """Where to project to: p workers on a link, and the model's switches."""

    workers: int
    link: Link
    alpha_s: float
    alpha_source: str
    overlap: bool = False
    unpack_adds_per_s: float | None = None  # override of the measured rate
    exchange: str = "allgather"  # how the top-k arms' payloads travel: allgather, owner, auto (the cheaper), shared-mask

    def __post_init__(self):
        if self.exchange not in MEASURED_EXCHANGES:
            raise ValueError(f"exchange must be one of {MEASURED_EXCHANGES}, got {self.exchange!r}")
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or not 2 <= self.workers <= MAX_WORKERS:
            raise ValueError(f"workers must be an integer in [2, {MAX_WORKERS}], got {self.workers!r}")
        if not self.link.emulated:
            raise ValueError(f"link {self.link.name!r} has no known rate; projecting needs a rate such as '10gbit'")
        if not (math.isfinite(self.alpha_s) and 0 <= self.alpha_s <= MAX_ALPHA_US * 1e-6):
            raise ValueError(f"alpha must be in [0, {MAX_ALPHA_US:.0f}] us, got {self.alpha_s * 1e6:g} us")

    @property
    def rate_bytes_per_s(self) -> float:
        return self.link.bytes_per_s

    def with_rate(self, bits_per_s: float) -> "Scenario":
        return replace(self, link=Link(format_rate(bits_per_s), bits_per_s, self.link.latency_s))


def make_scenario(workers: int, link: str | Link, *, alpha_us: float | None = None, overlap: bool = False,
                  unpack_adds_per_s: float | None = None, exchange: str = "allgather") -> Scenario:
    """A scenario with alpha from ``alpha_us``, else the link's latency, else :data:`DEFAULT_ALPHA_S`."""
    link = parse_link(link) if isinstance(link, str) else link
    if alpha_us is not None:
        alpha, source = alpha_us * 1e-6, "given"
    elif link.latency_s > 0:
        alpha, source = link.latency_s, "the link's latency"
    else:
        alpha, source = DEFAULT_ALPHA_S, "assumed: the link names no latency; a typical TCP ethernet message"
    return Scenario(workers, link, alpha, source, overlap, unpack_adds_per_s, exchange)


