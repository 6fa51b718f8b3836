"""Refuse to train when ranks run the hook with different settings.

Ranks that disagree on the density, the selector, the seed or the scope do not fail by
themselves: they all-gather payloads of different sizes (gloo raises, or hangs), or worse,
of the same size with different meanings (random-k draws other indices per seed, so the
values are summed at the wrong places and the sums are silently wrong). Ranks that resumed
from different steps disagree on the warm-up and the density schedule the same way. One
small all-gather at the first hook call compares the settings of every rank and raises
the same error on all of them, naming each setting that differs and each rank's value.
"""
import zlib

import torch
import torch.distributed as dist

from sparsecomm.compress.index_codecs import INDEX_CODECS
from sparsecomm.compress.value_codecs import VALUE_CODECS
from sparsecomm.hooks.config import EXCHANGE_CHOICES, K_SCOPES, OVERFLOW_CHOICES, SELECTOR_CHOICES

# Settings compared, and how to show a value (None: the number itself).
_CHOICES = {
    "selector": SELECTOR_CHOICES,
    "k_scope": K_SCOPES,
    "transport": ("c10d", "mpi"),
    "on_overflow": OVERFLOW_CHOICES,
    "index_codec": INDEX_CODECS,
    "exchange": EXCHANGE_CHOICES,
    "value_codec": (None, *VALUE_CODECS),
    "value_dtype": (None, "torch.float32", "torch.bfloat16", "torch.float16"),
    "residual_dtype": (None, "torch.float32", "torch.bfloat16", "torch.float16"),
}


def _fields(state) -> list[tuple[str, float]]:
    """(name, value as float64) of every setting that must be equal on all ranks (the
    state's config and its step)."""
    config = state.config

    def choice(name, value):
        return float(_CHOICES[name].index(None if value is None else str(value) if "dtype" in name else value))

    schedule = zlib.crc32(repr(config.density_schedule.to_list()).encode())
    return [
        ("density", config.density),
        ("density_schedule", float(schedule)),
        ("selector", choice("selector", config.selector)),
        ("k_scope", choice("k_scope", config.k_scope)),
        ("seed", float(config.seed)),
        ("error_feedback", float(config.error_feedback)),
        ("momentum", config.momentum),
        ("nesterov", float(config.nesterov)),
        ("local_clip_norm", -1.0 if config.local_clip_norm is None else config.local_clip_norm),
        ("warmup_steps", float(config.warmup_steps)),
        ("value_dtype", choice("value_dtype", config.value_dtype)),
        ("residual_dtype", choice("residual_dtype", config.residual_dtype)),
        ("transport", choice("transport", config.transport)),
        ("allow_dense_fallback", float(config.allow_dense_fallback)),
        ("on_overflow", choice("on_overflow", config.on_overflow)),
        ("chunk_size", float(config.chunk_size)),
        ("index_codec", choice("index_codec", config.index_codec)),
        ("value_codec", choice("value_codec", config.value_codec)),
        ("exchange", choice("exchange", config.exchange)),
        ("link", float(zlib.crc32(repr(config.link).encode()))),
        ("wire_checksum", float(config.wire_checksum)),
        ("wire_agreement", float(config.wire_agreement)),
        ("step", float(state.step)),
    ]


def _shown(name: str, value: float):
    if name in _CHOICES:
        return _CHOICES[name][int(value)]
    if name in ("density_schedule", "link"):
        return f"{name.replace('_', ' ')} #{int(value):08x}"
    if name == "local_clip_norm" and value == -1.0:
        return None
    return int(value) if value.is_integer() and name not in ("density", "momentum") else value


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
