"""Aggregated-gradient agreement before the optimizer step (reliability.md E3).

Localises: a check that runs after the damage is committed (after optimizer.step), one
that raises on a single rank (the other would step on and hang later), a step that is
skipped on one rank but not the other (replicas would drift), and a window vote that
misses a fault on a step that ends no window (a running digest that drops or cancels a
step). The fault: one rank's reduced gradient is corrupted after the collective, at hook
stage ``reduced``, which DDP then copies into that rank's ``.grad``.
"""
import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm
from ddp_models import mlp, params
from rank_processes import run_on_ranks
from sparsecomm.monitor import BitFlipInjector, CorruptionDetected, GradientAgreementMonitor, flip_bit

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
    # The same check twice, with both rules for naming suspects (two ranks: no majority);
    # every step, so the faulty step is stopped before the optimizer applies it.
    both_named = GradientAgreementMonitor(ddp, every=1)
    rank0_reference = GradientAgreementMonitor(ddp, every=1, reference_rank=0)
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


# ----- a vote every 4 steps: its own step, or the window since the last vote, 3 gloo ranks ----

EVERY = 4  # votes at steps 0, 4, 8
FAULTS = [(step, bit) for step in (1, 3, 4, 5) for bit in (31, 27, 3)]  # sign, exponent, mantissa bits


def _vote_worker(rank, world_size):
    outcomes = []
    for window, fault in [(window, fault) for window in (True, False) for fault in [None, *FAULTS]]:
        model = mlp()
        ddp = DDP(model)
        state = sparsecomm.register_topk_hook(ddp, density=0.05)
        if fault is not None:
            step, bit = fault
            state.add_observer(BitFlipInjector("reduced", step=step, rank=1, bit=bit, index=17, name="2.weight"))
        vote = GradientAgreementMonitor(ddp, every=EVERY, window=window)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
        generator = torch.Generator().manual_seed(1000 + rank)  # different data on every rank
        found = None
        for step in range(2 * EVERY + 1):
            optimizer.zero_grad()
            ddp(torch.randn(8, 32, generator=generator)).pow(2).mean().backward()
            try:
                vote.check(step)
            except CorruptionDetected as error:
                found = (step, error.check, error.ranks, error.detail, vote.last_agreed_step, params(model))
                break
            optimizer.step()
        outcomes.append((window, fault, found, vote.checks, vote.last_agreed_step))
    return outcomes


def _assert_caught(fault, found0, found1, found2, vote_step, window):
    previous = vote_step - EVERY
    assert found0 is not None, fault
    # Every rank raises at the same vote and names rank 1 (the majority holds the other
    # digest); the previous vote had agreed.
    expected = (vote_step, "gradient_agreement", (1,), found0[3], previous)
    assert [f[:5] for f in (found0, found1, found2)] == [expected] * 3
    assert (f"steps {previous + 1}..{vote_step}" if window else f"step {vote_step}") in found0[3], found0[3]
    if fault[0] == vote_step:  # the fault is on the vote's own step: stopped before the optimizer step
        for mine, theirs in zip(found1[5], found0[5]):
            assert torch.equal(mine, theirs), fault
    for mine, theirs in zip(found2[5], found0[5]):  # the healthy ranks never differ
        assert torch.equal(mine, theirs), fault


@pytest.mark.timeout(240)
def test_a_flip_in_one_ranks_reduced_gradient_is_caught_at_the_next_vote_with_a_window_else_on_vote_steps_only():
    results = run_on_ranks(_vote_worker, world_size=3, timeout=230)
    for (window, fault, *outcome0), (_, _, *outcome1), (_, _, *outcome2) in zip(*results):
        found0, found1, found2 = (o[0] for o in (outcome0, outcome1, outcome2))
        if fault is None:  # clean: three votes (steps 0, 4, 8), all agreed
            assert outcome0[1:] == outcome1[1:] == outcome2[1:] == [3, 8] and found0 is found1 is found2 is None
        elif window:  # any step: caught at the first vote at or after it
            _assert_caught(fault, found0, found1, found2, -(-fault[0] // EVERY) * EVERY, window)
        elif fault[0] % EVERY == 0:  # without a window, a fault on a vote step only
            _assert_caught(fault, found0, found1, found2, fault[0], window)
        else:  # ... and the votes after a fault between votes compare clean gradients
            assert found0 is found1 is found2 is None, fault


def test_bad_settings_are_refused_naming_the_argument():
    with pytest.raises(TypeError, match="window must be True or False"):
        GradientAgreementMonitor(nn.Linear(2, 2), window="yes")
    with pytest.raises(ValueError, match="every"):
        GradientAgreementMonitor(nn.Linear(2, 2), every=0)
