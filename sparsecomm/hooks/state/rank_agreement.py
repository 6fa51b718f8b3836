"""Refuse to train when ranks run the hook (or the averager) with different settings.

Ranks that disagree on the density, the selector, the seed or the scope do not fail by
themselves: they all-gather payloads of different sizes (gloo raises, or hangs), or worse,
of the same size with different meanings (random-k draws other indices per seed, so the
values are summed at the wrong places and the sums are silently wrong). Ranks that resumed
from different steps disagree on the warm-up and the density schedule the same way. One
small all-gather at the first hook call compares the settings of every rank and raises
the same error on all of them, naming each setting that differs and each rank's value.
:mod:`sparsecomm.averaging.rank_agreement` compares the averager's settings the same way.
"""
import torch
import torch.distributed as dist

from sparsecomm.hooks.state.settings import TopKConfig
from sparsecomm.hooks.state.settings import agreement_value, fingerprint, options, shown_value

# The settings compared: every option whose table entry says the ranks must agree on it.
_COMPARED = {name: spec for name, spec in options(TopKConfig).items() if spec.agree}
COMPARED_OPTIONS = tuple(_COMPARED)


def option_fields(values: dict) -> list[tuple[str, float]]:
    """(name, value as float64) of each compared option in ``values`` (name -> value)."""
    return [(name, agreement_value(name, _COMPARED[name], value)) for name, value in values.items()]


def config_fields(config: TopKConfig) -> list[tuple[str, float]]:
    """(name, value as float64) of every setting of ``config`` that must be equal on all ranks."""
    return option_fields({name: getattr(config, name) for name in COMPARED_OPTIONS})


def shown_config_value(name: str, value: float):
    """A setting of :func:`option_fields` as the error shows it."""
    return shown_value(name, _COMPARED[name], value)


def _fields(state) -> list[tuple[str, float]]:
    """The hook's: its config, its step and, with ``budget="model"``, the shares of the model's
    k (agreed by an all-reduce at every step, so different only when a rank loaded other ones:
    its buckets would then send payloads of another size)."""
    shares = None if state.model_budget is None else sorted(state.model_budget.state_dict().items())
    return [*config_fields(state.config), ("step", float(state.step)), ("budget_shares", fingerprint(shares))]


def _shown(name: str, value: float):
    if name == "step":
        return int(value)
    if name == "budget_shares":
        return f"budget shares #{int(value):08x}"
    return shown_config_value(name, value)


def disagreements(fields: list[tuple[str, float]], shown, group: dist.ProcessGroup,
                  device: torch.device) -> list[str]:
    """All-gather every rank's ``fields`` (the same names in the same order on every rank) over
    ``group``: one "name (rank 0: value, rank 1: value, ...)" for each that differs, with
    ``shown(name, value)``; the same list on every rank."""
    local = torch.tensor([value for _, value in fields], dtype=torch.float64, device=device)
    everyone = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, local, group=group)
    table = torch.stack(everyone).cpu()
    differing = []
    for column, (name, _) in enumerate(fields):
        values = table[:, column].tolist()
        if any(value != values[0] for value in values):
            each = ", ".join(f"rank {rank}: {shown(name, value)!r}" for rank, value in enumerate(values))
            differing.append(f"{name} ({each})")
    return differing


def check_ranks_agree(state, group: dist.ProcessGroup, device: torch.device) -> None:
    """All-gather every rank's settings over ``group``; raise ValueError on all ranks if any differ."""
    differing = disagreements(_fields(state), _shown, group, device)
    if differing:
        raise ValueError(
            "topk_hook: the ranks of this process group run the hook with different settings, which would "
            "exchange payloads that do not match: " + "; ".join(differing) +
            ". Build the TopKState with the same arguments on every rank (and restore every rank from "
            "the same checkpoint step)"
        )
