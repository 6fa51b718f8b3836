"""Compression math as plain tensor functions: no process group, no hook, no state.

These are the reference implementations. The hook calls them through the dispatch point
in :mod:`sparsecomm.ops`, where native kernels can replace them; tests use them as the
oracle.
"""
from sparsecomm.compress.error_feedback import compensate, residual_after_sending, select_and_pack, to_wire_dtype
from sparsecomm.compress.packing import payload_nbytes, pack_into, unpack_add
from sparsecomm.compress.randomk import random_indices
from sparsecomm.compress.sampled_threshold import sampled_threshold_indices
from sparsecomm.compress.topk import num_selected, per_parameter, topk_indices

SELECTORS = {
    "exact": topk_indices,
    "sampled": sampled_threshold_indices,
}

__all__ = [
    "SELECTORS",
    "compensate",
    "num_selected",
    "pack_into",
    "per_parameter",
    "payload_nbytes",
    "random_indices",
    "residual_after_sending",
    "sampled_threshold_indices",
    "select_and_pack",
    "to_wire_dtype",
    "topk_indices",
    "unpack_add",
]
