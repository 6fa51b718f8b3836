"""Density schedules (DGC warm-up): values by step, validation, and the hook following them."""
import math

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm
from sparsecomm import TopKState
from sparsecomm.hooks.state.settings import DensitySchedule
from rank_processes import run_on_ranks


def test_exponential_schedule_reproduces_dgc_warmup():
    # DGC: sparsity 75%, 93.75%, 98.4375%, 99.6%, then 99.9% (target density 0.001).
    schedule = DensitySchedule.exponential(0.001, steps=400, stages=4)
    stage = [0.001 ** (i / 5) for i in (1, 2, 3, 4)]
    assert [round(d, 4) for d in stage] == [0.2512, 0.0631, 0.0158, 0.0040]
    for step, density in [(0, stage[0]), (99, stage[0]), (100, stage[1]), (299, stage[2]), (300, stage[3]),
                          (399, stage[3]), (400, 0.001), (10_000, 0.001)]:
        assert schedule(step) == pytest.approx(density, rel=1e-12)


def test_piecewise_schedule_and_state_density_by_step():
    state = TopKState(density=0.01, density_schedule=[(0, 0.2), (10, 0.05), (30, 0.01)])
    seen = {}
    for step in (0, 9, 10, 29, 30, 1000):
        state.step = step
        seen[step] = state.current_density()
    assert seen == {0: 0.2, 9: 0.2, 10: 0.05, 29: 0.05, 30: 0.01, 1000: 0.01}
    assert state.stats()["density"] == 0.01
    assert TopKState(density=0.01).density_schedule.to_list() == [[0, 0.01]]


@pytest.mark.parametrize(
    "schedule, error, message",
    [
        ([(0, 0.2), (10, 0.05)], ValueError, "must end at the target density 0.01"),
        ([], ValueError, "needs at least one"),
        ([(5, 0.01)], ValueError, "must start at step 0"),
        ([(0, 0.1), (10, 0.05), (10, 0.01)], ValueError, "must increase strictly"),
        ([(0, -0.5), (10, 0.01)], ValueError, r"density schedule density must be in \(0.0, 1.0\]"),
        ([(0, 0.1, 3)], ValueError, "must be \\(first_step, density\\) pairs"),
        ({"kind": "linear", "steps": 10}, ValueError, "must be {'kind': 'exponential'"),
        ({"kind": "exponential", "steps": 3, "stages": 4}, ValueError, r"stages must be <= steps \(3\), got 4"),
        ({"kind": "exponential", "steps": 0}, ValueError, "steps must be an integer >= 1"),
        ("exponential", TypeError, "density_schedule must be None, a DensitySchedule"),
        (DensitySchedule.exponential(0.02, 10), ValueError, "must end at density=0.01"),
    ],
)
def test_bad_schedules_are_rejected_naming_the_argument(schedule, error, message):
    with pytest.raises(error, match=message):
        TopKState(density=0.01, density_schedule=schedule)


def _scheduled_worker(rank, world_size):
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)))
    numel = sum(p.numel() for p in model.parameters())
    state = sparsecomm.register_topk_hook(
        model, density=0.01, density_schedule=[(0, 0.1), (4, 0.05), (6, 0.01)], allow_dense_fallback=False
    )
    generator = torch.Generator().manual_seed(100 + rank)  # different data on every rank
    sent = []
    for _ in range(8):
        before = state.stats()["elements_sent"]
        model(torch.randn(16, 64, generator=generator)).pow(2).mean().backward()
        sent.append(state.stats()["elements_sent"] - before)
    return numel, sent, state.stats()["density"]


def test_hook_sends_what_the_schedule_says():
    for numel, sent, density in run_on_ranks(_scheduled_worker):
        k = {d: math.ceil(d * numel) for d in (0.1, 0.05, 0.01)}
        expected = [0, 0] + [k[0.1]] * 2 + [k[0.05]] * 2 + [k[0.01]] * 2  # 2 dense warm-up steps first
        assert sent == expected, (sent, expected)
        assert density == 0.01
