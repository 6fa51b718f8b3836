"""Reading a SparseDeltaAverager state dict: every key and value checked before anything is assigned.

A state dict comes from a file, possibly edited, truncated or written for another job, so
nothing in it is trusted. :func:`check` raises a ValueError naming the key and what is
accepted at the first problem, and returns what this rank restores only when the whole
dict passed, so :meth:`SparseDeltaAverager.load_state_dict` assigns all of it or nothing.

Always refused: not the averager's format (``kind``), a missing or unknown key, a step that
is not an integer >= 0, another world size, entries of a rank the world does not have,
this rank's error buffer or anchor (and, for the owner exchange, its owner residual)
missing, not a flat float32 tensor of the model's size, or holding Inf or NaN (an anchor is
the next sync's starting weights and an error buffer is sent: either would reach every
replica), counters that are not the averager's or not
finite numbers >= 0. Other settings are refused unless ``strict=False``.
"""
import math
import re

import torch

KIND = "SparseDeltaAverager"
TOP_LEVEL_KEYS = ("kind", "settings", "step", "world_size", "counters")
BUFFERS = ("error", "anchor")
"""Every averager's per-rank buffers; the owner exchange adds ``owner_residual``."""


class CheckedState:
    """What this rank restores from a state dict that passed every check."""

    def __init__(self, step: int, buffers: dict, counters: dict):
        self.step, self.buffers, self.counters = step, buffers, counters
        self.error, self.anchor = buffers["error"], buffers["anchor"]


def check(state, *, rank: int, world_size: int, numel: int, settings: dict, counter_names, strict: bool,
          buffers: tuple[str, ...] = BUFFERS) -> CheckedState:
    """Check ``state`` against this averager (its rank, world size, model size ``numel``,
    ``settings``, ``counter_names``, the per-rank ``buffers`` it keeps); the parts to restore,
    or ValueError naming the key."""
    rank_key = re.compile(r"^rank(\d+)\.(" + "|".join(buffers) + r")$")
    if not isinstance(state, dict):
        raise ValueError(f"state_dict must be a dict made by SparseDeltaAverager.state_dict(), got {type(state).__name__}")
    if state.get("kind") != KIND:
        raise ValueError(f"state_dict['kind'] must be {KIND!r} (a dict made by SparseDeltaAverager.state_dict()), "
                         f"got {state.get('kind')!r}")
    missing = [key for key in TOP_LEVEL_KEYS if key not in state]
    unknown = [key for key in state if key not in TOP_LEVEL_KEYS and not (isinstance(key, str) and rank_key.match(key))]
    if missing or unknown:
        raise ValueError(f"state_dict lacks {missing} and has {len(unknown)} unknown key(s) (first: {unknown[:3]!r}); "
                         f"SparseDeltaAverager.state_dict() writes {list(TOP_LEVEL_KEYS)} and "
                         f"{', '.join(repr(f'rank<r>.{name}') for name in buffers)}")
    step = state["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"state_dict['step'] must be an integer >= 0, got {step!r}")
    saved_world_size = state["world_size"]
    if isinstance(saved_world_size, bool) or not isinstance(saved_world_size, int) or saved_world_size != world_size:
        raise ValueError(f"state_dict['world_size'] is {saved_world_size!r}: it was saved by a job of that many ranks, "
                         f"this job has world_size={world_size}")
    ranks = sorted({int(rank_key.match(key).group(1)) for key in state if key not in TOP_LEVEL_KEYS})
    beyond = [f"rank{r}.{name}" for r in ranks if r >= world_size for name in buffers if f"rank{r}.{name}" in state]
    if beyond:
        raise ValueError(f"state_dict holds {beyond[:3]} but a world of world_size={world_size} has ranks "
                         f"0..{world_size - 1}")
    _check_settings(state["settings"], settings, strict)
    counters = _checked_counters(state["counters"], counter_names)
    checked = {}
    for name in buffers:
        key = f"rank{rank}.{name}"
        if key not in state:
            raise ValueError(f"state_dict has no {key}: it holds the state of rank(s) {ranks}, this is rank {rank} "
                             f"(every rank's error buffer differs: save and load each rank's own state dict)")
        checked[name] = _checked_buffer(key, state[key], numel)
    return CheckedState(step, checked, counters)


def _check_settings(saved, current: dict, strict: bool) -> None:
    if not isinstance(saved, dict):
        raise ValueError(f"state_dict['settings'] must be a dict of the averager's settings, got {type(saved).__name__}")
    if strict and saved != current:
        differ = {key: (saved.get(key, "<missing>"), value) for key, value in current.items() if saved.get(key) != value}
        differ |= {key: (value, "<none>") for key, value in saved.items() if key not in current}
        raise ValueError(f"state_dict['settings'] differ from this averager's (key: (saved, current)): {differ} "
                         "(strict=False loads the buffers anyway)")


def _checked_counters(counters, names) -> dict:
    if not isinstance(counters, dict):
        raise ValueError(f"state_dict['counters'] must be a dict of the averager's counters, got {type(counters).__name__}")
    for key, value in counters.items():
        if key not in names:
            raise ValueError(f"state_dict['counters'] has {key!r}, not a counter of the averager (they are {list(names)})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"state_dict['counters'][{key!r}] must be a finite number >= 0, got {value!r}")
    return dict(counters)


def _checked_buffer(key: str, value, numel: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
        got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{key} must be a float32 tensor (the averager keeps its buffers in float32), got {got}")
    if value.dim() != 1 or value.numel() != numel:
        raise ValueError(f"{key} must be a flat (1-D) tensor of {numel} entries, one per entry of the model's "
                         f"parameters that require grad; got shape {tuple(value.shape)}")
    if not bool(torch.isfinite(value).all()):
        raise ValueError(f"{key} holds Inf or NaN: restored, it would reach every replica at the next sync; "
                         "load a checkpoint saved before the values went non-finite")
    return value
