"""``budget="model"``: the buckets share one k, each bucket's part taken from the last
step's model-wide top-k, agreed over the ranks (sparsecomm.hooks.state.model_budget)."""
import math

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm
from sparsecomm.checkpoint import rebuild_buckets
from rank_processes import run_on_ranks

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


def _magnitude_bin(value: float) -> int:
    """|value|'s bin: 8 per power of two, numbered from 0 (zero) up; from frexp, not from bits."""
    magnitude = abs(value)
    smallest_normal = 2.0 ** -126
    if magnitude < smallest_normal:  # zero and subnormals: the first power's 8 bins
        return int(magnitude / smallest_normal * 8)
    fraction, exponent = math.frexp(magnitude)  # magnitude = fraction x 2^exponent, 0.5 <= fraction < 1
    return (exponent - 1 + 127) * 8 + int((2 * fraction - 1) * 8)


def _expected_k(seen_step, world_size):
    """The rule worked by hand from one step's accs: count every bucket's entries per eighth of
    a power of two, sum the counts over the ranks; the threshold is the highest bin at or
    above which K x world-size entries lie (K = the sum of the plain k's); a bucket's share
    of K is its count above it plus, of its count at it, the fraction still needed."""
    k0 = {names: max(1, math.ceil(DENSITY * acc.numel())) for names, acc, _ in seen_step}
    budget = sum(k0.values())
    order = sorted(names for names in k0)
    accs = {names: acc for names, acc, _ in seen_step}
    table = torch.zeros(len(order), 255 * 8, dtype=torch.float64)
    for row, names in enumerate(order):
        for value in accs[names].tolist():
            table[row, _magnitude_bin(value)] += 1
    dist.all_reduce(table)
    target = budget * world_size
    per_bin = table.sum(0).tolist()
    threshold = max((e for e in range(255 * 8) if sum(per_bin[e:]) >= target), default=0)
    needed = target - sum(per_bin[threshold + 1:])
    entries = [sum(table[row, threshold + 1:].tolist()) + float(table[row, threshold]) * min(needed / per_bin[threshold], 1.0)
               for row in range(len(order))]
    return {names: min(accs[names].numel(), max(1, round(budget * count / sum(entries))))
            for names, count in zip(order, entries)}


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
    (dict(selector="random"), "needs selector 'exact' or 'chunk'"),
    (dict(selector="sampled"), "needs selector 'exact' or 'chunk'"),
    (dict(k_scope="parameter"), "needs k_scope='bucket'"),
    (dict(exchange="shared-mask"), "exchange='shared-mask' sizes every tensor's mask itself"),
    (dict(selector="sampled", transport="mpi"), "needs selector 'exact' or 'chunk'"),
], ids=["random", "sampled", "per-parameter", "shared-mask", "mpi"])
def test_a_model_budget_where_it_cannot_apply_is_refused_and_the_default_is_the_bucket_budget_there(options, message):
    with pytest.raises(ValueError, match=f"budget='model' moves k between the buckets, .*{message}.*budget='bucket'"):
        sparsecomm.TopKState(density=0.01, budget="model", **options)
    assert sparsecomm.TopKState(density=0.01, **options).config.budget == "bucket"
    with pytest.raises(ValueError, match="budget must be one of 'bucket', 'model'; got 'global'"):
        sparsecomm.TopKState(density=0.01, budget="global")


@pytest.mark.parametrize("options", [
    dict(), dict(selector="chunk", index_codec="rice", value_codec="int4"), dict(exchange="owner"),
    dict(selector="chunk", exchange="owner"), dict(exchange="shared-index"), dict(exchange="auto"),
    dict(value_codec="int2", index_codec="rice"),
], ids=["exact", "chunk-rice-int4", "owner", "chunk-owner", "shared-index", "auto", "exact-rice-int2"])
def test_the_model_budget_is_the_default_on_every_selector_and_exchange_it_applies_to(options):
    assert sparsecomm.TopKState(density=0.01, **options).config.budget == "model"


