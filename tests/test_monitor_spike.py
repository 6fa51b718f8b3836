"""Update-spike detector (reliability.md E5).

Localises: a scale that a spike drags up (mean instead of median, spikes kept in the
history), judging before there is a history, missing NaN/Inf norms, flagging one step
late (after the bucket was sent), and false alarms on an ordinary training run.
"""
import math

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from rank_processes import run_on_ranks
from sparsecomm import TopKState, topk_hook
from sparsecomm.hooks.state.events import HookEvent
from sparsecomm.monitor import BitFlipInjector, CorruptionDetected, UpdateSpikeDetector
from sparsecomm.monitor.spike import DEFAULT_THRESHOLD

CLEAN_STEPS = 240  # >= 200 clean steps (reliability.md E5), then the fault


def test_observe_flags_only_after_warmup_and_keeps_spikes_out_of_the_scale():
    detector = UpdateSpikeDetector(threshold=10, warmup=5, window=8, action="record")
    for step in range(5):
        assert not detector.observe(step, 1.0 + 0.1 * step)
    assert detector.scale == pytest.approx(1.2)
    assert detector.observe(5, 100.0)  # 100 / 1.2 > 10
    assert detector.observe(6, 100.0)  # still a spike: the first one did not enter the scale
    assert not detector.observe(7, 11.0)  # 11 / 1.2 < 10
    assert [a["step"] for a in detector.alarms] == [5, 6]
    assert detector.alarms[0]["ratio"] == pytest.approx(100 / 1.2)
    assert detector.max_clean_ratio == pytest.approx(11 / 1.2)


def test_non_finite_norm_is_flagged_even_during_warmup_and_raise_mode_raises():
    detector = UpdateSpikeDetector(action="record")
    assert detector.observe(0, math.nan) and detector.observe(1, math.inf)
    raising = UpdateSpikeDetector(threshold=5, warmup=3)
    for step in range(3):
        raising.observe(step, 2.0, rank=1)
    with pytest.raises(CorruptionDetected) as caught:
        raising.observe(3, 50.0)
    assert (caught.value.check, caught.value.step, caught.value.ranks) == ("update_spike", 3, (1,))
    with pytest.raises(ValueError, match="threshold"):
        UpdateSpikeDetector(threshold=1.0)


def _event(step, bucket, gradient):
    return HookEvent("gradient", step, 0, bucket, ("w",), (gradient.numel(),), False, {"gradient": gradient})


def test_observer_adds_buckets_of_a_step_and_flags_within_the_step():
    detector = UpdateSpikeDetector(threshold=10, warmup=3, action="record")
    for step in range(3):  # two buckets of norm 3 and 4 per step: step norm 5
        detector(_event(step, 0, torch.tensor([3.0])))
        detector(_event(step, 1, torch.tensor([4.0])))
    detector(_event(3, 0, torch.tensor([3.0])))
    assert detector.steps_seen == 3 and detector.scale == 5.0
    detector(_event(3, 1, torch.tensor([1e3])))  # flagged at this bucket, before the next step starts
    assert [a["step"] for a in detector.alarms] == [3]
    detector(_event(4, 0, torch.tensor([5.0])))
    assert detector.steps_seen == 3  # the spiked step 3 did not enter the history


# ----- E5: exponent flip in one gradient entry, after a clean 240-step run ----------------


def _e5_worker(rank, world_size):
    from sparsecomm.lab.tasks.digits import DigitsMLP

    task = DigitsMLP()
    torch.manual_seed(0)
    model = task.build_model()
    ddp = DDP(model)
    state = TopKState(density=0.01, module=ddp)
    ddp.register_comm_hook(state, topk_hook)
    # Rank 1's last-layer bias gradient entry 3 (never 0, |g| < 1): bit 30 multiplies it by 2**128.
    injector = BitFlipInjector("gradient", step=CLEAN_STEPS, rank=1, bit=30, index=3, name="4.bias")
    detector = UpdateSpikeDetector(action="record")  # record: the test must not leave a rank in a collective
    state.add_observer(injector)  # before the detector, which must see the fault in the same step
    state.add_observer(detector)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(1000 + rank)  # different data on every rank
    for _ in range(CLEAN_STEPS + 1):
        ids = torch.randint(task.num_train_samples, (32,), generator=generator)
        optimizer.zero_grad()
        task.loss(ddp, *task.train_batch(ids)).backward()
        optimizer.step()
    return detector.alarms, injector.injected, detector.max_clean_ratio, task.val_loss(model)


@pytest.mark.timeout(120)
def test_e5_exponent_flip_flagged_in_the_same_step_and_no_false_alarms():
    (alarms0, _, margin0, _), (alarms1, injected, margin1, _) = run_on_ranks(_e5_worker)
    assert injected[0]["step"] == CLEAN_STEPS and abs(injected[0]["before"]) < 1
    assert alarms0 == []  # 241 steps on rank 0, 240 clean steps on rank 1: no false alarm
    assert [a["step"] for a in alarms1] == [CLEAN_STEPS]
    assert alarms1[0]["ratio"] > 1e6
    print(f"largest clean norm/median ratio: {max(margin0, margin1):.2f} (threshold {DEFAULT_THRESHOLD:g})")
    assert max(margin0, margin1) < DEFAULT_THRESHOLD / 2  # a real margin, not a near miss
