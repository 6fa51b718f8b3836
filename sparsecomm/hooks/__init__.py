"""DDP communication hooks and their states."""
from sparsecomm.hooks.density_schedule import DensitySchedule
from sparsecomm.hooks.optimizer import MomentumMismatchWarning, dgc_optimizer
from sparsecomm.hooks.register import register_topk_hook
from sparsecomm.hooks.topk import DenseFallbackWarning, TopKState, topk_hook

__all__ = ["DenseFallbackWarning", "DensitySchedule", "MomentumMismatchWarning", "TopKState", "dgc_optimizer", "register_topk_hook",
           "topk_hook"]
