"""The averager's non-finite guard: a sync that would carry an Inf or NaN is refused on every rank.

A rank whose weights went non-finite between syncs (a step its loop did not skip), or
deltas whose mean or outer step overflows float32, must not reach the anchor, the error
buffer or another replica. Every rank raises the same error, naming the rank(s) and the
step, and nothing changed: weights, anchor, error buffer and step count are bit for bit
what they were before that ``step()`` call.

Oracles: the state captured right before the refused ``step()`` call, and the same run
without the fault (after the fault is undone, the retried sync must give its bits).
"""
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_models import mlp, rank_data
from rank_processes import run_on_ranks
from sparsecomm import SparseDeltaAverager
from sparsecomm.averaging.sync_guard import all_finite

pytestmark = pytest.mark.timeout(180)

PERIOD = 3
WIRES = {
    "default": {"chunk_size": 64},  # chunked top-k, Rice indices, 2-bit values with a bf16 scale
    "exact-fp32": {"selector": "exact", "index_codec": "int32", "value_codec": "fp32"},
    "owner": {"chunk_size": 64, "exchange": "owner"},  # the owners sum the values: they see the Inf first
    "owner-fp32": {"selector": "exact", "index_codec": "int32", "value_codec": "fp32", "exchange": "owner"},
    "shared-fp32": {"chunk_size": 64, "value_codec": "fp32", "exchange": "shared-index"},
    "shared-int8": {"chunk_size": 64, "value_codec": "int8", "exchange": "shared-index"},  # through the owners
}
HUGE = 3e38  # float32's largest finite value is 3.4028e38: two of these overflow


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The bit patterns (torch.equal says NaN != NaN; a NaN kept in place must compare equal)."""
    return tensor.detach().clone().contiguous().view(torch.int32)


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _snapshot(model, averager) -> dict:
    owned = averager.owner_residual
    return {"weights": _bits(_flat(model)), "anchor": _bits(averager.anchor), "error": _bits(averager.error),
            "owned": _bits(owned if owned is not None else torch.zeros(0)), "step": averager.optimizer_steps,
            "counters": {k: v for k, v in averager.counters.items() if not k.startswith("seconds_")}}  # times vary


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def _poison(fault: str, rank: int, model, averager) -> None:
    """Make this rank's weights what ``fault`` (before any "/wire") describes, right before the sync."""
    fault = fault.split("/")[0]
    first = next(model.parameters())
    with torch.no_grad():
        if fault == "nan-on-rank-1" and rank == 1:
            first.view(-1)[5] = float("nan")
        elif fault == "inf-on-ranks-0-and-2" and rank in (0, 2):
            first.view(-1)[rank] = float("inf") if rank == 0 else -float("inf")
        elif fault == "sum-overflows":  # every delta finite (3e38), their sum is not
            first.view(-1)[0] = float(averager.anchor[0]) - HUGE
        elif fault == "outer-step-overflows":  # the mean is finite (1e38), anchor - 4 * mean is not
            first.view(-1)[0] = float(averager.anchor[0]) - 1e38


def _run(rank, world_size, wire, fault, outer_lr):
    """Two periods of AdamW; the fault strikes after the last optimizer step of the second.
    Returns the outcome of that step() call, the state around it, and the state after the
    fault is undone and step() is called again."""
    model = DDP(mlp(width=16, depth=1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    averager = SparseDeltaAverager(model, period=PERIOD, density=0.125, outer_lr=outer_lr, **wire)
    batches = rank_data(rank, 2 * PERIOD, (8, 16))  # different data on every rank
    outcome = None
    for index, x in enumerate(batches, start=1):
        optimizer.zero_grad()
        (model(x) - x[:, :4].sin()).square().mean().backward()
        optimizer.step()
        if index < 2 * PERIOD or fault is None:
            averager.step()
            continue
        healthy = _flat(model).clone()
        _poison(fault, rank, model, averager)
        before = _snapshot(model, averager)
        try:
            averager.step()
        except Exception as error:  # noqa: BLE001 - the type is what the test checks
            outcome = (type(error).__name__, str(error))
        after = _snapshot(model, averager)
        with torch.no_grad():  # undo the fault (as a restore would) and try the sync again
            offset = 0
            for p in model.parameters():
                p.copy_(healthy[offset: offset + p.numel()].view_as(p))
                offset += p.numel()
        retried = averager.step()
        return {"outcome": outcome, "unchanged": _same(before, after), "retried": retried,
                "final": _snapshot(model, averager)}
    return {"final": _snapshot(model, averager)}


FAULTS = {  # fault -> (wire, outer_lr, ranks the error names)
    "nan-on-rank-1": ("default", 0.7, [1]),
    "inf-on-ranks-0-and-2": ("exact-fp32", 0.7, [0, 2]),
    "sum-overflows": ("exact-fp32", 0.7, []),
    "outer-step-overflows": ("exact-fp32", 4.0, []),
    "nan-on-rank-1/owner": ("owner", 0.7, [1]),
    "inf-on-ranks-0-and-2/owner": ("owner-fp32", 0.7, [0, 2]),
    "sum-overflows/owner": ("owner-fp32", 0.7, []),
    "inf-on-ranks-0-and-2/shared": ("shared-fp32", 0.7, [0, 2]),
    "nan-on-rank-1/shared-int8": ("shared-int8", 0.7, [1]),
}


def _faults_and_clean_runs(rank, world_size, faults):
    results = {}
    for fault in faults:
        wire, outer_lr, _ = FAULTS[fault]
        results[fault] = (_run(rank, world_size, WIRES[wire], fault, outer_lr),
                          _run(rank, world_size, WIRES[wire], None, outer_lr))
    return results


def test_a_non_finite_sync_is_refused_alike_on_every_rank_and_leaves_no_trace():
    faults = list(FAULTS)  # in one process group: a spawn costs more than a run
    per_rank = run_on_ranks(_faults_and_clean_runs, faults, world_size=3, timeout=170)
    for fault in faults:
        named = FAULTS[fault][2]
        messages = set()
        for rank, results in enumerate(per_rank):
            faulty, clean = results[fault]
            assert faulty["outcome"] is not None, f"{fault}: rank {rank} synced a non-finite step silently"
            kind, message = faulty["outcome"]
            assert kind == "NonFiniteSyncError", (fault, kind, message)
            messages.add(message)
            # Nothing changed: weights (NaN bits included), anchor, error buffer, step count.
            assert faulty["unchanged"], fault
            # The refused step was not counted: undone, the same call syncs, and the run is
            # then the run that never saw the fault, bit for bit.
            assert faulty["retried"] is True, fault
            assert _same(faulty["final"], clean["final"]), fault
        assert len(messages) == 1, f"{fault}: ranks raised different errors: {messages}"
        message = messages.pop()
        assert f"optimizer step {2 * PERIOD}" in message, message
        if named:
            assert f"rank(s) {named}" in message, message
        else:
            assert "every rank's payload is finite" in message and "overflowed" in message, message
    for results in per_rank:  # the clean runs end on a sync: one model on every rank
        assert torch.equal(results[faults[0]][1]["final"]["weights"], per_rank[0][faults[0]][1]["final"]["weights"])


@pytest.mark.parametrize("values, finite", [([1.0, -2.0], True), ([HUGE, HUGE, -1.0], True),  # the sum overflows
                                            ([1.0, float("inf")], False), ([float("nan"), 0.0], False),
                                            ([HUGE, -float("inf")], False)])
def test_the_guard_check_is_exact_when_the_sum_overflows(values, finite):
    assert all_finite(torch.tensor(values, dtype=torch.float32)) is finite
