"""Reading a TopKState state dict: every key and value checked before anything is restored.

A state dict comes from a file, possibly edited, truncated or written by another version,
so nothing in it is trusted. Problems fall in two kinds:

* malformed (not what :meth:`TopKState.state_dict` writes: a missing or mistyped field,
  a key that is not ``rank{r}.<kind>.<name>``, a residual that is not a flat floating
  tensor): always refused, strict or not, because no reading of it is safe;
* mismatched (a well-formed dict that does not belong here: another rank, world size,
  configuration, model, or memories that are not finite): refused in strict mode; a lenient
  load resets the memories instead (see :meth:`TopKState.load_state_dict`).
"""
import re

import torch

_RANK_KEY = re.compile(r"^rank(\d+)\.(.+)$")
_PER_RANK_FIELDS = {"stats", "sample_generator", "sample_generator_device"}
MEMORY_KINDS = ("residual", "velocity", "owner_residual", "mask")
MAX_SHARE = 2 ** 53
"""Bound of a share of the model's k (budget_shares): a share is at most its parameter's
element count, which no tensor takes past 2**53, the last count float64 holds exactly;
without a bound a few huge finite shares overflow their bucket's sum at the next step."""


class ParsedStateDict:
    """The parts of a checked state dict that this rank restores."""

    def __init__(self, step, saved_world_size, config, memory_scale, ranks, memories, per_rank, budget_shares):
        self.step, self.saved_world_size, self.config, self.memory_scale = step, saved_world_size, config, memory_scale
        self.budget_shares = budget_shares  # budget="model": the shares of the model's k (the same on every rank)
        self.ranks = ranks  # every rank the dict holds state of
        self.memories = memories  # kind -> name -> tensor, for this rank
        self.per_rank = per_rank  # stats / sample_generator / sample_generator_device, for this rank


