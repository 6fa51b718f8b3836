"""Aggregated-gradient agreement before the optimizer step (reliability.md E3).

Localises: a check that runs after the damage is committed (after optimizer.step), one
that raises on a single rank (the other would step on and hang later), and a step that
is skipped on one rank but not the other (replicas would drift). The fault: one rank's
reduced gradient is corrupted after the collective, by an observer at stage ``reduced``,
which DDP then copies into that rank's ``.grad``.
"""
import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm
from multiprocess import run_on_ranks
from sparsecomm.monitor import CorruptionDetected, GradientAgreementMonitor, flip_bit

pytestmark = pytest.mark.timeout(120)

CORRUPT_STEP = 4


def _mlp(width=32, out=4):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, out))


def _e3_worker(rank, world_size):
    model = _mlp()
    ddp = DDP(model)
    state = sparsecomm.register_topk_hook(ddp, density=0.05)
    corrupted = []

    def corrupt_received_gradient(event):
        # After the collective, on rank 1 only: the kind of fault only a cross-rank check sees.
        if event.stage == "reduced" and event.step == CORRUPT_STEP and event.rank == 1:
            corrupted.append(flip_bit(event.tensors["reduced"], 5, 20))

    state.add_observer(corrupt_received_gradient)
    # The same check twice, with both rules for naming suspects (two ranks: no majority).
    both_named = GradientAgreementMonitor(ddp)
    rank0_reference = GradientAgreementMonitor(ddp, reference_rank=0)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(1000 + rank)  # different data on every rank
    detections, committed = [], []
    for step in range(8):
        x = torch.randn(8, 32, generator=generator)
        optimizer.zero_grad()
        ddp(x).pow(2).mean().backward()
        found = []
        for monitor in (both_named, rank0_reference):
            try:
                monitor.check(step)
            except CorruptionDetected as error:
                found.append((step, error.check, error.ranks))
        if found:
            detections.append(found)
            continue  # skip this step on every rank
        optimizer.step()
        committed.append(step)
    return detections, committed, corrupted, [p.detach().clone() for p in model.parameters()]


def test_e3_corrupt_reduced_gradient_stops_the_step_on_all_ranks():
    (det0, committed0, _, params0), (det1, committed1, corrupted, params1) = run_on_ranks(_e3_worker)
    assert len(corrupted) == 1 and corrupted[0][0] != corrupted[0][1]
    expected = [[(CORRUPT_STEP, "gradient_agreement", (0, 1)), (CORRUPT_STEP, "gradient_agreement", (1,))]]
    assert det0 == det1 == expected
    assert committed0 == committed1 == [s for s in range(8) if s != CORRUPT_STEP]
    # The corrupt gradient never reached an optimizer: replicas are still bitwise equal.
    for a, b in zip(params0, params1):
        assert torch.equal(a, b)
