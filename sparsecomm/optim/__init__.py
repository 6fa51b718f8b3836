"""Optimizers for sparse synchronisation: :class:`AdamS` (Adam without the second moment), the
optimizers that match the hook's momentum correction (:func:`dgc_optimizer`) and :class:`SignSGD`."""
from sparsecomm.optim.adams import AdamS
from sparsecomm.optim.dgc import MomentumMismatchWarning, dgc_optimizer
from sparsecomm.optim.sign_sgd import SignSGD

__all__ = ["AdamS", "MomentumMismatchWarning", "SignSGD", "dgc_optimizer"]
