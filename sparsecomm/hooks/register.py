"""Registering the hook on a DDP model, with the checks DDP itself does not make."""
import torch

from sparsecomm.hooks.topk import TopKState, topk_hook


def register_topk_hook(ddp_model, state: TopKState | None = None, *, optimizer=None, **state_kwargs) -> TopKState:
    """Register :func:`topk_hook` on ``ddp_model`` and return its state.

    Pass either a ready ``state`` or the keyword arguments of :class:`TopKState`
    (``density=...``); the state is bound to the model, so residuals are keyed by the
    model's parameter names. Pass ``optimizer`` to be warned
    (:class:`~sparsecomm.hooks.optimizer.MomentumMismatchWarning`) when momentum
    correction is on and the optimizer applies momentum too.

    Raises:
        TypeError: ``ddp_model`` is not a DistributedDataParallel, or ``state`` is not a
            TopKState.
        ValueError: a hook is already registered on ``ddp_model`` (DDP allows one),
            both ``state`` and state keyword arguments were given, or ``state`` has a
            process group other than the DDP model's.
    """
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(
            "ddp_model must be a torch.nn.parallel.DistributedDataParallel, got "
            f"{type(ddp_model).__name__}: wrap the module with DDP(module) first"
        )
    # DDP keeps (hook, state) pairs here from register_comm_hook on; it raises a bare
    # RuntimeError only later, so check first and say what to do.
    registered = getattr(ddp_model, "_comm_hooks", [])
    if registered:
        names = [getattr(hook, "__qualname__", repr(hook)) for hook, _ in registered]
        raise ValueError(
            f"ddp_model already has a communication hook ({', '.join(names)}); DDP allows "
            "one per model: build a new DDP model to change it"
        )
    if state is None:
        state = TopKState(ddp_model.process_group, module=ddp_model, **state_kwargs)
    elif state_kwargs:
        raise ValueError(
            f"pass either state or TopKState keyword arguments, not both (got {sorted(state_kwargs)})"
        )
    elif not isinstance(state, TopKState):
        raise TypeError(f"state must be a sparsecomm.TopKState, got {type(state).__name__}")
    else:
        state.bind(ddp_model)  # also adopts the DDP model's process group when the state has none
    if optimizer is not None:
        state.check_optimizer(optimizer)
    ddp_model.register_comm_hook(state, topk_hook)
    return state
