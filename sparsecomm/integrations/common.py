"""Pieces the framework integrations share: optional imports and per-rank hook state."""
import importlib

import torch
import torch.distributed as dist

from sparsecomm.hooks.topk import TopKState
from sparsecomm.hooks.momentum_handover import AUTO, check_momentum_option

# Keys of TopKState.state_dict() that every rank holds with the same value; all other
# keys are rank-qualified ("rank{r}.residual.<param>", ...).
_SHARED_KEYS = ("format", "world_size", "step", "config")


def import_framework(module: str, package: str, extra: str):
    """``importlib.import_module(module)``, or an ImportError naming the pip extra."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"sparsecomm.integrations.{extra} needs the {package!r} package ({module} could not be "
            f"imported: {error}); install it with: pip install 'sparsecomm[{extra}]'"
        ) from error


def check_state_options(owner: str, options: dict) -> dict:
    """Validate TopKState keyword arguments now, before any process group exists.

    ``module`` and ``process_group`` are refused: the integration takes both from the
    DDP model the framework builds. ``momentum`` may also be "auto" (the default: the
    optimizer's own, see :mod:`sparsecomm.hooks.momentum_handover`).
    """
    taken = sorted({"module", "process_group"} & set(options))
    if taken:
        raise TypeError(
            f"{owner}: {', '.join(taken)} cannot be given; they come from the DDP model the framework builds"
        )
    options = {"momentum": AUTO, **options}
    check_momentum_option(owner, options["momentum"])
    if options["momentum"] == AUTO:
        # "auto" resolves to 0 or to a momentum in (0, 1) once the optimizer is known: check the
        # other options against the strictest of those (momentum correction needs error feedback).
        probe = {**options, "momentum": 0.5 if options.get("error_feedback", True) else 0.0}
    else:
        probe = options
    TopKState(**probe)  # raises ValueError/TypeError naming the bad argument
    return options


def to_cpu(state_dict: dict) -> dict:
    # Pickled CUDA tensors would be unpickled on the sender's device index on rank 0.
    return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in state_dict.items()}


def merge_rank_state_dicts(state_dicts: list[dict]) -> dict:
    """One TopKState state dict holding every rank's entries.

    Rank-qualified keys never collide, so the union is itself a valid state dict:
    ``TopKState.load_state_dict`` on rank r picks the ``rank{r}.`` entries. The shared
    keys must agree across ranks (they do unless the ranks diverged).
    """
    merged = {}
    for rank, sd in enumerate(state_dicts):
        for key in _SHARED_KEYS:
            if key in merged and merged[key] != sd[key]:
                raise RuntimeError(
                    f"hook state {key!r} differs between ranks: rank 0 has {merged[key]!r}, "
                    f"rank {rank} has {sd[key]!r}; the ranks are not at the same step"
                )
        merged.update(sd)
    return merged


def gather_state_dicts(state: TopKState) -> dict:
    """Every rank's ``state.state_dict()``, merged, on the group's rank 0 (collective).

    Other ranks get their own state dict back. Every rank of the hook's process group
    must call this at the same point, between steps.
    """
    group = state.process_group or dist.group.WORLD
    own = to_cpu(state.state_dict())
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    gathered = [None] * world_size if rank == 0 else None
    dist.gather_object(own, gathered, dst=dist.get_global_rank(group, 0), group=group)
    return merge_rank_state_dicts(gathered) if rank == 0 else own


AUTO_LOG = "auto"


def check_log_every(owner: str, log_every, allow_auto: bool):
    """``log_every``: None (no figures logged), an integer >= 1 (every that many optimizer
    steps) or, where the framework has a logging cadence of its own, "auto" (follow it)."""
    if log_every is None or (allow_auto and log_every == AUTO_LOG):
        return log_every
    accepted = "None, 'auto' or an integer >= 1" if allow_auto else "None or an integer >= 1"
    message = f"{owner}: log_every must be {accepted} (optimizer steps between logged figures), got {log_every!r}"
    if isinstance(log_every, bool) or not isinstance(log_every, (int, str)):
        raise TypeError(message)
    if isinstance(log_every, str) or log_every < 1:
        raise ValueError(message)
    return log_every
