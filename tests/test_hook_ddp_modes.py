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
from multiprocess import run_on_ranks

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


def _accounting_worker(rank, world_size, ddp_kwargs, steps=16):
    model = _Branchy()
    ddp = DDP(model, **ddp_kwargs)
    state = sparsecomm.register_topk_hook(ddp, density=0.05)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.02)
    names = [n for n, _ in model.named_parameters()]
    applied = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in model.named_parameters()}
    mean_gradient = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in model.named_parameters()}
    static = ddp_kwargs.get("static_graph", False)
    for step, x in enumerate(rank_data(rank, steps, (8, 32))):
        use_branch = True if static else _branch_used(step, rank)
        # This rank's gradient, computed without DDP from the same weights.
        local = copy.deepcopy(model)
        local.zero_grad(set_to_none=True)
        local(x, use_branch).pow(2).mean().backward()
        for n, p in local.named_parameters():
            g = torch.zeros_like(p, dtype=torch.float64) if p.grad is None else p.grad.double()
            everyone = [torch.empty_like(g) for _ in range(world_size)]
            dist.all_gather(everyone, g)
            mean_gradient[n] += sum(everyone) / world_size
        optimizer.zero_grad(set_to_none=True)
        ddp(x, use_branch).pow(2).mean().backward()
        for n, p in model.named_parameters():
            if p.grad is not None:  # DDP leaves the grad of a parameter no rank used untouched (None)
                applied[n] += p.grad.double()
        optimizer.step()
    saved = state.state_dict()
    residuals = {}
    for n in names:
        r = saved[f"rank{rank}.residual.{n}"].double().reshape(applied[n].shape)
        everyone = [torch.empty_like(r) for _ in range(world_size)]
        dist.all_gather(everyone, r)
        residuals[n] = sum(everyone)
    # Gradient mass: what DDP applied + what every rank still holds == the sum of the mean gradients.
    errors = {n: float((applied[n] + residuals[n] - mean_gradient[n]).abs().max()) for n in names}
    scale = max(float(mean_gradient[n].abs().max()) for n in names)
    branch_held = float(residuals["branch.weight"].abs().max())
    return errors, scale, branch_held, state.stats()


@pytest.mark.parametrize("ddp_kwargs", [{"find_unused_parameters": True}, {"static_graph": True}],
                         ids=["find_unused_parameters", "static_graph"])
def test_no_error_feedback_mass_is_lost_to_unused_parameters(ddp_kwargs):
    for errors, scale, branch_held, stats in run_on_ranks(_accounting_worker, ddp_kwargs):
        worst = max(errors.values())
        assert worst <= 1e-6 * scale, f"largest accounting error {worst:.3g} (gradient scale {scale:.3g}): {errors}"
        assert stats["sparse_calls"] > 0
        if "find_unused_parameters" in ddp_kwargs:
            # The branch went unused with a large residual, and its sent entries came back.
            assert stats["unused_restored"] > 0 and branch_held > 10 * worst


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
