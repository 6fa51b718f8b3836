"""Kernels behind one dispatch point; see :mod:`sparsecomm.ops.dispatch`."""
from sparsecomm.ops.dispatch import (
    ef_threshold_pack,
    ef_topk_pack,
    implementation,
    payload_views,
    register_kernel,
    select_and_pack,
    unpack_add,
    unpack_payloads,
    unregister_kernel,
)

__all__ = [
    "ef_threshold_pack",
    "ef_topk_pack",
    "implementation",
    "payload_views",
    "register_kernel",
    "select_and_pack",
    "unpack_add",
    "unpack_payloads",
    "unregister_kernel",
]