def parse(state_dict, rank: int, expected_format: int) -> ParsedStateDict:
    """Check the structure of ``state_dict`` and pick this rank's entries; ValueError if malformed."""
    if not isinstance(state_dict, dict):
        raise ValueError(f"state_dict must be a dict made by TopKState.state_dict(), got {type(state_dict).__name__}")
    if state_dict.get("format") != expected_format:
        raise ValueError(f"state_dict is not a TopKState state dict of format {expected_format} "
                         f"(got format {state_dict.get('format')!r})")
    missing = [key for key in ("world_size", "step", "config") if key not in state_dict]
    if missing:
        raise ValueError(f"state_dict lacks {missing}: it is not a complete TopKState state dict")
    step, world_size, config = state_dict["step"], state_dict["world_size"], state_dict["config"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"state_dict['step'] must be an integer >= 0, got {step!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"state_dict['world_size'] must be an integer >= 1, got {world_size!r}")
    if not isinstance(config, dict):
        raise ValueError(f"state_dict['config'] must be a dict, got {type(config).__name__}")
    memory_scale = state_dict.get("memory_scale")
    if memory_scale is not None and (isinstance(memory_scale, bool) or not isinstance(memory_scale, (int, float))
                                     or not memory_scale > 0 or memory_scale == float("inf")):
        raise ValueError(f"state_dict['memory_scale'] must be None or a positive finite number, got {memory_scale!r}")
    budget_shares = state_dict.get("budget_shares")
    if budget_shares is not None and not (isinstance(budget_shares, dict) and all(
            isinstance(name, str) and not isinstance(share, bool) and isinstance(share, (int, float))
            and 0 <= share <= MAX_SHARE for name, share in budget_shares.items())):
        raise ValueError("state_dict['budget_shares'] must be None or a dict of parameter name -> number in "
                         f"[0, 2**53] (entries of the model's k), got {budget_shares!r}"[:300])
    ranks, memories, per_rank, odd = set(), {kind: {} for kind in MEMORY_KINDS}, {}, []
    for key, value in state_dict.items():
        if key in ("format", "world_size", "step", "config", "memory_scale", "budget_shares"):
            continue
        match = _RANK_KEY.match(key) if isinstance(key, str) else None
        if match is None:
            odd.append(key)
            continue
        key_rank, rest = int(match.group(1)), match.group(2)
        kind, _, name = rest.partition(".")
        if rest in _PER_RANK_FIELDS:
            pass
        elif kind in MEMORY_KINDS and name:
            _check_memory(key, value)
        else:
            odd.append(key)
            continue
        ranks.add(key_rank)
        if key_rank == rank:
            if kind in MEMORY_KINDS and name:
                memories[kind][name] = value
            else:
                per_rank[rest] = value
    if odd:
        raise ValueError(f"state_dict has {len(odd)} key(s) that TopKState.state_dict() never writes "
                         f"(first: {odd[:3]!r}); expected 'rank<r>.residual.<name>', 'rank<r>.velocity.<name>', "
                         f"'rank<r>.owner_residual.<name>', 'rank<r>.mask.<name>', "
                         f"'rank<r>.stats', 'rank<r>.sample_generator' and the top-level format, world_size, step, "
                         "config, memory_scale")
    bad_ranks = sorted(r for r in ranks if r >= world_size)
    if bad_ranks:
        raise ValueError(f"state_dict holds rank(s) {bad_ranks} but says world_size={world_size}")
    generator = per_rank.get("sample_generator")
    if generator is not None and not (isinstance(generator, torch.Tensor) and generator.dtype == torch.uint8):
        raise ValueError(f"rank{rank}.sample_generator must be a generator state (uint8 tensor), got "
                         f"{type(generator).__name__}")
    stats = per_rank.get("stats", {})
    if not isinstance(stats, dict):
        raise ValueError(f"rank{rank}.stats must be a dict, got {type(stats).__name__}")
    return ParsedStateDict(step, world_size, config, memory_scale, sorted(ranks), memories, per_rank, budget_shares)


def _check_memory(key: str, value) -> None:
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise ValueError(f"{key} must be a floating-point tensor, got "
                         f"{value.dtype if isinstance(value, torch.Tensor) else type(value).__name__}")
    if value.dim() != 1:
        # state_dict() writes flat entries; a 2-D one (e.g. a transposed weight's) would be
        # flattened in another order and misapplied silently.
        raise ValueError(f"{key} must be flat (1-D, as TopKState.state_dict() writes it), got shape "
                         f"{tuple(value.shape)}")


def mismatches(parsed: ParsedStateDict, param_shapes: dict, error_feedback: bool, momentum: bool,
               rank: int, owner: bool = False, shared_mask: bool = False) -> list[str]:
    """Problems of a well-formed state dict against the bound model (empty if it fits).
    ``owner``: the state keeps owner residuals (exchange="owner" with error feedback);
    ``shared_mask``: it keeps the next step's mask (exchange="shared-mask")."""
    problems = []
    residuals, velocities = parsed.memories["residual"], parsed.memories["velocity"]
    owner_residuals = parsed.memories["owner_residual"]
    mask = {"mask": parsed.memories["mask"]}
    for kind, entries in (("residual", residuals), ("velocity", velocities), ("owner residual", owner_residuals),
                          *mask.items()):
        if param_shapes:
            foreign = sorted(set(entries) - set(param_shapes))
            if foreign:
                problems.append(f"rank {rank}'s {kind}s name {len(foreign)} parameter(s) the model does not have "
                                f"(first: {foreign[:3]})")
            wrong = [f"{name} ({entries[name].numel()} != {param_shapes[name][0]})"
                     for name in sorted(set(entries) & set(param_shapes))
                     if entries[name].numel() != param_shapes[name][0]]
            if wrong:
                problems.append(f"rank {rank}'s {kind}s have the wrong number of elements for {len(wrong)} "
                                f"parameter(s): {wrong[:3]}")
        nonfinite = sorted(name for name, tensor in entries.items() if not bool(torch.isfinite(tensor).all()))
        if nonfinite:
            problems.append(f"rank {rank}'s {kind}s hold Inf or NaN for {len(nonfinite)} parameter(s) "
                            f"(first: {nonfinite[:3]}): they would reach every replica at the next step")
    if error_feedback and param_shapes and not problems:
        missing = sorted(set(param_shapes) - set(residuals))
        if missing:
            problems.append(f"rank {rank}'s residuals are missing for {len(missing)} parameter(s): {missing[:5]}")
    if owner and param_shapes and not problems:
        missing = sorted(set(param_shapes) - set(owner_residuals))
        if missing:
            problems.append(f"rank {rank}'s owner residuals are missing for {len(missing)} parameter(s): {missing[:5]}")
    for kind, entries in mask.items():
        if shared_mask and param_shapes and not problems:
            missing = sorted(set(param_shapes) - set(entries))
            if missing:
                problems.append(f"rank {rank}'s {kind}s are missing for {len(missing)} parameter(s): {missing[:5]}")
        if entries and not shared_mask:
            problems.append(f"rank {rank}'s state has {kind}s but this TopKState does not use exchange='shared-mask'")
    if owner_residuals and not owner:
        problems.append(f"rank {rank}'s state has owner residuals but this TopKState does not use exchange='owner' (or 'auto' with selector='chunk')")
    if velocities and not momentum:
        problems.append(f"rank {rank}'s state has velocities but this TopKState has no momentum correction")
    foreign = sorted(set(parsed.budget_shares or {}) - set(param_shapes)) if param_shapes else []
    if foreign:
        problems.append(f"state_dict['budget_shares'] name {len(foreign)} parameter(s) the model does not have "
                        f"(first: {foreign[:3]})")
    return problems


def config_differences(saved: dict, current: dict, defaults: dict) -> dict:
    """setting -> (saved, current) wherever a saved config differs from this state's (both as
    ``TopKConfig.checkpoint_dict`` writes them). A setting one side leaves out is at its
    default there: a checkpoint holds an "if-set" option only when it is not the default."""
    def value(config: dict, name: str):
        return config.get(name, defaults.get(name))

    return {name: (value(saved, name), value(current, name)) for name in sorted(set(saved) | set(current))
            if value(saved, name) != value(current, name)}
