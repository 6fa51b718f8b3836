"""The hook takes over the optimizer's momentum: the default wherever the optimizer is known
(``register_topk_hook(..., optimizer=)``, ``register_hsdp_hook(..., optimizer=)``, the
framework integrations).

Plain top-k + error feedback feeds sparse, delayed gradients into the optimizer's own
first moment, which loses quality with AdamW (the ``topk-ef`` arm: ``worse`` on the default
experiment). Momentum correction (DGC) keeps the velocity in the hook instead, before
sparsification, and the optimizer runs without a first moment of its own: AdamW with
``betas=(0, beta2)``, the ``topk-dgc`` arm, ``equivalent`` to dense on the default
experiment. So an integration given ``momentum="auto"`` (its default) moves the
optimizer's own coefficient into the hook: AdamW/Adam ``betas[0]`` (0.9 by default),
SGD ``momentum`` (and ``nesterov``), Adafactor ``beta1``; the user's algorithm keeps its
momentum, now applied where sparsification cannot distort it. A hook registered without
its optimizer cannot do this, and is warned (:data:`UNCORRECTED_MOMENTUM`).

The original coefficient is recorded in each changed param group (:data:`MOVED_KEY`),
which the optimizer's own ``state_dict`` saves: a run resumed from a checkpoint (whose
optimizer comes back already changed) finds it and resolves the same momentum.

Two steps, so that nothing changes if the set-up is refused: :func:`plan_handover` reads
the optimizers and raises for any it cannot adapt; :meth:`Handover.apply` changes them
once the hook is registered.
"""
import dataclasses
import warnings

import torch

from sparsecomm.optim.dgc import MomentumMismatchWarning
from sparsecomm.hooks.state.settings import check_real

AUTO = "auto"
MOVED_KEY = "sparsecomm_moved_momentum"
"""Param-group key: {"momentum": m, "nesterov": n}, the optimizer's own before the hook took it."""


class OptimizerChangedWarning(UserWarning):
    """An integration changed the user's optimizer (said once, on rank 0, at start-up)."""


@dataclasses.dataclass(frozen=True)
class _Kind:
    """How one optimizer class holds its first moment."""

    name: str  # what the messages call it
    key: str  # the param-group key

    def read(self, group: dict) -> tuple[float, bool]:
        """(momentum, nesterov) the group applies itself now."""
        if self.key == "betas":
            return float(group["betas"][0]), False
        if self.key == "beta1":
            return float(group["beta1"] or 0.0), False
        return float(group["momentum"]), bool(group.get("nesterov", False))

    def change(self, momentum: float, nesterov: bool, group: dict) -> str:
        """What turning the first moment ``momentum`` off does to the group, as the user wrote it."""
        if self.key == "betas":
            rest = tuple(float(b) for b in group["betas"][1:])
            return f"{self.name} betas {(momentum, *rest)} -> {(0.0, *rest)}"
        if self.key == "beta1":
            return f"{self.name} beta1 {momentum} -> None"
        return f"{self.name} momentum {momentum} -> 0.0" + (", nesterov True -> False" if nesterov else "")

    @property
    def moment(self) -> str:
        """What the messages call the optimizer's own momentum."""
        return "momentum" if self.key == "momentum" else "first moment"

    def turn_off(self, group: dict) -> None:
        if self.key == "betas":
            group["betas"] = (0.0, *tuple(group["betas"])[1:])
        elif self.key == "beta1":
            group["beta1"] = None  # Adafactor: None means no first moment
        else:
            group["momentum"] = 0.0
            group["nesterov"] = False  # torch refuses Nesterov without momentum


def _kind(optimizer) -> _Kind | None:
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return _Kind(type(optimizer).__name__, "betas")
    if isinstance(optimizer, torch.optim.SGD):
        return _Kind(type(optimizer).__name__, "momentum")
    if type(optimizer).__name__ == "Adafactor" and "beta1" in optimizer.defaults:  # transformers' Adafactor
        return _Kind("Adafactor", "beta1")
    return None


def unwrap(optimizer):
    """The torch optimizer inside a framework's wrapper (Accelerate's AcceleratedOptimizer,
    Lightning's LightningOptimizer)."""
    for attribute in ("optimizer", "_optimizer"):
        inner = getattr(optimizer, attribute, None)
        if isinstance(inner, torch.optim.Optimizer):
            return inner
    return optimizer


def check_momentum_option(owner: str, momentum) -> None:
    """``momentum`` is "auto" or a number in [0, 1) (TopKState checks the number itself)."""
    if isinstance(momentum, str) and momentum != AUTO:
        raise ValueError(f"{owner}: momentum must be {AUTO!r} (take the optimizer's) or a number in [0, 1), "
                         f"got {momentum!r}")


@dataclasses.dataclass
class Handover:
    """What :func:`plan_handover` decided: the hook's momentum and the optimizer changes."""

    momentum: float
    nesterov: bool
    _changes: list  # (optimizer kind, param group, original (momentum, nesterov))

    def hook_options(self, options: dict) -> dict:
        """``options`` with momentum (and, when taken from the optimizer, nesterov) resolved."""
        return {**options, "momentum": self.momentum, "nesterov": self.nesterov}

    def apply(self) -> str | None:
        """Turn the optimizers' own momentum off; the sentence saying what changed (None: nothing)."""
        said = []
        for kind, group, (momentum, nesterov) in self._changes:
            group.setdefault(MOVED_KEY, {"momentum": momentum, "nesterov": nesterov})
            change = kind.change(momentum, nesterov, group)
            kind.turn_off(group)
            if change not in said:
                said.append(change)
        if not said:
            return None
        replaced = sorted({f"{kind.name}'s {kind.moment}" for kind, _, _ in self._changes})
        return (f"{'; '.join(said)}: the hook's momentum correction (momentum={self.momentum}"
                f"{', nesterov=True' if self.nesterov else ''}) replaces {' and '.join(replaced)} "
                "(pass momentum=0 to keep the optimizer as it is)")