def _after_four_steps(rank):
    """A model-budget hook after 4 steps (2 of them sparse), its shares then, and the next batch."""
    model = DDP(_model(), bucket_cap_mb=1e-6)
    state = sparsecomm.register_topk_hook(model, density=DENSITY, budget="model", allow_dense_fallback=False,
                                          momentum=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(7 + rank)
    for _ in range(4):
        optimizer.zero_grad()
        model(_batch(generator)).pow(2).mean().backward()
        optimizer.step()
    optimizer.zero_grad()
    return model, state, state.state_dict()["budget_shares"], _batch(generator)


def _overflow_worker(rank, world_size):
    model, state, before, x = _after_four_steps(rank)
    if rank == 1:
        x[0, 0] = float("inf")  # an overflow on one rank only; the loop skips the step
    model(x).pow(2).mean().backward()
    after = state.state_dict()["budget_shares"]
    return before, after


def test_a_step_that_overflowed_on_any_rank_leaves_the_shares_as_they_were():
    results = run_on_ranks(_overflow_worker, world_size=3)
    for before, after in results:
        assert before and after == before


def _skip_worker(rank, world_size):
    """Shares after step 4, then a step the loop skips (skip_step): they must be those of step 4."""
    model, state, before, x = _after_four_steps(rank)
    model(x * 50).pow(2).mean().backward()  # a loss spike the loop refuses
    during = dict(state.model_budget.shares)  # what the skipped step agreed on
    state.skip_step()
    return before, during, state.state_dict()["budget_shares"]


def test_a_step_the_loop_skips_gives_back_the_shares_it_started_from():
    for before, during, after in run_on_ranks(_skip_worker, world_size=3):
        assert during != before  # the skipped step did move them (so the test can fail)
        assert after == before


def _wire_worker(rank, world_size, options):
    """A model split over several buckets, whose last layer holds most of the gradient's mass:
    every wire the model budget applies to moves k towards it, conserves acc exactly (the audit)
    and keeps the replicas equal."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Tanh(), torch.nn.Linear(64, 64))
    with torch.no_grad():
        module[2].weight.mul_(0.01)  # a small last layer: the first layer's gradient (through it) is small
    model = DDP(module, bucket_cap_mb=1e-6)
    state = sparsecomm.register_topk_hook(model, density=0.05, allow_dense_fallback=False, verify_conservation=True,
                                          momentum=0, **options)
    sent = {}

    def observe(event):
        if event.stage == "packed" and not event.dense:
            sent[tuple(event.names)] = int(event.tensors["indices"].numel())

    state.add_observer(observe)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(11 + rank)
    for _ in range(6):
        optimizer.zero_grad()
        model(torch.randn(16, 64, generator=generator)).sub(1).pow(2).mean().backward()
        optimizer.step()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(weights) for _ in range(world_size)]
    dist.all_gather(gathered, weights)
    return state.config.budget, dict(state.model_budget.shares), sent, all(torch.equal(gathered[0], w) for w in gathered)


@pytest.mark.parametrize("options", [
    dict(selector="chunk", chunk_size=512, index_codec="rice", value_codec="int4"),
    dict(exchange="owner"),
    dict(selector="chunk", chunk_size=512, exchange="owner"),
    dict(exchange="shared-index"),
], ids=["chunk-rice-int4", "owner", "chunk-owner", "shared-index"])
def test_the_model_budget_moves_k_between_buckets_on_every_wire_it_applies_to(options):
    plain = math.ceil(0.05 * 64 * 64)  # each weight's plain k; the last layer's bias is a bucket of its own
    for budget, shares, sent, replicas_equal in run_on_ranks(_wire_worker, options, world_size=3):
        assert budget == "model" and replicas_equal
        assert shares["2.weight"] > 1.5 * plain > shares["0.weight"]  # the mass is in the last layer
        assert sent[("2.weight",)] > 1.5 * plain > sent[("0.weight",)]  # and the wire sent what the shares say


def _one_bucket_worker(rank, world_size):
    model = DDP(_model())  # one bucket: the whole model
    state = sparsecomm.register_topk_hook(model, density=DENSITY, allow_dense_fallback=False, momentum=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(7 + rank)
    budget_bytes = []
    for _ in range(6):
        optimizer.zero_grad()
        model(_batch(generator)).pow(2).mean().backward()
        optimizer.step()
        budget_bytes.append(state.stats()["last_step"]["bytes_budget"])
    return state.config.budget, budget_bytes, state.stats()["fused_calls"], state.model_budget.shares


def test_with_one_bucket_a_step_the_model_budget_sends_nothing_and_the_kernel_fuses_again():
    for budget, budget_bytes, fused_calls, shares in run_on_ranks(_one_bucket_worker, world_size=2):
        assert budget == "model"
        # 2 dense warm-up steps, then the first sparse step finds one bucket: nothing is ever sent
        assert budget_bytes == [0] * 6 and shares == {}
        assert fused_calls == 3  # the sparse steps after the first, on the fused path


def _toy_worker(rank, world_size):
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)), bucket_cap_mb=1e-6)  # 4 buckets
    state = sparsecomm.register_topk_hook(model, density=0.25, allow_dense_fallback=False, momentum=0)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(5):
        model(torch.randn(3, 4, generator=generator)).pow(2).mean().backward()
    return state.stats()["bytes_budget"], state.model_budget.counting


def test_a_toy_model_whose_counts_would_outweigh_its_gradient_sends_no_counts():
    # 4 buckets x 31 int32 + 1 = 500 bytes a step against a 136-byte gradient: not worth it
    assert run_on_ranks(_toy_worker, world_size=2) == [(0, False), (0, False)]
