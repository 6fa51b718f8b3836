"""The hook with the DDP options real jobs use: process subgroups, sparse gradients, unused
parameters (find_unused_parameters, static_graph), uneven inputs (Join), torch.compile.

Oracles: the same data trained by a job of only that subgroup; torch's allreduce_hook; an
accounting identity of gradient mass worked out from local gradients computed without DDP;
eager DDP for the compiled model.
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm
from sparsecomm import TopKState, topk_hook
from ddp_models import mlp, params, rank_data
from exact_sums import UNIT, gamma, unit_roundoff, units
from rank_processes import run_on_ranks

pytestmark = pytest.mark.timeout(240)


# ----- process subgroups -------------------------------------------------------------------


def _train_in_group(rank, group, form, rank_offset=0, steps=8):
    """Train an MLP on this rank's data (x100 for the second data-parallel group)."""
    model = mlp()
    ddp = DDP(model, process_group=group)
    if form == "ready-state":  # built without a group, then registered
        state = TopKState(density=0.05)
        sparsecomm.register_topk_hook(ddp, state)
    else:  # bound through module=, registered the plain DDP way
        state = TopKState(density=0.05, module=ddp)
        ddp.register_comm_hook(state, topk_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    data_rank = rank + rank_offset
    scale = 1.0 if data_rank < 2 else 100.0
    for x in rank_data(data_rank, steps, (8, 32)):
        optimizer.zero_grad()
        ddp(x * scale).pow(2).mean().backward()
        optimizer.step()
    return params(model), state.stats()["sparse_calls"]


def _two_groups_worker(rank, world_size):
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    return [_train_in_group(rank, groups[rank // 2], form) for form in ("ready-state", "module")]


def _one_group_worker(rank, world_size):
    """The oracle: each data-parallel group's job on its own (2 ranks, the same data)."""
    return [_train_in_group(rank, None, "ready-state", rank_offset=offset) for offset in (0, 2)]


def test_a_state_without_a_group_reduces_over_the_ddp_models_subgroup():
    four = run_on_ranks(_two_groups_worker, world_size=4, timeout=120)
    alone = run_on_ranks(_one_group_worker, timeout=120)
    for form_index, form in enumerate(("ready-state", "module")):
        by_rank = [four[r][form_index] for r in range(4)]
        assert all(calls > 0 for _, calls in by_rank)
        for group in (0, 1):
            a, b = by_rank[2 * group][0], by_rank[2 * group + 1][0]
            assert all(torch.equal(x, y) for x, y in zip(a, b)), (form, group)  # replicas within a group
            # No mixing: exactly what that group's data trains on its own.
            assert all(torch.equal(x, y) for x, y in zip(a, alone[0][group][0])), (form, group)
        assert not all(torch.equal(x, y) for x, y in zip(by_rank[0][0], by_rank[2][0])), form


# ----- sparse gradients ------------------------------------------------------------------


class _EmbeddingModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(50, 16, sparse=True)
        self.head = nn.Linear(16, 4)

    def forward(self, tokens):
        return self.head(self.embedding(tokens).mean(1))


def _sparse_gradient_worker(rank, world_size):
    tokens = torch.randint(0, 50, (6, 5), generator=torch.Generator().manual_seed(rank))
    runs = {}
    for label in ("allreduce_hook", "topk density 1", "topk density 0.05"):
        model = _EmbeddingModel()
        ddp = DDP(model)
        state = None
        if label == "allreduce_hook":
            ddp.register_comm_hook(None, allreduce_hook)
        else:
            state = sparsecomm.register_topk_hook(ddp, density=1.0 if "1" in label.split()[-1] else 0.05)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for _ in range(5):
            optimizer.zero_grad()
            ddp(tokens).pow(2).mean().backward()
            grads = [p.grad.to_dense().clone() for p in model.parameters()]
            optimizer.step()
        runs[label] = (grads, params(model), None if state is None else state.stats())
    return runs


def test_sparse_gradient_buckets_are_allreduced_like_ddps_default():
    for runs in run_on_ranks(_sparse_gradient_worker):
        reference_grads, reference_params, _ = runs["allreduce_hook"]
        grads, model_params, stats = runs["topk density 1"]
        assert all(torch.equal(a, b) for a, b in zip(grads, reference_grads))
        assert all(torch.equal(a, b) for a, b in zip(model_params, reference_params))
        assert stats["sparse_gradient_calls"] == 5
        _, _, stats = runs["topk density 0.05"]
        assert stats["sparse_gradient_calls"] == 5 and stats["sparse_calls"] == 3  # the dense layer went sparse


# ----- unused parameters: no error-feedback mass is lost --------------------------------------


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(32, 32)
        self.branch = nn.Linear(32, 32)
        self.never = nn.Linear(32, 32)  # used by no rank, ever
        self.head = nn.Linear(32, 4)

    def forward(self, x, use_branch):
        h = torch.tanh(self.trunk(x))
        if use_branch:
            h = h + self.branch(h)
        return self.head(h)


def _branch_used(step, rank):
    """Used by both ranks while its residual builds up, then by no rank, then by rank 1 only."""
    return step < 6 or (step >= 12 and rank == 1)


class _SentAndHeld:
    """This step's sent entries and new residual, by parameter name (on the dense path all
    of acc is sent and nothing is held)."""

    needs_acc = False  # keeps the fused kernel: the path under test

    def __init__(self):
        self.sent, self.held = {}, {}

    def __call__(self, event):
        if event.stage != "packed":
            return
        if event.dense:  # the warm-up holds no residual yet
            sent = event.tensors["acc"].clone()
            held = torch.zeros_like(sent) if event.tensors["residual"] is None else event.tensors["residual"].clone()
        else:
            held = event.tensors["residual"].clone()
            sent = torch.zeros_like(held).index_put_((event.tensors["indices"].long(),),
                                                     event.tensors["values"].to(held.dtype))
        numels = list(event.numels)
        for name, sent_part, held_part in zip(event.names, sent.split(numels), held.split(numels)):
            self.sent[name], self.held[name] = sent_part, held_part


def _add(total: list, values: list) -> None:
    for i, value in enumerate(values):
        total[i] += value


def _accounting_worker(rank, world_size, ddp_kwargs, steps=16):
    """Gradient mass, exactly (exact_sums: whole units of 2^-150): p x (what DDP applied + what
    every rank still holds) against the sum of every rank's local gradients, and the
    allowance the hook's float32 roundings give it. Returns ({name: entries beyond the
    allowance}, whether the branch's handed-back entries outweigh it, the hook's stats)."""
    model = _Branchy()
    ddp = DDP(model, **ddp_kwargs)
    state = sparsecomm.register_topk_hook(ddp, density=0.05)
    seen = _SentAndHeld()
    state.add_observer(seen)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.02)
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    applied, gradient, magnitude, sent_magnitude = ({n: [0] * size for n, size in sizes.items()} for _ in range(4))
    handed_back = [0] * sizes["branch.weight"]
    static = ddp_kwargs.get("static_graph", False)
    for step, x in enumerate(rank_data(rank, steps, (8, 32))):
        use_branch = True if static else _branch_used(step, rank)
        # This rank's gradient, computed without DDP from the same weights.
        local = copy.deepcopy(model)
        local.zero_grad(set_to_none=True)
        local(x, use_branch).pow(2).mean().backward()
        own = {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in local.named_parameters()}
        optimizer.zero_grad(set_to_none=True)
        ddp(x, use_branch).pow(2).mean().backward()
        for n, p in model.named_parameters():
            g, sent, held = units(own[n]), units(seen.sent[n]), units(seen.held[n])
            _add(gradient[n], g)
            _add(magnitude[n], [abs(a) + world_size * (abs(b) + abs(c)) for a, b, c in zip(g, sent, held)])
            _add(sent_magnitude[n], [abs(b) for b in sent])
            if p.grad is not None:  # DDP leaves the grad of a parameter no rank used untouched (None)
                _add(applied[n], units(p.grad))
        if not static and not any(_branch_used(step, r) for r in range(world_size)):
            handed_back = units(seen.sent["branch.weight"])  # given back to the residual next step
        optimizer.step()
    saved = state.state_dict()
    mine = {"gradient": gradient, "magnitude": magnitude, "sent": sent_magnitude,
            "held": {n: units(saved[f"rank{rank}.residual.{n}"]) for n in sizes}}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, (mine, handed_back))
    ranks = {key: {n: [sum(column) for column in zip(*(theirs[key][n] for theirs, _ in everyone))] for n in sizes}
             for key in mine}  # summed over ranks, entry by entry
    handed_back = [sum(column) for column in zip(*(theirs for _, theirs in everyone))]
    # Per step, rank r and entry, the hook's float32 arithmetic (u = 2^-24):
    # - acc_r = fl(fl(g_r / p) + res_r): the quotient is within u |g_r| / p + 2^-150 of g_r / p
    #   (2^-150, half float32's smallest subnormal: a quotient may underflow), the sum within
    #   u |acc_r| of the exact sum (|fl(x) - x| <= u |fl(x)|, Higham (2.5)), and
    #   |acc_r| <= |sent_r| + |held_r|;
    # - sent_r + held_r == acc_r exactly (the contract of csrc/README.md), and the residual
    #   left at a sent entry is 0, so giving an unused parameter's sent entries back is exact;
    # - the reduced entry is within gamma_{p-1} sum_r |sent_r| of sum_r sent_r (any order).
    # So p (applied + sum_r held_r) - sum_t sum_r g_r is p times a sum of these errors, at most
    # u sum |g_r| + p u sum (|sent_r| + |held_r|) + p gamma_{p-1} sum |sent_r| + p 2^-150 per
    # rank and step (2^-150 is one unit).
    u, gamma_p = unit_roundoff(torch.float32), gamma(world_size - 1, torch.float32)
    misses, handed_back_outweighs = {}, False
    for n, size in sizes.items():
        for i in range(size):
            error = abs(world_size * (applied[n][i] + ranks["held"][n][i]) - ranks["gradient"][n][i])
            allowance = (u * ranks["magnitude"][n][i] + world_size * gamma_p * ranks["sent"][n][i]
                         + world_size * world_size * steps)
            if error > allowance:
                misses.setdefault(n, []).append((i, float(error * UNIT), float(allowance * UNIT)))
            if n == "branch.weight":
                # Had these entries not come back, the identity would be off by them less the
                # rounding errors (at most one allowance): seen if they exceed two.
                handed_back_outweighs |= world_size * abs(handed_back[i]) > 2 * allowance
    return misses, handed_back_outweighs, state.stats()


@pytest.mark.parametrize("ddp_kwargs", [{"find_unused_parameters": True}, {"static_graph": True}],
                         ids=["find_unused_parameters", "static_graph"])
def test_no_error_feedback_mass_is_lost_to_unused_parameters(ddp_kwargs):
    for misses, handed_back_outweighs, stats in run_on_ranks(_accounting_worker, ddp_kwargs):
        assert misses == {}, {n: entries[:3] for n, entries in misses.items()}  # (entry, |error|, allowance)
        assert stats["sparse_calls"] > 0
        if "find_unused_parameters" in ddp_kwargs:
            # The branch went unused with a large residual, and its sent entries came back.
            assert stats["unused_restored"] > 0 and handed_back_outweighs


# ----- uneven inputs (Join) ----------------------------------------------------------------


def _join_worker(rank, world_size):
    data = rank_data(rank, 4 + 2 * rank, (8, 32))  # rank 1 has two more batches than rank 0
    runs = {}
    for label in ("allreduce_hook", "topk density 1", "topk density 0.05"):
        model = mlp()
        ddp = DDP(model)
        state = None
        if label == "allreduce_hook":
            ddp.register_comm_hook(None, allreduce_hook)
        elif label == "topk density 1":
            state = sparsecomm.register_topk_hook(ddp, density=1.0, allow_dense_fallback=False)
        else:
            state = sparsecomm.register_topk_hook(ddp, density=0.05)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
        with Join([ddp]):
            for x in data:
                optimizer.zero_grad()
                ddp(x).pow(2).mean().backward()
                optimizer.step()
        runs[label] = (params(model), None if state is None else state.stats())
    return runs


def test_uneven_inputs_under_join():
    per_rank = run_on_ranks(_join_worker)
    for runs in per_rank:
        # Density 1 on the sparse path is the average a joined rank's zeros give allreduce.
        assert all(torch.equal(a, b) for a, b in zip(runs["topk density 1"][0], runs["allreduce_hook"][0]))
        for label in ("topk density 1", "topk density 0.05"):
            stats = runs[label][1]
            # The joined rank ran the hook on zero buckets for the steps it sat out, so
            # both ranks count every step and stay in step (warm-up, schedule, agreement).
            assert stats["steps"] == 6 and stats["sparse_calls"] >= 4, (label, stats)
    assert all(torch.equal(a, b) for a, b in zip(per_rank[0]["topk density 0.05"][0],
                                                 per_rank[1]["topk density 0.05"][0]))


# ----- torch.compile -------------------------------------------------------------------------


def _compile_worker(rank, world_size):
    results = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        model = mlp()
        ddp = DDP(model)
        state = sparsecomm.register_topk_hook(ddp, density=0.05)
        # aot_eager: dynamo's DDP graph splitting and an AOT-traced backward without a C++
        # compile (inductor would spend minutes of CI compiling the same graphs).
        runner = torch.compile(ddp, backend="aot_eager") if compiled else ddp
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
        for x in rank_data(rank, 6, (8, 32)):
            optimizer.zero_grad()
            runner(x).pow(2).mean().backward()
            optimizer.step()
        results[compiled] = (params(model), state.stats())
    return results


def test_compiled_ddp_model_trains_like_the_eager_one():
    for results in run_on_ranks(_compile_worker, timeout=180):
        (eager, eager_stats), (compiled, compiled_stats) = results[False], results[True]
        assert compiled_stats["sparse_calls"] == eager_stats["sparse_calls"] > 0
        assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
