"""``budget="model"``: the buckets share one k, each bucket's part taken from the last
step's model-wide top-k, agreed over the ranks (sparsecomm.hooks.model_budget)."""
import math

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm
from sparsecomm.checkpoint import rebuild_buckets
from multiprocess import run_on_ranks

pytestmark = pytest.mark.timeout(120)

DENSITY = 0.05
STEPS = 6


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 32, bias=False), torch.nn.Tanh(), torch.nn.Linear(32, 8))


def _batch(generator):
    return torch.randn(8, 24, generator=generator)


def _train(rank, world_size, budget):
    """One parameter per DDP bucket (tiny buckets), so the bucket layout is the same before
    and after DDP's rebuild. Returns per step and bucket (names, acc, k sent) seen by an
    observer, and the final weights."""
    model = DDP(_model(), bucket_cap_mb=1e-6)
    state = sparsecomm.register_topk_hook(model, density=DENSITY, budget=budget, verify_conservation=True,
                                          allow_dense_fallback=False)
    seen = []

    def observe(event):
        if event.stage == "packed" and not event.dense:
            seen.append((event.step, tuple(event.names), event.tensors["acc"].clone(),
                         int(event.tensors["indices"].numel())))

    state.add_observer(observe)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(7 + rank)  # different data on every rank
    for _ in range(STEPS):
        optimizer.zero_grad()
        model(_batch(generator)).pow(2).mean().backward()
        optimizer.step()
    names = dict(model.module.named_parameters())
    return seen, {name: p.detach().clone() for name, p in names.items()}, state.stats()


def _expected_k(seen_step, world_size):
    """The rule worked by hand from one step's accs: every bucket keeps its 8 x k0 largest
    magnitudes; the K-th largest of all of them (K = sum of k0) is the threshold; each
    parameter's count at or above it, summed over the ranks, is its share of K."""
    k0 = {names: max(1, math.ceil(DENSITY * acc.numel())) for names, acc, _ in seen_step}
    kept = {names: sorted(acc.abs().tolist(), reverse=True)[: 8 * k0[names]] for names, acc, _ in seen_step}
    budget = sum(k0.values())
    threshold = sorted((m for values in kept.values() for m in values), reverse=True)[budget - 1]
    order = sorted(names for names in kept)
    counts = torch.tensor([float(sum(m >= threshold for m in kept[names])) for names in order], dtype=torch.float64)
    dist.all_reduce(counts)
    return {names: min(len(seen_acc), max(1, round(budget * float(c) / float(counts.sum()))))
            for names, c, seen_acc in zip(order, counts, [dict((n, a) for n, a, _ in seen_step)[n] for n in order])}


def _allocation_worker(rank, world_size):
    seen, _, stats = _train(rank, world_size, "model")
    by_step = {}
    for step, names, acc, k in seen:
        by_step.setdefault(step, []).append((names, acc, k))
    checks = []
    steps = sorted(by_step)
    for step, following in zip(steps, steps[1:]):
        expected = _expected_k(by_step[step], world_size)
        sent = {names: k for names, _, k in by_step[following]}
        checks.append((expected, sent))
    plain = {names: max(1, math.ceil(DENSITY * acc.numel())) for names, acc, _ in by_step[steps[0]]}
    return checks, plain, stats


def test_each_bucket_sends_its_share_of_the_last_steps_model_wide_top_k():
    for rank, (checks, plain, stats) in enumerate(run_on_ranks(_allocation_worker, world_size=3)):
        assert len(checks) == STEPS - 3  # sparse steps after the 2 dense warm-up steps, each followed by one
        for expected, sent in checks:
            assert sent == expected, f"rank {rank}"
        # Here the output layer's weight holds most of the gradient's mass: it gets more than
        # twice its plain share (13 of 53), taken from the larger first layer.
        last = checks[-1][1]
        assert last[("2.weight",)] > 2 * plain[("2.weight",)] and last[("0.weight",)] < plain[("0.weight",)]
        assert sum(checks[-1][1].values()) == pytest.approx(sum(plain.values()), abs=len(plain))
        assert stats["sparse_calls"] > 0


