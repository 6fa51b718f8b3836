"""DDP communication hooks and their states."""
from sparsecomm.hooks.register import register_topk_hook
from sparsecomm.hooks.topk import TopKState, topk_hook

__all__ = ["TopKState", "register_topk_hook", "topk_hook"]
