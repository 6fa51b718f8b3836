"""The overflow loop with local steps: a too-large loss scale, skipped, leaves no trace in the averager.

The loop: AdamW, the averager stepped after every optimizer step that happened, and one
step whose loss is scaled by 3e38 (what a too-large loss scale gives: a mix of Inf and huge
finite gradient entries), which the loop skips because its gradients are not all finite.
- Scaled on every rank: every rank skips it, as many steps as plain DDP skips in the same
  loop (1), and the run is, bit for bit (weights, error buffer, anchor, step count), the
  run whose ranks never saw that batch.
- Scaled on one rank only (gradients are local between syncs, so only that rank skips):
  the syncs still pair up (every rank's k-th sync is the same collective; that rank's fall
  one batch later), nothing hangs, and the run is the run where only that rank never saw
  the batch, bit for bit, on every rank. The loop ends on ``optimizer_steps``, the same
  count on every rank (docs/local_steps.md: the rule).
A loop that does not skip it gets the averager's non-finite guard: the next sync is refused
on every rank alike (tests/test_averager_nonfinite.py).
Oracles: plain DDP's skip count in the same loop; the runs without that batch.
"""
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_models import all_finite, mlp, rank_data
from rank_processes import run_on_ranks
from sparsecomm import SparseDeltaAverager

pytestmark = pytest.mark.timeout(240)

PERIOD, SYNCS = 3, 4
OVERFLOW_BATCH = 5  # the batch whose optimizer step would end the second period
LOSS_SCALE = 3e38
WIDTH = 16


def _loop(rank, averaged: bool, scaled_ranks, dropped_ranks, skips: bool = True) -> dict:
    model = mlp(width=WIDTH, depth=2)
    ddp = DDP(model)
    averager = SparseDeltaAverager(ddp, period=PERIOD, density=0.125, chunk_size=64) if averaged else None
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=0.01)
    batches = rank_data(rank, PERIOD * SYNCS + 2, (8, WIDTH))  # different data on every rank; spares for a skip
    skipped, sync_batches, overflow = 0, [], None
    for index, x in enumerate(batches):
        if averaged and averager.optimizer_steps == PERIOD * SYNCS:
            break  # the rule: end on the averager's count, the same on every rank
        if not averaged and index == PERIOD * SYNCS + 1:
            break  # plain DDP: the same batches the averaged run needed
        if index == OVERFLOW_BATCH and rank in dropped_ranks:
            continue
        optimizer.zero_grad()
        # A target of 6x: gradients large enough that 3e38 times them gives both Inf and
        # finite entries above 1e37 on every rank (checked below).
        loss = (ddp(x) - 6 * x[:, :4]).square().mean()
        if index == OVERFLOW_BATCH and rank in scaled_ranks:
            loss = loss * LOSS_SCALE
        loss.backward()
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        if index == OVERFLOW_BATCH and rank in scaled_ranks:
            finite = grads[torch.isfinite(grads)]
            overflow = {"inf": int(torch.isinf(grads).sum()), "largest_finite": float(finite.abs().max())}
        if skips and not all_finite([grads]):
            skipped += 1
            continue
        optimizer.step()
        try:
            if averaged and averager.step():
                sync_batches.append(index)
        except Exception as error:  # noqa: BLE001 - the type is what the test checks
            return {"raised": (type(error).__name__, str(error)), "batch": index}
    result = {"skipped": skipped, "overflow": overflow,
              "weights": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).view(torch.int32)}
    if averaged:
        result |= {"error": averager.error.view(torch.int32), "anchor": averager.anchor.view(torch.int32),
                   "steps": averager.optimizer_steps, "sync_batches": sync_batches}
    return result


def _runs(rank, world_size):
    everyone, one = range(world_size), (1,)
    return {"plain": _loop(rank, False, everyone, ()),
            "skipped everywhere": _loop(rank, True, everyone, ()),
            "dropped everywhere": _loop(rank, True, (), everyone),
            "skipped on rank 1": _loop(rank, True, one, ()),
            "dropped on rank 1": _loop(rank, True, (), one),
            "not skipped": _loop(rank, True, everyone, (), skips=False)}


def _same_run(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in ("weights", "error", "anchor")) and a["steps"] == b["steps"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_skipped_overflow_step_leaves_no_trace_with_local_steps(world_size):
    per_rank = run_on_ranks(_runs, world_size=world_size, timeout=200)
    for rank, runs in enumerate(per_rank):
        for name in ("plain", "skipped everywhere") + (("skipped on rank 1",) if rank == 1 else ()):
            overflow = runs[name]["overflow"]  # the case of the issue: Inf and huge finite entries
            assert overflow["inf"] > 0 and overflow["largest_finite"] > 1e30, (name, rank, overflow)
        assert runs["plain"]["skipped"] == 1
        assert runs["skipped everywhere"]["skipped"] == runs["plain"]["skipped"]
        assert _same_run(runs["skipped everywhere"], runs["dropped everywhere"]), rank
        assert runs["skipped on rank 1"]["skipped"] == (rank == 1)
        assert _same_run(runs["skipped on rank 1"], runs["dropped on rank 1"]), rank
        assert runs["skipped on rank 1"]["steps"] == PERIOD * SYNCS
        # Rank 1's syncs from the second on came one batch later: they paired by count.
        expected = [PERIOD * (i + 1) - 1 + (rank == 1 and PERIOD * (i + 1) > OVERFLOW_BATCH) for i in range(SYNCS)]
        assert runs["skipped on rank 1"]["sync_batches"] == expected, rank
        # A loop that steps on the overflow: AdamW turns its Inf into NaN weights, and the
        # next sync is refused on every rank alike instead of spreading them.
        kind, message = runs["not skipped"]["raised"]
        assert kind == "NonFiniteSyncError" and runs["not skipped"]["batch"] == OVERFLOW_BATCH, (kind, message)
        assert f"rank(s) {list(range(world_size))} sent Inf or NaN" in message, message
    assert len({runs["not skipped"]["raised"] for runs in per_rank}) == 1  # the same error on every rank
    for name in ("skipped everywhere", "skipped on rank 1"):  # the run ends on a sync: one model again
        assert all(torch.equal(runs[name]["weights"], per_rank[0][name]["weights"]) for runs in per_rank), name
