"""Refuse to sync when the ranks run the averager with different settings.

Ranks that disagree do not fail by themselves: another ``period`` puts their syncs at other
steps (a rank waits in a sync the others have not started, until the collective times out),
another density or model sends payloads of another size (decoded as garbage: a NaN blamed
on a rank, then an abort), another ``outer_lr`` or ``ef_decay`` moves the replicas apart in
silence. Before the first sync's collectives (and the first after a load) every rank's
settings are compared the way the hook compares its own
(:func:`sparsecomm.hooks.state.rank_agreement.disagreements`: one small all-gather), and every
rank raises the same ValueError naming each setting that differs and each rank's value.
"""
import torch

from sparsecomm.hooks.state.settings import TopKConfig
from sparsecomm.hooks.state.rank_agreement import COMPARED_OPTIONS, disagreements, option_fields, shown_config_value

# The averager's own settings, beside its wire's (compared as the hook's options), each shown as its type.
_OWN = {"period": int, "outer_lr": float, "ef_decay": float, "overlap": bool, "model_entries": int, "step": int}


def _shown(name: str, value: float):
    return _OWN[name](value) if name in _OWN else shown_config_value(name, value)


def check_ranks_agree(averager, wire_config: TopKConfig, step: int, device: torch.device) -> None:
    """All-gather every rank's settings over the averager's group at sync ``step`` (the
    optimizer steps counted); ValueError on every rank if any differ. ``model_entries``:
    the entries this rank averages (its model, or its shards of it)."""
    # The wire's options as the hook compares them, but the exchange the averager was given
    # (its wire's is the all-gather for quantized shared-index values) and no density
    # schedule (the averager has none: its wire's is made of the density).
    wire = {name: getattr(wire_config, name) for name in COMPARED_OPTIONS if name != "density_schedule"}
    wire["exchange"] = averager.exchange_setting
    own = {"period": averager.period, "outer_lr": averager.outer_lr, "ef_decay": averager.ef_decay,
           "overlap": averager.overlap, "model_entries": averager.anchor.numel(), "step": step}
    fields = option_fields(wire) + [(name, float(value)) for name, value in own.items()]
    differing = disagreements(fields, _shown, averager.process_group, device)
    if differing:
        raise ValueError(
            "SparseDeltaAverager: the ranks of this process group run the averager with different settings, "
            "whose syncs would not match: " + "; ".join(differing) + ". Build the SparseDeltaAverager with the "
            "same arguments and model on every rank (and restore every rank from the same checkpoint step)"
        )
