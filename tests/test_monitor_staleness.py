"""Residual staleness and drift.

Localises: ages that do not grow on unsent entries or do not reset on sent ones, a dense
step that does not reset, ages lost when DDP changes the bucket layout, an observation
cadence that under-reports, and a monitor that raises when it should only mark the run.
"""
import math

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm
from rank_processes import run_on_ranks
from sparsecomm.hooks.state.events import HookEvent
from sparsecomm.monitor import StalenessExceeded, StalenessMonitor
from sparsecomm.lab.results.policy import Policy


def _events(step, residual, indices, dense=False, names=("a", "b"), numels=(2, 3), bucket=0, gradient=None):
    acc = residual.clone() + 1.0
    gradient = torch.ones_like(residual) if gradient is None else gradient
    return [
        HookEvent("gradient", step, 0, bucket, names, numels, dense, {"gradient": gradient}),
        HookEvent("packed", step, 0, bucket, names, numels, dense,
                  {"acc": acc, "residual": residual, "indices": indices, "payload": None}),
    ]


def _feed(monitor, *events):
    for event in events:
        monitor(event)


def test_ages_grow_unsent_reset_sent_and_zero_and_dense():
    monitor = StalenessMonitor(3, world_size=1)
    residual = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0])
    _feed(monitor, *_events(2, residual, torch.tensor([0])))
    assert monitor.ages()["a"].tolist() == [0, 1] and monitor.ages()["b"].tolist() == [1, 0, 1]
    _feed(monitor, *_events(3, residual, torch.tensor([4])))
    assert monitor.ages()["a"].tolist() == [1, 2] and monitor.ages()["b"].tolist() == [2, 0, 0]
    _feed(monitor, *_events(4, residual, torch.tensor([0])), *_events(5, residual, torch.tensor([0])))
    report = monitor.report()
    assert report["max_age"] == 4 and report["oldest"] == "a[1]" and report["step"] == 5
    assert report["exceeded"] and "a[1] waited 4 steps" in report["unverified_reason"]
    assert report["mean_age"] == pytest.approx((0 + 4 + 4 + 0 + 2) / 5)
    assert report["memory_bytes"] == 5 * 4 and report["tracked_elements"] == 5
    # ratio = ||residual|| / ||gradient / ws||: 2 / sqrt(5); held fraction ||residual|| / ||acc||.
    assert report["ratio"] == pytest.approx(2 / math.sqrt(5))
    assert report["held_fraction"] == pytest.approx(2 / torch.linalg.vector_norm(residual + 1).item())
    _feed(monitor, *_events(6, torch.zeros(5), None, dense=True))  # dense: everything sent
    report = monitor.report()
    assert report["max_age"] == 0 and not report["exceeded"] and report["unverified_reason"] is None


def test_every_n_steps_is_an_upper_bound_and_layout_changes_keep_ages():
    exact, sparse = StalenessMonitor(100, world_size=1), StalenessMonitor(100, every=2, world_size=1)
    residual = torch.ones(5)
    for step, sent in [(2, 1), (3, 0), (4, 2), (5, 3), (6, 4)]:
        for monitor in (exact, sparse):
            _feed(monitor, *_events(step, residual, torch.tensor([sent])))
    for name in ("a", "b"):
        assert torch.all(sparse.ages()[name] >= exact.ages()[name])
    # A rebuilt bucket with the parameters in another order: ages follow the names.
    before = exact.ages()
    _feed(exact, *_events(7, torch.zeros(5), torch.tensor([0]), names=("b", "a"), numels=(3, 2), bucket=1))
    after = exact.ages()
    assert after["a"].tolist() == [0, 0] and after["b"].tolist() == [0, 0, 0]  # zero residual: nothing waits
    assert before["a"].tolist() != [0, 0]
    residual = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0])
    _feed(exact, *_events(8, residual, torch.tensor([3]), names=("b", "a"), numels=(3, 2), bucket=1))
    assert exact.ages()["b"].tolist() == [1, 1, 1] and exact.ages()["a"].tolist() == [0, 1]


def test_raise_action_and_policy():
    monitor = StalenessMonitor.from_policy(Policy(staleness_limit=1), action="raise", world_size=1)
    residual = torch.ones(5)
    _feed(monitor, *_events(2, residual, torch.tensor([0])))
    with pytest.raises(StalenessExceeded, match="over the staleness limit of 1"):
        _feed(monitor, *_events(3, residual, torch.tensor([0])))
    with pytest.raises(ValueError, match="limit_steps"):
        StalenessMonitor(0)


# ----- in the real hook, 2 gloo ranks -------------------------------------------------------


def _staleness_worker(rank, world_size):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    ddp = DDP(model)
    state = sparsecomm.register_topk_hook(ddp, density=0.02)
    exact = StalenessMonitor(5)
    coarse = StalenessMonitor(5, every=3)
    reference, history = {}, []

    def recompute(event):  # the definition, written out: +1, 0 where sent or nothing waits
        if event.stage != "packed" or event.tensors["residual"] is None:
            return
        ages = reference.setdefault(event.names, torch.zeros(event.tensors["acc"].numel(), dtype=torch.int32))
        if event.dense:
            ages.zero_()
            return
        ages += 1
        ages[event.tensors["residual"] == 0] = 0
        ages[event.tensors["indices"]] = 0
        history.append(int(ages.max()))

    for observer in (exact, coarse, recompute):
        state.add_observer(observer)
    generator = torch.Generator().manual_seed(1000 + rank)  # different data (and residuals) per rank
    for _ in range(16):  # the last step, 15, is one the coarse monitor observes
        ddp.zero_grad()
        ddp(torch.randn(8, 32, generator=generator)).pow(2).mean().backward()
    (names, expected), = reference.items()
    got = torch.cat([exact.ages()[name] for name in names])
    upper = torch.cat([coarse.ages()[name] for name in names])
    return torch.equal(got, expected), bool(torch.all(upper >= expected)), exact.report(), history


@pytest.mark.timeout(120)
def test_ages_match_the_definition_in_the_real_hook_and_flag_a_small_limit():
    for same, bounded, report, history in run_on_ranks(_staleness_worker):
        assert same and bounded
        assert history == sorted(history) and history[-1] == 14  # 14 sparse steps after 2 warm-up
        assert report["max_age"] == 14 and report["exceeded"]  # limit 5: the run is unverified
        assert "over the staleness limit of 5 steps" in report["unverified_reason"]
        assert 0 < report["held_fraction"] < 1 and report["ratio"] > 1
