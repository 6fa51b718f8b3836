"""Registering the hook on a DDP model, with the checks DDP itself does not make."""
import torch

from sparsecomm.hooks import momentum_handover
from sparsecomm.optim.adams import AdamS
from sparsecomm.optim.dgc import MomentumMismatchWarning
from sparsecomm.hooks.topk import TopKState, topk_hook

OWNER = "register_topk_hook"


def register_topk_hook(ddp_model, state: TopKState | None = None, *, optimizer=None, **state_kwargs) -> TopKState:
    """Register :func:`topk_hook` on ``ddp_model`` and return its state.

    Pass either a ready ``state`` or the keyword arguments of :class:`TopKState`
    (``density=...``); the state is bound to the model, so residuals are keyed by the
    model's parameter names.

    Pass the training loop's ``optimizer`` (torch SGD, Adam, AdamW, or transformers'
    Adafactor): with ``momentum`` left unset (or ``"auto"``) the hook takes over the
    optimizer's momentum (momentum correction; AdamW's ``betas[0]`` becomes 0, SGD's
    ``momentum`` 0), which holds quality where plain error feedback into AdamW loses it
    (:mod:`sparsecomm.hooks.momentum_handover`; said once on rank 0 with an
    ``OptimizerChangedWarning``). ``momentum=0`` keeps the optimizer as it is. Without
    an optimizer and without ``momentum``, the hook is plain top-k + error feedback and a
    :class:`~sparsecomm.optim.dgc.MomentumMismatchWarning` says so on rank 0. With
    a ready ``state``, ``optimizer`` is only checked (a warning if both apply momentum).

    ``exchange="shared-mask"`` (SCAPE's reducer) synchronises the first moment of the job's
    :class:`sparsecomm.optim.AdamS`, which ``optimizer`` must be (it keeps its momentum; the
    hook's ``momentum`` stays 0), and links the two (``state.attach_optimizer``).

    Raises (before anything changes, the optimizer included):
        TypeError: ``ddp_model`` is not a DistributedDataParallel, or ``state`` is not a
            TopKState.
        ValueError: a hook is already registered on ``ddp_model`` (DDP allows one),
            both ``state`` and state keyword arguments were given, ``exchange="shared-mask"``
            without an AdamS optimizer or with ``momentum``, ``state`` has a
            process group other than the DDP model's, ``momentum="auto"`` without an
            optimizer, or an optimizer whose momentum cannot be moved into the hook.
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
    handover, built = None, state is None
    shared_mask = (state_kwargs if built else vars(state.config)).get("exchange") == "shared-mask"
    if shared_mask:
        check_shared_mask_optimizer(optimizer, state_kwargs)
    if built and shared_mask:  # AdamS keeps its momentum: the hook synchronises it
        state = TopKState(ddp_model.process_group, module=ddp_model, **state_kwargs)
    elif built:
        options, handover = momentum_handover.resolve_for_registration(OWNER, optimizer, state_kwargs)
        state = TopKState(ddp_model.process_group, module=ddp_model, **options)
    elif state_kwargs:
        raise ValueError(
            f"pass either state or TopKState keyword arguments, not both (got {sorted(state_kwargs)})"
        )
    elif not isinstance(state, TopKState):
        raise TypeError(f"state must be a sparsecomm.TopKState, got {type(state).__name__}")
    else:
        state.bind(ddp_model)  # also adopts the DDP model's process group when the state has none
    if shared_mask:
        if not state.adams_link.attached:
            state.attach_optimizer(momentum_handover.unwrap(optimizer))
    elif handover is None and optimizer is not None:
        state.check_optimizer(momentum_handover.unwrap(optimizer))
    ddp_model.register_comm_hook(state, topk_hook)
    if built and not shared_mask:
        say_what_changed(OWNER, state, optimizer, state_kwargs, handover)
    return state


def say_what_changed(owner: str, state: TopKState, optimizer, options: dict, handover) -> None:
    """After a hook built from keyword arguments is registered: change the optimizer as
    planned and say so, or warn that without its optimizer (and without ``momentum``) the
    hook runs plain error feedback (rank 0, once)."""
    rank, _ = state.rank_and_world_size()
    if handover is not None:
        momentum_handover.announce(owner, handover.apply(), rank)
    elif momentum_handover.leaves_momentum_uncorrected(optimizer, options):
        momentum_handover.announce(owner, momentum_handover.UNCORRECTED_MOMENTUM, rank, MomentumMismatchWarning)


def check_shared_mask_optimizer(optimizer, options: dict) -> None:
    """``exchange="shared-mask"`` needs the job's AdamS and no momentum of the hook's own."""
    if options.get("momentum", 0) != 0:
        raise ValueError(f"{OWNER}: exchange='shared-mask' synchronises AdamS's own first moment; momentum must be "
                         f"left unset or 0, got momentum={options['momentum']!r}")
    if not isinstance(momentum_handover.unwrap(optimizer), AdamS):
        raise ValueError(f"{OWNER}: exchange='shared-mask' synchronises AdamS's first moment: pass "
                         f"optimizer=sparsecomm.optim.AdamS(...) (the job's optimizer), got "
                         f"{type(optimizer).__name__ if optimizer is not None else None}")
