"""Checks of user-supplied hook settings: each names the argument and the accepted range.

They run when a State is built, so bad input fails before DDP issues any collective.
"""
import importlib.util
import math
import numbers

import torch

VALUE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_real(name: str, value, low: float, high: float, *, low_open: bool, high_open: bool) -> float:
    """``value`` as a float inside the interval, else TypeError/ValueError naming ``name``."""
    interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number in {interval}, got {type(value).__name__} {value!r}")
    value = float(value)
    too_low = value <= low if low_open else value < low
    too_high = value >= high if high_open else value > high
    if math.isnan(value) or too_low or too_high:
        raise ValueError(f"{name} must be in {interval}, got {value}")
    return value


def check_int(name: str, value, low: int, high: int | None = None) -> int:
    """``value`` as an int in [low, high] (high None: unbounded), else TypeError/ValueError naming ``name``."""
    accepted = f">= {low}" if high is None else f"in [{low}, {high}]"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer {accepted}, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name} must be an integer {accepted}, got {value}")
    return int(value)


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def check_choice(name: str, value, choices: tuple) -> object:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def check_value_dtype(value, name: str = "value_dtype") -> torch.dtype | None:
    if value is None or value in VALUE_DTYPES:
        return value
    allowed = ", ".join(["None"] + [str(d) for d in VALUE_DTYPES])
    raise ValueError(f"{name} must be one of {allowed}; got {value!r}")


def check_transport(transport, selector: str) -> str:
    """``transport`` if it is usable here with ``selector``, else ValueError naming it.

    Only what needs no process group and does not start MPI is checked here; the first
    hook call checks the MPI world against the process group (see TopKState).
    """
    from sparsecomm.comm import TRANSPORTS

    check_choice("transport", transport, TRANSPORTS)
    if transport != "mpi":
        return transport
    if importlib.util.find_spec("mpi4py") is None:
        raise ValueError(
            "transport='mpi' needs mpi4py, which is not installed (pip install mpi4py mpich, or "
            f"sparsecomm[mpi]); transport must be one of {', '.join(map(repr, TRANSPORTS))}"
        )
    if selector == "random":
        raise ValueError(
            "transport='mpi' all-gathers sparse payloads, but selector='random' allreduces its values over "
            "the process group and would never use it: use transport='c10d' with selector='random'"
        )
    return transport
