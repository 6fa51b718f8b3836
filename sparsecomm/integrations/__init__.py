"""The top-k hook inside training frameworks that wrap DDP themselves.

- :class:`SparseCommCallback` (``sparsecomm.integrations.lightning``): a PyTorch
  Lightning callback; needs ``pip install 'sparsecomm[lightning]'``.
- :func:`register_topk_hook_accelerate` (``sparsecomm.integrations.accelerate``):
  Hugging Face Accelerate; needs ``pip install 'sparsecomm[accelerate]'``.
- :class:`SparseCommTrainerCallback` (``sparsecomm.integrations.transformers``): a
  Hugging Face ``Trainer`` callback; needs ``pip install 'sparsecomm[transformers]'``.

By default each moves the optimizer's own momentum into the hook (momentum correction),
saying so on rank 0 with an :class:`OptimizerChangedWarning`
(:mod:`sparsecomm.hooks.momentum_handover`).

Nothing here imports a framework until one of these names is used: importing
``sparsecomm`` or this package never requires Lightning, Accelerate or Transformers.
"""
import importlib

_EXPORTS = {
    "SparseCommCallback": "sparsecomm.integrations.lightning",
    "register_topk_hook_accelerate": "sparsecomm.integrations.accelerate",
    "SparseCommTrainerCallback": "sparsecomm.integrations.transformers",
    "OptimizerChangedWarning": "sparsecomm.hooks.momentum_handover",
}


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sparsecomm.integrations' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = sorted(_EXPORTS)
