"""sparsecomm: top-k + error-feedback gradient sparsification for PyTorch DDP.

Two lines in an existing DDP job::

    import sparsecomm
    sparsecomm.register_topk_hook(ddp_model, density=0.01)
"""
from sparsecomm.errors import ConservationError, SparsecommError
from sparsecomm.hooks import TopKState, register_topk_hook, topk_hook

__version__ = "0.1.0"

__all__ = [
    "ConservationError",
    "SparsecommError",
    "TopKState",
    "register_topk_hook",
    "topk_hook",
    "__version__",
]
