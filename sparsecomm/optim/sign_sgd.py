"""Sign of the aggregate (DeMo-style): the optimizer half of the sign mode.

With the top-k hook and error feedback (``TopKState(density=..., error_feedback=True)``)
each rank's residual keeps what it has not sent yet (DeMo's momentum, with decay 1 where
DeMo decays by 0.999), and the reduced gradient is the average of every rank's selected
entries: zero almost everywhere. :class:`SignSGD` then moves each weight by ``lr`` in the
direction of that average's sign (sign(0) = 0: an entry nobody sent does not move), with
decoupled weight decay. The update's size no longer depends on the gradient's scale, only
its direction does, which is what lets DeMo and Psyche send 1-bit values: the sign is all
the optimizer reads (``value_codec="sign"`` sends exactly that, with a scale per chunk
that the sign then discards).
"""
import torch

from sparsecomm.hooks.state.settings import check_real


class SignSGD(torch.optim.Optimizer):
    """``p -= lr * (sign(grad) + weight_decay * p)``: the sign of the reduced gradient.

    Args:
        params: parameters or parameter groups.
        lr: step per weight, > 0 (sign updates move every touched weight by exactly lr).
        weight_decay: decoupled weight decay (as AdamW's), >= 0.
    """

    def __init__(self, params, lr: float, weight_decay: float = 0.0):
        check_real("lr", lr, 0.0, float("inf"), low_open=True, high_open=True)
        check_real("weight_decay", weight_decay, 0.0, float("inf"), low_open=False, high_open=True)
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group["weight_decay"]:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(p.grad), alpha=-group["lr"])
        return loss
