"""DDP communication hooks and their states.

Floors, each importing only those below it: ``state`` (settings, memories, counters), ``wires``
(how a bucket travels), ``pipeline`` (the hook's own steps around the wire), then the hook
(``topk.py``), its state (``topk_state.py``) and its registration (``register.py``) here. The
names below load on first use, so that a lower floor (or ``sparsecomm.optim``, which the state
uses) can be imported on its own without loading the hook.
"""
import importlib

_WHERE = {
    "DenseFallbackWarning": "sparsecomm.hooks.topk",
    "TopKState": "sparsecomm.hooks.topk",
    "topk_hook": "sparsecomm.hooks.topk",
    "register_topk_hook": "sparsecomm.hooks.register",
    "DensitySchedule": "sparsecomm.hooks.state.settings",
    "MomentumMismatchWarning": "sparsecomm.optim.dgc",
    "dgc_optimizer": "sparsecomm.optim.dgc",
}


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'sparsecomm.hooks' has no attribute {name!r}")


__all__ = sorted(_WHERE)
