"""Optimizers that match the hook's momentum correction (DGC), and the mismatch check.

With ``TopKState(momentum=m)`` the hook keeps the velocity and sends it, so the optimizer
must not apply momentum again: SGD needs ``momentum=0``; Adam-family optimizers need
``betas[0] = 0`` (their first moment is a momentum). Applying it twice silently changes
the effective learning rate and the direction of the update.
"""
import warnings

import torch

from sparsecomm.hooks.state.settings import check_choice, check_real

OPTIMIZER_KINDS = ("sgd", "adamw", "adam")


class MomentumMismatchWarning(UserWarning):
    """The hook applies momentum correction and the optimizer applies momentum too."""


def dgc_optimizer(params, kind: str = "sgd", *, lr: float, weight_decay: float = 0.0, beta2: float = 0.999,
                  **kwargs) -> torch.optim.Optimizer:
    """An optimizer without momentum of its own, for a hook with momentum correction.

    ``kind``: ``"sgd"`` (plain SGD, the DGC setting), ``"adamw"`` or ``"adam"`` (with
    ``betas=(0, beta2)``: the second moment stays, the first is the hook's velocity).
    """
    kind = check_choice("kind", kind, OPTIMIZER_KINDS)
    lr = check_real("lr", lr, 0.0, float("inf"), low_open=True, high_open=True)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.0, weight_decay=weight_decay, **kwargs)
    beta2 = check_real("beta2", beta2, 0.0, 1.0, low_open=False, high_open=True)
    optimizer_class = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    return optimizer_class(params, lr=lr, betas=(0.0, beta2), weight_decay=weight_decay, **kwargs)


def own_momentum(optimizer: torch.optim.Optimizer) -> list[tuple[int, float]]:
    """(param group, momentum) for every group that applies momentum of its own."""
    found = []
    for index, group in enumerate(optimizer.param_groups):
        momentum = group.get("momentum", 0.0) or (group["betas"][0] if "betas" in group else 0.0)
        if momentum:
            found.append((index, float(momentum)))
    return found


def warn_on_double_momentum(hook_momentum: float, optimizer: torch.optim.Optimizer) -> bool:
    """Warn (and return True) if the hook corrects momentum and ``optimizer`` has its own."""
    if hook_momentum == 0:
        return False
    groups = own_momentum(optimizer)
    if groups:
        listed = ", ".join(f"group {index}: {value}" for index, value in groups)
        warnings.warn(
            f"TopKState(momentum={hook_momentum}) applies momentum correction, and "
            f"{type(optimizer).__name__} applies momentum too ({listed}): momentum is applied twice. "
            "Build the optimizer with sparsecomm.dgc_optimizer(...) (momentum=0, or betas[0]=0 for Adam).",
            MomentumMismatchWarning,
            stacklevel=3,
        )
        return True
    return False
