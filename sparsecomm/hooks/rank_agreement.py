"""Refuse to train when ranks run the hook with different settings.

Ranks that disagree on the density, the selector, the seed or the scope do not fail by
themselves: they all-gather payloads of different sizes (gloo raises, or hangs), or worse,
of the same size with different meanings (random-k draws other indices per seed, so the
values are summed at the wrong places and the sums are silently wrong). Ranks that resumed
from different steps disagree on the warm-up and the density schedule the same way. One
small all-gather at the first hook call compares the settings of every rank and raises
the same error on all of them, naming each setting that differs and each rank's value.
"""
import torch
import torch.distributed as dist

from sparsecomm.hooks.config import TopKConfig
from sparsecomm.hooks.options import agreement_value, options, shown_value

# The settings compared: every option whose table entry says the ranks must agree on it.
_COMPARED = {name: spec for name, spec in options(TopKConfig).items() if spec.agree}


def _fields(state) -> list[tuple[str, float]]:
    """(name, value as float64) of every setting that must be equal on all ranks (the
    state's config and its step)."""
    return [*((name, agreement_value(name, spec, getattr(state.config, name))) for name, spec in _COMPARED.items()),
            ("step", float(state.step))]


def _shown(name: str, value: float):
    return int(value) if name == "step" else shown_value(name, _COMPARED[name], value)


def check_ranks_agree(state, group: dist.ProcessGroup, device: torch.device) -> None:
    """All-gather every rank's settings over ``group``; raise ValueError on all ranks if any differ."""
    fields = _fields(state)
    local = torch.tensor([value for _, value in fields], dtype=torch.float64, device=device)
    everyone = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, local, group=group)
    table = torch.stack(everyone).cpu()
    differing = []
    for column, (name, _) in enumerate(fields):
        values = table[:, column].tolist()
        if any(value != values[0] for value in values):
            shown = ", ".join(f"rank {rank}: {_shown(name, value)!r}" for rank, value in enumerate(values))
            differing.append(f"{name} ({shown})")
    if differing:
        raise ValueError(
            "topk_hook: the ranks of this process group run the hook with different settings, which would "
            "exchange payloads that do not match: " + "; ".join(differing) +
            ". Build the TopKState with the same arguments on every rank (and restore every rank from "
            "the same checkpoint step)"
        )