def plan_handover(owner: str, optimizers, options: dict) -> Handover:
    """Decide the hook's momentum for ``options["momentum"]`` ("auto", the default, or a
    number) and which param groups of ``optimizers`` give theirs up; raise before anything
    changes. ``options["nesterov"]`` when given, else the optimizer's with "auto".

    Raises:
        ValueError: an optimizer whose first moment the integration cannot turn off (only
            torch SGD, Adam, AdamW and transformers' Adafactor), SGD with dampening,
            param groups with different momenta under "auto", or "auto" without an optimizer.
    """
    momentum, nesterov = options.get("momentum", AUTO), options.get("nesterov")
    check_momentum_option(owner, momentum)
    if momentum == AUTO and not options.get("error_feedback", True):
        momentum = 0.0  # momentum correction needs error feedback: leave the optimizer as it is
    if momentum != AUTO and check_real("momentum", momentum, 0.0, 1.0, low_open=False, high_open=True) == 0:
        return Handover(0.0, bool(nesterov), [])  # the user's choice: plain error feedback, optimizer as it is
    optimizers = [unwrap(o) for o in optimizers]
    if not optimizers and momentum == AUTO:
        raise ValueError(f"{owner}: momentum='auto' takes the optimizer's momentum into the hook, but there is no "
                         "optimizer: pass the optimizer, or momentum= explicitly (a number in [0, 1))")
    originals = []
    for optimizer in optimizers:
        kind = _kind(optimizer)
        if kind is None:
            raise ValueError(
                f"{owner}: cannot move the momentum of {type(optimizer).__name__} into the hook's momentum "
                "correction: the integrations can turn off the first moment of torch.optim.SGD, Adam, AdamW and "
                "transformers' Adafactor only. Use one of those, or pass momentum=0 to keep "
                f"{type(optimizer).__name__} as it is (plain error feedback: quality not measured with it)"
            )
        for index, group in enumerate(optimizer.param_groups):
            moved = group.get(MOVED_KEY)  # a resumed optimizer: already given up
            own = (float(moved["momentum"]), bool(moved["nesterov"])) if moved else kind.read(group)
            if kind.key == "momentum" and own[0] and group.get("dampening", 0):
                raise ValueError(
                    f"{owner}: {kind.name} param group {index} has dampening={group['dampening']}; the hook's "
                    "momentum correction has none (u = momentum * u + g): set dampening=0, or pass momentum=0"
                )
            originals.append((kind, group, index, own))
    if momentum == AUTO:
        found = sorted({own for _, _, _, own in originals})
        if len(found) > 1:
            listed = ", ".join(f"{kind.name} group {index}: momentum {own[0]}, nesterov {own[1]}"
                               for kind, _, index, own in originals)
            raise ValueError(f"{owner}: momentum='auto' needs one momentum for the whole model (the hook has one), "
                             f"but the param groups differ ({listed}): pass momentum= explicitly")
        momentum, own_nesterov = found[0]
        nesterov = own_nesterov if nesterov is None else nesterov
    changes = [(kind, group, own) for kind, group, _, own in originals if momentum and own[0]]
    return Handover(float(momentum), bool(nesterov), changes)


def announce(owner: str, message: str | None, rank: int, category=OptimizerChangedWarning) -> None:
    """Say what changed in the optimizer (or, with another ``category``, what was not done), once, on rank 0."""
    if message is not None and rank == 0:
        warnings.warn(f"{owner}: {message}", category, stacklevel=3)


UNCORRECTED_MOMENTUM = (
    "no optimizer given, so the hook runs plain top-k + error feedback, which feeds sparse, delayed gradients into "
    "the optimizer's own momentum: with AdamW (or SGD with momentum) that loses quality (the lab's topk-ef arm is "
    "'worse' on the default task). Pass optimizer=your_optimizer: the hook then takes over its momentum (momentum "
    "correction; AdamW runs with betas[0]=0), as the framework integrations do. Pass momentum=0 to keep plain error "
    "feedback and silence this warning.")
"""What a hook registered without its optimizer and without ``momentum`` is told (rank 0, once)."""


def resolve_for_registration(owner: str, optimizer, options: dict) -> tuple[dict, Handover | None]:
    """TopKState keyword arguments for a hook registered by hand (``register_topk_hook``,
    ``register_hsdp_hook``), and the optimizer change to apply once it is registered.

    With ``optimizer``, ``momentum`` defaults to "auto" (:func:`plan_handover`: the
    optimizer's momentum moves into the hook). Without one, "auto" is refused; a call that
    leaves momentum unset with error feedback on keeps the plain hook and is warned
    (:class:`MomentumMismatchWarning`, rank 0) that AdamW loses quality so.
    """
    if optimizer is None:
        if options.get("momentum") == AUTO:
            raise ValueError(f"{owner}: momentum='auto' takes the optimizer's momentum into the hook, but no "
                             "optimizer was given: pass optimizer=, or momentum= a number in [0, 1)")
        return options, None
    handover = plan_handover(owner, [optimizer], {"momentum": AUTO, **options})  # raises before anything changes
    return handover.hook_options(options), handover


def leaves_momentum_uncorrected(optimizer, options: dict) -> bool:
    """True when a hook registered without an optimizer would feed sparse gradients into an
    unknown optimizer's momentum (momentum unset, error feedback on)."""
    return optimizer is None and "momentum" not in options and options.get("error_feedback", True)