def _resume_worker(rank, world_size, budget="model"):
    """Uninterrupted STEPS steps against STEPS // 2, a save of everything, a fresh model, hook
    and optimizer that load it, and the rest."""
    def build():
        model = DDP(_model(), bucket_cap_mb=1e-6)
        state = sparsecomm.register_topk_hook(model, density=DENSITY, budget=budget, allow_dense_fallback=False)
        return model, state, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def run(model, optimizer, generator, steps):
        for _ in range(steps):
            optimizer.zero_grad()
            model(_batch(generator)).pow(2).mean().backward()
            optimizer.step()

    model, _, optimizer = build()
    run(model, optimizer, torch.Generator().manual_seed(7 + rank), STEPS)
    whole = [p.detach().clone() for p in model.parameters()]

    model, state, optimizer = build()
    generator = torch.Generator().manual_seed(7 + rank)
    run(model, optimizer, generator, STEPS // 2)
    saved = (model.state_dict(), optimizer.state_dict(), state.state_dict())
    shares = dict(saved[2].get("budget_shares", {}))
    model, state, optimizer = build()
    model.load_state_dict(saved[0])
    optimizer.load_state_dict(saved[1])
    state.load_state_dict(saved[2])
    # A new DDP's first pass buckets by registration order; teach it the rebuilt layout first.
    rebuild_buckets(model, state, lambda: (model(torch.zeros(1, 24)).sum() * 0).backward())
    run(model, optimizer, generator, STEPS - STEPS // 2)
    return [torch.equal(a, b.detach()) for a, b in zip(whole, model.parameters())], shares


@pytest.mark.parametrize("budget", ["model", "bucket"])
def test_a_resumed_run_equals_the_uninterrupted_one_bit_for_bit(budget):
    for rank, (equal, shares) in enumerate(run_on_ranks(_resume_worker, budget, world_size=2)):
        assert all(equal), f"rank {rank}: {equal}"
        if budget == "model":  # the shares travel with the state; the plain budget has none
            assert set(shares) == {"0.weight", "2.weight", "2.bias"} and sum(shares.values()) > 0
        else:
            assert shares == {}


@pytest.mark.parametrize("options, message", [
    (dict(selector="chunk"), "selector='exact'"),
    (dict(exchange="owner"), "exchange='allgather'"),
    (dict(k_scope="parameter"), "k_scope='bucket'"),
], ids=["chunk", "owner", "per-parameter"])
def test_a_model_budget_outside_the_exact_all_gather_is_refused(options, message):
    with pytest.raises(ValueError, match=f"budget='model' moves k between the buckets.*{message}"):
        sparsecomm.TopKState(density=0.01, budget="model", **options)
    with pytest.raises(ValueError, match="budget must be one of 'bucket', 'model'; got 'global'"):
        sparsecomm.TopKState(density=0.01, budget="global")


def _overflow_worker(rank, world_size):
    model = DDP(_model(), bucket_cap_mb=1e-6)
    state = sparsecomm.register_topk_hook(model, density=DENSITY, budget="model", allow_dense_fallback=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(7 + rank)
    for _ in range(4):
        optimizer.zero_grad()
        model(_batch(generator)).pow(2).mean().backward()
        optimizer.step()
    before = state.state_dict()["budget_shares"]
    optimizer.zero_grad()
    x = _batch(generator)
    if rank == 1:
        x[0, 0] = float("inf")  # an overflow on one rank only; the loop skips the step
    model(x).pow(2).mean().backward()
    after = state.state_dict()["budget_shares"]
    return before, after


def test_a_step_that_overflowed_on_any_rank_leaves_the_shares_as_they_were():
    results = run_on_ranks(_overflow_worker, world_size=3)
    for before, after in results:
        assert before and after == before
