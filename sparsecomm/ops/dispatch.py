"""The dispatch point between the hook and the kernels.

The hook calls the functions here, never a kernel directly. Each op has a pure-torch
reference (in :mod:`sparsecomm.compress`); native implementations (C++/OpenMP, CUDA,
Triton) register themselves per device type with :func:`register_kernel` and take over for
tensors on that device. The reference stays the oracle in tests and the fallback when no
native kernel is available.
"""
from typing import Callable

import torch

from sparsecomm import compress

# op name -> reference implementation
_REFERENCE: dict[str, Callable] = {
    "select_and_pack": compress.select_and_pack,
    "unpack_add": compress.unpack_add,
}
# (op name, device type) -> native implementation
_KERNELS: dict[tuple[str, str], Callable] = {}


def register_kernel(op: str, device_type: str, fn: Callable) -> None:
    """Use ``fn`` instead of the reference for ``op`` on tensors of ``device_type``."""
    if op not in _REFERENCE:
        raise ValueError(f"register_kernel: op must be one of {sorted(_REFERENCE)}, got {op!r}")
    _KERNELS[(op, device_type)] = fn


def implementation(op: str, device_type: str) -> Callable:
    """The function that runs ``op`` for tensors on ``device_type``."""
    return _KERNELS.get((op, device_type), _REFERENCE[op])


def select_and_pack(acc: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Dispatching :func:`sparsecomm.compress.select_and_pack`."""
    return implementation("select_and_pack", acc.device.type)(acc, *args, **kwargs)


def unpack_add(gathered: torch.Tensor, out: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Dispatching :func:`sparsecomm.compress.unpack_add`."""
    return implementation("unpack_add", out.device.type)(gathered, out, *args, **kwargs)
