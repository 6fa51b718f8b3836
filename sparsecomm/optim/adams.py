r"""AdamS: Adam without the second moment; the momentum itself is the normalizer.

Zhang, Wang, Chen, "AdamS: Momentum Itself Can Be A Normalizer for LLM Pretraining and
Post-training", arXiv:2505.16363 (EMNLP 2025); the authors' code: github.com/pku-huzhang/AdamS
(``new_optimizers.py``).

The update, per element, at step :math:`t = 1, 2, \dots` with :math:`m_0 = 0`, gradient
:math:`g_t`, learning rate :math:`\eta`, weight decay :math:`\lambda` and
:math:`c_t = 1 - \beta_1^t` (:math:`c_t = 1` with ``bias_correction=False``):

.. math::

    v_t      &= \beta_2 \, (m_{t-1} / c_t)^2 + (1 - \beta_2) \, g_t^2  \\
    m_t      &= \beta_1 \, m_{t-1} + (1 - \beta_1) \, g_t             \\
    \theta_t &= (1 - \eta\lambda) \, \theta_{t-1} - \eta \, \frac{m_t / c_t}{\sqrt{v_t} + \epsilon}

The normalizer :math:`v_t` is built from the *previous* first moment and the *current*
gradient (computed before :math:`m` is updated) and is not stored: the only state is
``exp_avg`` (:math:`m`) and ``step``, the memory of SGD with momentum.

Where this follows what, and the choices made:

- The paper's equations: :math:`v_t = \beta_2 m_{t-1}^2 + (1-\beta_2) g_t^2` and
  :math:`\theta_t = \theta_{t-1} - \eta\, m_t / \sqrt{v_t}`, with AdamW's decoupled weight decay.
- Bias correction as the authors' code does it: both :math:`m_{t-1}` in the normalizer and
  :math:`m_t` in the numerator are divided by the same :math:`c_t = 1 - \beta_1^t` (not
  :math:`1 - \beta_1^{t-1}` for :math:`m_{t-1}`). The paper's algorithm box could not be
  read here; a third-party summary of the paper states its equations without bias
  correction. ``bias_correction=False`` gives that form (:math:`c_t = 1`).
- :math:`\epsilon` is added after the square root, and the weight decay multiplies
  :math:`\theta_{t-1}` by :math:`1 - \eta\lambda` before the step, as in the authors' code and
  in ``torch.optim.AdamW``.
- Defaults are AdamW's (``lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01``): the
  paper says AdamS inherits AdamW's hyperparameters (the authors' code defaults to
  ``lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1``, their GPT-2 configuration to lr 6e-4 with
  the same betas: the usual LLM AdamW settings, with lr warmup).
  A consequence to know: at step 1 (:math:`m_0 = 0`) every element moves by
  :math:`\eta / \sqrt{1 - \beta_2}` in the direction of its gradient's sign with bias
  correction (31.6 lr at :math:`\beta_2 = 0.999`, 4.5 lr at 0.95), by
  :math:`\eta (1 - \beta_1) / \sqrt{1 - \beta_2}` without (3.2 lr); Adam's first step is
  :math:`\eta`. By Cauchy-Schwarz the step per element is at most :math:`\eta
  \sqrt{\beta_1^2/\beta_2 + (1-\beta_1)^2 / (c_t^2 (1-\beta_2))}`, which falls to about
  3.3 lr at the defaults and 1.03 lr at :math:`\beta_2 = 0.95` once :math:`c_t \to 1`.
- Precision: ``exp_avg`` has the parameter's dtype, as ``torch.optim.AdamW``'s state does
  (bfloat16 parameters keep a bfloat16 momentum: SGD-with-momentum memory). The arithmetic of
  a float16/bfloat16 parameter runs in float32 (parameter, gradient and momentum upcast,
  rounded back once per step), where AdamW's ``foreach=False`` path stays in the
  parameter's dtype; float32 and float64 parameters compute in their own dtype.
- Sparse gradients and complex parameters are refused (``RuntimeError``); parameters
  whose ``grad`` is None are skipped (their state and step count do not move).

Why it matters for sparse synchronisation (top-k + error feedback, SCAPE arXiv:2607.01678
uses AdamS as its base optimizer): Adam's second moment is a second state that every rank
would need to keep consistent, and rebuilding it from a sparse, stale view of the gradient
distorts it. AdamS has one state, :math:`m`, updated from the synchronised gradient like
SGD's momentum; its normalizer is rebuilt every step from :math:`m_{t-1}` and the
synchronised :math:`g_t`, so replicas that agree on :math:`m` and receive the same
:math:`g_t` take the same step. Its momentum cannot be handed to the hook (DGC momentum
correction): it is also the normalizer, so the lab refuses ``adams`` on an arm whose hook
corrects momentum.
"""
import math

import torch

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _check_real(name: str, value, low: float, high: float, *, high_open: bool) -> float:
    """``value`` as a float in [low, high) or [low, high], else TypeError/ValueError naming it."""
    interval = f"[{low}, {high}{')' if high_open else ']'}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number in {interval}, got {type(value).__name__} {value!r}")
    value = float(value)
    if math.isnan(value) or value < low or (value >= high if high_open else value > high):
        raise ValueError(f"{name} must be in {interval}, got {value}")
    return value


