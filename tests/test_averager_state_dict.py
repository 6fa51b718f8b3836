"""SparseDeltaAverager.load_state_dict: all or nothing, every key checked before anything is assigned.

Each bad dict (a non-finite buffer, a missing anchor, a negative step, a buffer of another
shape or dtype, an unknown key, another world size, rank or setting, bad counters) must
raise a ValueError naming the key and what is accepted, and leave the averager's state bit
for bit as it was. Oracles: the state captured before each load; the entries' true sizes
(the model's count of parameters that require grad, computed here from the model).
"""
import math

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_models import mlp, rank_data
from rank_processes import run_on_ranks
from sparsecomm import SparseDeltaAverager

pytestmark = pytest.mark.timeout(120)

SETTINGS = {"period": 2, "density": 0.125, "chunk_size": 64}


def _trained(rank, steps):
    model = DDP(mlp(width=16, depth=1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    averager = SparseDeltaAverager(model, **SETTINGS)
    for x in rank_data(rank, steps, (8, 16)):
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
        averager.step()
    return model, averager


def _state(averager) -> tuple:
    return (averager.error.clone().view(torch.int32), averager.anchor.clone().view(torch.int32),
            averager.step_count, dict(averager.counters))


def _unchanged(before, after) -> bool:
    return (torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
            and before[2:] == after[2:])


def _bad_dicts(good: dict, rank: int) -> dict:
    """case -> a state dict that must be refused (each differs from ``good`` in one way)."""
    mine, other = f"rank{rank}.", f"rank{1 - rank}."

    def edited(**changes):
        state = dict(good)
        for key, value in changes.items():
            key = key.replace("MINE_", mine)
            if value is None:
                del state[key]
            else:
                state[key] = value
        return state

    error, anchor = good[mine + "error"], good[mine + "anchor"]
    nan_error, inf_anchor = error.clone(), anchor.clone()
    nan_error[3] = float("nan")
    inf_anchor[7] = -float("inf")
    return {
        "nan error": edited(MINE_error=nan_error),
        "inf anchor": edited(MINE_anchor=inf_anchor),
        "missing anchor": {k: v for k, v in good.items() if k != mine + "anchor"},
        "negative step": edited(step=-1),
        "bool step": edited(step=True),
        "2-D error": edited(MINE_error=error.view(2, -1)),
        "short anchor": edited(MINE_anchor=anchor[:-1]),
        "float64 error": edited(MINE_error=error.double()),
        "list anchor": edited(MINE_anchor=anchor.tolist()),
        "unknown key": {**good, mine + "residual": error.clone()},
        "other rank": {k.replace(mine, other): v for k, v in good.items()},
        "rank beyond world size": {**good, "rank7.error": error.clone()},
        "world size": edited(world_size=3),
        "settings": edited(settings=dict(good["settings"], outer_lr=0.5)),
        "settings not a dict": edited(settings="period=2"),
        "negative counter": edited(counters=dict(good["counters"], syncs=-1)),
        "unknown counter": edited(counters=dict(good["counters"], bytes_lost=3)),
        "nan counter": edited(counters=dict(good["counters"], seconds_encode=math.nan)),
        "missing counters": edited(counters=None),
        "kind": edited(kind="TopKState"),
        "not a dict": [good],
    }


def _refusals(rank, world_size):
    _, saved = _trained(rank, 5)  # past two syncs, mid-period: error and anchor are not zero
    good = saved.state_dict()
    _, target = _trained(rank, 3)  # another state, so a partial load would show
    numel = sum(p.numel() for p in target.module.parameters() if p.requires_grad)
    found = {}
    for case, bad in _bad_dicts(good, rank).items():
        before = _state(target)
        try:
            target.load_state_dict(bad)
            outcome = None
        except Exception as error:  # noqa: BLE001 - the type is what the test checks
            outcome = (type(error).__name__, str(error))
        found[case] = (outcome, _unchanged(before, _state(target)))
    target.load_state_dict(good)  # the good one loads, bit for bit
    loaded = _unchanged(_state(saved), _state(target))
    lenient = SparseDeltaAverager(DDP(mlp(width=16, depth=1)), **dict(SETTINGS, outer_lr=0.5))
    lenient.load_state_dict(good, strict=False)  # other settings: loaded when asked to
    return {"found": found, "loaded": loaded, "lenient": _unchanged(_state(saved), _state(lenient)),
            "numel": numel}


# case -> what the message must name: the key, and the accepted value or range.
EXPECTED = {
    "nan error": ["rank{r}.error", "Inf or NaN"],
    "inf anchor": ["rank{r}.anchor", "Inf or NaN"],
    "missing anchor": ["rank{r}.anchor"],
    "negative step": ["state_dict['step']", ">= 0", "-1"],
    "bool step": ["state_dict['step']", ">= 0"],
    "2-D error": ["rank{r}.error", "1-D", "(2, {numel_half})", "{numel}"],
    "short anchor": ["rank{r}.anchor", "{numel}", "{numel_less}"],
    "float64 error": ["rank{r}.error", "float32", "float64"],
    "list anchor": ["rank{r}.anchor", "float32", "list"],
    "unknown key": ["rank{r}.residual"],
    "other rank": ["rank {r}", "rank{r}.error"],
    "rank beyond world size": ["rank7.error", "world_size"],
    "world size": ["world_size", "3", "2"],
    "settings": ["outer_lr", "0.5", "0.7", "strict=False"],
    "settings not a dict": ["state_dict['settings']", "dict"],
    "negative counter": ["syncs", ">= 0"],
    "unknown counter": ["bytes_lost"],
    "nan counter": ["seconds_encode", "finite"],
    "missing counters": ["counters"],
    "kind": ["state_dict['kind']", "SparseDeltaAverager"],
    "not a dict": ["dict", "list"],
}


def test_a_bad_state_dict_is_refused_by_key_and_nothing_is_assigned():
    for rank, result in enumerate(run_on_ranks(_refusals, world_size=2, timeout=100)):
        numel = result["numel"]
        values = {"r": rank, "numel": numel, "numel_less": numel - 1, "numel_half": numel // 2}
        assert set(result["found"]) == set(EXPECTED)
        for case, (outcome, unchanged) in result["found"].items():
            assert outcome is not None, f"{case}: loaded on rank {rank}"
            kind, message = outcome
            assert kind == "ValueError", (case, kind, message)
            for needed in EXPECTED[case]:
                assert needed.format(**values) in message, (case, needed.format(**values), message)
            assert unchanged, f"{case}: rank {rank}'s state changed although the load was refused"
        assert result["loaded"] and result["lenient"]
