"""What a link is: a name such as ``1gbit`` or ``10gbit``, parsed into a rate and a latency.

Used by the link emulation (``sparsecomm compare --link 1gbit``) and by the cost model
(``sparsecomm project --link 100gbit``). ``loopback`` means no emulation: the ranks talk
over the machine's loopback device at whatever speed it has (unknown in advance, so its
rate is None).

Accepted forms (case-insensitive): ``loopback``; ``<number><unit>`` with unit one of
``kbit``, ``mbit``, ``gbit``, ``tbit`` (``1gbit``, ``2.5gbit``, ``100gbit``); optionally
followed by ``@<number><us|ms>``, a one-way latency per message (``1gbit@100us``). Needs
no torch.
"""
import re
from dataclasses import dataclass

_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_LATENCY_PER_SECOND = {"us": 1e6, "ms": 1e3}
_PATTERN = re.compile(r"^(?P<rate>\d+(?:\.\d+)?)(?P<unit>[kmgt]bit)(?:@(?P<lat>\d+(?:\.\d+)?)(?P<lat_unit>us|ms))?$")
ACCEPTED = "'loopback' or a rate such as '1gbit', '10gbit', '2.5gbit', '100mbit' (units kbit/mbit/gbit/tbit), " \
           "optionally with a latency: '1gbit@100us', '10gbit@1ms'"
RATE_RANGE_BITS = (1e3, 1e13)  # accepted rates, bit/s: 1kbit .. 10tbit


@dataclass(frozen=True)
class Link:
    """A point-to-point link per rank: ``rate_bits_per_s`` each way, ``latency_s`` one way."""

    name: str
    rate_bits_per_s: float | None  # None: loopback (not emulated, rate not known)
    latency_s: float = 0.0

    @property
    def emulated(self) -> bool:
        return self.rate_bits_per_s is not None

    @property
    def bytes_per_s(self) -> float | None:
        return None if self.rate_bits_per_s is None else self.rate_bits_per_s / 8

    def __str__(self) -> str:
        return self.name


def parse_link(text: str) -> Link:
    """Parse a link name; raises ValueError naming the accepted forms."""
    if not isinstance(text, str):
        raise ValueError(f"link must be {ACCEPTED}; got {text!r}")
    name = text.strip().lower()
    if name == "loopback":
        return Link("loopback", None)
    match = _PATTERN.match(name)
    if match is None:
        raise ValueError(f"link must be {ACCEPTED}; got {text!r}")
    rate = float(match["rate"]) * _UNITS[match["unit"]]
    if not RATE_RANGE_BITS[0] <= rate <= RATE_RANGE_BITS[1]:
        raise ValueError(f"link rate must be between 1kbit and 10tbit; got {text!r}")
    latency = float(match["lat"]) / _LATENCY_PER_SECOND[match["lat_unit"]] if match["lat"] else 0.0
    if latency > 10.0:
        raise ValueError(f"link latency must be at most 10 s; got {text!r}")
    return Link(name, rate, latency)


def link_name(bits_per_s: float) -> str:
    """The name :func:`parse_link` reads back as ``bits_per_s`` (to 6 significant digits), in
    the largest unit that keeps the number at least 1: 4.1e8 is ``410mbit``, 1.2e9 ``1.2gbit``."""
    if not RATE_RANGE_BITS[0] <= bits_per_s <= RATE_RANGE_BITS[1]:
        raise ValueError(f"a link's rate is between 1kbit and 10tbit; got {bits_per_s!r} bit/s")
    unit, scale = next((u, s) for u, s in sorted(_UNITS.items(), key=lambda item: -item[1]) if bits_per_s >= s)
    return f"{bits_per_s / scale:g}{unit}"