class AdamS(torch.optim.Optimizer):
    r"""AdamS (arXiv:2505.16363): Adam whose normalizer is rebuilt from the momentum and the gradient.

    ``v = beta2 * (m_prev / c)**2 + (1 - beta2) * g**2``, ``m = beta1 * m_prev + (1 - beta1) * g``,
    ``p = p * (1 - lr * weight_decay) - lr * (m / c) / (sqrt(v) + eps)``, with
    ``c = 1 - beta1**step`` (1 when ``bias_correction=False``). The module docstring has
    the equations, their sources and the choices made.

    Args:
        params: parameters or parameter groups.
        lr: learning rate, in [0, inf).
        betas: (beta1, beta2), each in [0, 1): the momentum's decay and the weight of the
            previous momentum in the normalizer.
        eps: added to the normalizer's square root, in [0, inf).
        weight_decay: decoupled weight decay (as AdamW's), in [0, inf).
        bias_correction: divide the momentum by ``1 - beta1**step`` (the authors' code); False
            is the paper's equations without correction.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, bias_correction: bool = True):
        lr = _check_real("lr", lr, 0.0, math.inf, high_open=True)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise TypeError(f"betas must be a pair (beta1, beta2) of numbers in [0.0, 1.0), got {betas!r}")
        betas = (_check_real("betas[0]", betas[0], 0.0, 1.0, high_open=True),
                 _check_real("betas[1]", betas[1], 0.0, 1.0, high_open=True))
        eps = _check_real("eps", eps, 0.0, math.inf, high_open=True)
        weight_decay = _check_real("weight_decay", weight_decay, 0.0, math.inf, high_open=True)
        if not isinstance(bias_correction, bool):
            raise TypeError(f"bias_correction must be True or False, got {type(bias_correction).__name__} "
                            f"{bias_correction!r}")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                    "bias_correction": bias_correction}
        super().__init__(params, defaults)
        self.masks = None

    def follow_masks(self, masks) -> None:
        """Step only where a mask says (SCAPE's shared mask, ``exchange="shared-mask"``): before
        each step, ``masks.mask_of(p)`` gives a bool tensor shaped like ``p`` (or None: every
        entry). Off the mask the first moment is zeroed before the step, so there the momentum
        is 0, the normalizer is built from a zero gradient, and the parameter does not move
        (weight decay aside); a gradient there is taken as 0. ``register_topk_hook(...,
        exchange="shared-mask", optimizer=)``
        calls this; None stops it."""
        if masks is not None and not callable(getattr(masks, "mask_of", None)):
            raise TypeError(f"masks must have a mask_of(param) method (or be None), got {type(masks).__name__}")
        self.masks = masks

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamS step over every parameter with a gradient; returns ``closure()``'s loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamS does not support sparse gradients (use dense gradients, e.g. "
                                       "nn.Embedding(sparse=False))")
                if torch.is_complex(p):
                    raise RuntimeError("AdamS does not support complex parameters (view them as real: "
                                       "torch.view_as_real)")
                state = self.state[p]
                if not state:
                    # As torch.optim.AdamW (foreach=False): a float32 step count on the CPU, the
                    # momentum in the parameter's dtype and memory format.
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                step = state["step"].item()
                correction = 1.0 - beta1 ** step if group["bias_correction"] else 1.0
                mask = None if self.masks is None else self.masks.mask_of(p)
                if mask is not None:
                    state["exp_avg"].mul_(mask)
                _adams_update(p, p.grad, state["exp_avg"], lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                              weight_decay=weight_decay, correction=correction, mask=mask)
        return loss


def _adams_update(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, *, lr: float, beta1: float,
                  beta2: float, eps: float, weight_decay: float, correction: float,
                  mask: torch.Tensor | None = None) -> None:
    """One element-wise AdamS step of ``p`` in place (in float32 for a 16-bit ``p``); with a
    ``mask``, entries off it (whose momentum the caller zeroed) get no step, even at eps 0."""
    compute = torch.float32 if p.dtype in _LOW_PRECISION else p.dtype
    param = p if p.dtype == compute else p.to(compute)
    m = exp_avg if exp_avg.dtype == compute else exp_avg.to(compute)
    g = grad.to(compute)
    if mask is not None:  # off the mask the gradient is 0 (the shared mask's hook sends 0 there)
        g = torch.where(mask, g, 0.0)
    # The normalizer, from the previous momentum and the current gradient: before m moves.
    denom = (m / correction).square_().mul_(beta2).addcmul_(g, g, value=1.0 - beta2).sqrt_().add_(eps)
    m.mul_(beta1).add_(g, alpha=1.0 - beta1)
    if mask is not None:
        denom.masked_fill_(~mask, 1.0)  # m is 0 there: a step of 0 (0 / eps would be NaN at eps 0)
    if weight_decay:
        param.mul_(1.0 - lr * weight_decay)
    param.addcdiv_(m, denom, value=-lr / correction)
    if m is not exp_avg:
        exp_avg.copy_(m)
    if param is not p:
        p.copy_(param)
