"""sparsecomm: top-k + error-feedback gradient sparsification for PyTorch DDP and FSDP2.

Two lines in an existing DDP job::

    import sparsecomm
    sparsecomm.register_topk_hook(ddp_model, density=0.01)

or, for an FSDP2 model sharded over ``mesh["shard"]`` of a (replicate, shard) mesh,
``sparsecomm.register_hsdp_hook(model, mesh, density=0.01)``.
"""
from sparsecomm import moved_modules
from sparsecomm.errors import ConservationError, NonFiniteSyncError, SparsecommError, WireIntegrityError

moved_modules.install()  # modules that moved keep their old names, with a warning

__version__ = "0.1.0"

# The hook API needs torch; it is imported on first use so that reading results
# (ledger, tolerance checker, plots) works without importing torch at all.
_HOOK_NAMES = ("DenseFallbackWarning", "DensitySchedule", "MomentumMismatchWarning", "TopKState", "dgc_optimizer", "register_topk_hook",
               "topk_hook")


def __getattr__(name):
    if name == "SparseDeltaAverager":
        from sparsecomm.averaging.sparse_delta import SparseDeltaAverager

        return SparseDeltaAverager
    if name == "register_hsdp_hook":
        from sparsecomm.fsdp import register_hsdp_hook

        return register_hsdp_hook
    if name == "AdamS":
        from sparsecomm.optim import AdamS

        return AdamS
    if name in _HOOK_NAMES:
        from sparsecomm import hooks

        return getattr(hooks, name)
    raise AttributeError(f"module 'sparsecomm' has no attribute {name!r}")


__all__ = ["AdamS", "ConservationError", "NonFiniteSyncError", "SparseDeltaAverager", "SparsecommError", "WireIntegrityError", *_HOOK_NAMES,
           "register_hsdp_hook", "__version__"]
