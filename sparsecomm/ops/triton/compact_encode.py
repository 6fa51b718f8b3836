"""Deprecated: the Triton kernels of exact top-k on the compact wire are
:mod:`sparsecomm.ops.triton.exact_topk_encode` (the op's name); ``compact_encode`` is its
``exact_topk_encode``. Importing this module warns once (DeprecationWarning)."""
import warnings

from sparsecomm.ops.triton.exact_topk_encode import exact_topk_encode as compact_encode  # noqa: F401

warnings.warn("sparsecomm.ops.triton.compact_encode is deprecated: use sparsecomm.ops.triton.exact_topk_encode "
              "(compact_encode is now exact_topk_encode)", DeprecationWarning, stacklevel=2)
