"""Overflow steps and loss scaling: the hook in the loops mixed-precision training runs.

A loop that skips a step whose gradients are not finite (what ``torch.amp.GradScaler``
does, by design, in its first steps) must train with the hook as it does with plain DDP:
- the overflow reaches every rank (so every rank skips), and the hook's memories stay
  finite (an Inf - Inf = NaN kept in a residual would be selected and sent every step);
- with ``on_overflow="rollback"`` (the default) the skipped step leaves no trace: the run
  is bit for bit the run that never saw that batch, whatever made the loop skip it (an
  Inf input, or a loss scale so large that the backward mixes Inf with huge finite
  entries);
- with a ``GradScaler`` the residual follows the loss scale, so a scaled run equals the
  unscaled one bit for bit (the scale factors are powers of two: scaling is exact).
Oracles: plain DDP's skip count, and the same training without the skipped batch.
"""
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm
from ddp_models import all_finite, autocast_fp16_scaler_loop, memories_finite, mlp, params, rank_data
from rank_processes import run_on_ranks

pytestmark = pytest.mark.timeout(180)

STEPS = 40
OVERFLOW_STEP = 5


def _poison(kind, model):
    """Make this rank's next backward produce non-finite gradients; returns an undo()."""
    if kind == "nan-everywhere":  # an Inf input: NaN/Inf in almost every gradient entry
        return None
    # One Inf or NaN entry only (k is far larger than 1): it must still reach every rank.
    value = torch.tensor(float("inf") if kind == "one-inf" else float("nan"))
    first = next(model.parameters())
    handle = first.register_hook(lambda g: g.index_put((torch.tensor([0]), torch.tensor([0])), value))
    return handle.remove


def _skip_loop(rank, hook_kwargs, kind, steps=STEPS, overflow_step=OVERFLOW_STEP, drop_batch=None):
    """The issue's loop: plain SGD, skip any step whose gradients are not all finite."""
    model = mlp()
    ddp = DDP(model)
    state = sparsecomm.register_topk_hook(ddp, **hook_kwargs) if hook_kwargs is not None else None
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    data = rank_data(rank, steps, (8, 32))
    evaluation = rank_data(0, 1, (64, 32), seed=7)[0]
    skipped, losses = 0, []
    for step, x in enumerate(data):
        if step == drop_batch:
            continue
        undo = None
        if step == overflow_step and rank == 0:
            if kind == "nan-everywhere":
                x = x.clone()
                x[0, 0] = float("inf")
            else:
                undo = _poison(kind, model)
        optimizer.zero_grad()
        ddp(x).pow(2).mean().backward()
        if undo is not None:
            undo()
        if not all_finite(p.grad for p in model.parameters()):
            skipped += 1
            continue
        optimizer.step()
        with torch.no_grad():
            losses.append(float(model(evaluation).pow(2).mean()))
    finite = memories_finite(state) if state is not None else True
    return skipped, losses, finite, params(model), None if state is None else state.stats()


def _skip_loop_worker(rank, world_size, runs):
    """Several runs in one process group (a spawn costs more than a run): each is
    (hook kwargs or None for plain DDP, kind, drop_batch, overflow_step)."""
    return [_skip_loop(rank, hook_kwargs, kind, drop_batch=drop_batch, overflow_step=overflow_step)
            for hook_kwargs, kind, drop_batch, overflow_step in runs]


HOOKS = {
    "exact": {"density": 0.05},
    "sampled": {"density": 0.05, "selector": "sampled"},
    "random": {"density": 0.05, "selector": "random"},
    "momentum": {"density": 0.05, "momentum": 0.9},
    "parameter-scope": {"density": 0.05, "k_scope": "parameter", "verify_conservation": True},
}
ROLLBACK_HOOKS = ["exact", "momentum", "random", "sampled"]


@pytest.mark.parametrize("kind", ["nan-everywhere", "one-inf", "one-nan"])
def test_overflow_step_is_skipped_once_and_memories_stay_finite(kind):
    names = sorted(HOOKS)
    runs = [(None, kind, None, OVERFLOW_STEP)] + [(HOOKS[name], kind, None, OVERFLOW_STEP) for name in names]
    per_rank = run_on_ranks(_skip_loop_worker, runs, timeout=150)
    plain_skipped, plain_losses = per_rank[0][0][:2]
    assert plain_skipped == 1 and plain_losses[-1] < plain_losses[0]
    for i, name in enumerate(names, start=1):
        for rank_results in per_rank:
            skipped, losses, finite, _, stats = rank_results[i]
            # Every rank saw the overflow (the Inf/NaN was sent, not hidden) and skipped
            # it, like plain DDP; the memories stayed finite, so no later step overflows.
            assert skipped == plain_skipped, f"{name}: {skipped} steps skipped; plain DDP skips 1"
            assert finite, name
            assert len(losses) == STEPS - 1 and all_finite(torch.tensor(losses)), name
            assert losses[-1] < 0.8 * losses[0], name
            assert stats["sparse_calls"] > 0, name
        assert all(torch.equal(a, b) for a, b in zip(per_rank[0][i][3], per_rank[1][i][3])), name  # replicas


@pytest.mark.parametrize("kind", ["nan-everywhere", "one-inf"])
def test_rollback_makes_a_skipped_step_leave_no_trace(kind):
    runs = []
    for name in ROLLBACK_HOOKS:
        kwargs = {**HOOKS[name], "on_overflow": "rollback"}
        runs += [(kwargs, kind, None, OVERFLOW_STEP), (kwargs, kind, OVERFLOW_STEP, -1)]  # skipped / batch dropped
    drop = {**HOOKS["exact"], "on_overflow": "drop"}
    runs += [(drop, kind, None, OVERFLOW_STEP), (drop, kind, OVERFLOW_STEP, -1)]
    for rank_results in run_on_ranks(_skip_loop_worker, runs, timeout=150):
        for i, name in enumerate(ROLLBACK_HOOKS):
            (skipped, _, finite, with_skip, stats), (none_skipped, _, _, without, _) = rank_results[2 * i : 2 * i + 2]
            assert (skipped, none_skipped) == (1, 0) and finite, name
            assert stats["skipped_steps"] == 1, name
            # As with plain DDP the skipped step changed nothing, so the rest of the run
            # is the run without that batch, bit for bit (step counter included: same
            # warm-up, same random-k indices; the sampled selector's stream included).
            assert all(torch.equal(a, b) for a, b in zip(with_skip, without)), name
        # The opt-out ("drop") keeps the finite part of the overflowing step, so there the
        # runs differ: the comparison above can fail.
        dropped, never_seen = rank_results[-2][3], rank_results[-1][3]
        assert not all(torch.equal(a, b) for a, b in zip(dropped, never_seen))


# ----- a loss scale too large: Inf and huge finite entries in one backward -----------------

SCALED_LOSS_STEP = 5  # after the 2 dense warm-up steps and a few sparse ones
LOSS_SCALE = 3e38  # near float32's largest: the gradient overflows where it is above ~1.1
SCALED_LOSS_HOOKS = {
    "exact": {"density": 0.05},
    "momentum correction": {"density": 0.05, "momentum": 0.9},
    "owner": {"density": 0.05, "exchange": "owner"},
    "shared-index": {"density": 0.05, "exchange": "shared-index"},
    "chunk rice+int4": {"density": 0.05, "selector": "chunk", "chunk_size": 256, "index_codec": "rice",
                        "value_codec": "int4"},
}


def _relu_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 4))


def _scaled_loss_loop(rank, hook_kwargs, optimizer_name, drop_batch, steps=16):
    """The hardening loop: every rank scales one step's loss by LOSS_SCALE (a loss scale that
    is too large), and the loop skips any step whose gradients are not all finite. With
    inputs of scale 20 that backward holds Inf in some entries and finite ones up to ~1e38
    in the others, in every bucket (4 buckets here)."""
    model = _relu_mlp()
    ddp = DDP(model, bucket_cap_mb=0.01)
    state = sparsecomm.register_topk_hook(ddp, **hook_kwargs) if hook_kwargs is not None else None
    if optimizer_name == "sgd":
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    else:  # AdamW; with momentum correction its first moment is off (the hook's velocity replaces it)
        beta1 = 0.0 if hook_kwargs and hook_kwargs.get("momentum") else 0.9
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3, betas=(beta1, 0.999))
    inputs, targets = rank_data(rank, steps, (8, 32)), rank_data(rank, steps, (8, 4), seed=5)
    skipped = 0
    for step, (x, y) in enumerate(zip(inputs, targets)):
        if step == drop_batch:
            continue
        optimizer.zero_grad()
        loss = (ddp(20 * x) - y).pow(2).mean()
        if step == SCALED_LOSS_STEP:
            loss = loss * LOSS_SCALE
        loss.backward()
        if not all_finite(p.grad for p in model.parameters()):
            skipped += 1
            continue
        optimizer.step()
    memories = None if state is None else {k: v for k, v in state.state_dict().items() if isinstance(v, torch.Tensor)}
    return skipped, params(model), memories, None if state is None else state.stats()["skipped_steps"]


def _scaled_loss_worker(rank, world_size, optimizer_name):
    plain = _scaled_loss_loop(rank, None, optimizer_name, None)
    runs = {name: (_scaled_loss_loop(rank, kwargs, optimizer_name, None),
                   _scaled_loss_loop(rank, kwargs, optimizer_name, SCALED_LOSS_STEP))
            for name, kwargs in SCALED_LOSS_HOOKS.items()}
    return plain, runs


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("optimizer_name", ["sgd", "adamw"])
def test_a_too_large_loss_scale_is_skipped_like_plain_ddp_and_leaves_no_trace(world_size, optimizer_name):
    for plain, runs in run_on_ranks(_scaled_loss_worker, optimizer_name, world_size=world_size, timeout=150):
        assert plain[0] == 1  # plain DDP skips the one step and trains on
        for name, ((skipped, with_skip, memories, undone), (none_skipped, without, memories_without, _)) in runs.items():
            # With the defaults the hook skips what plain DDP skips: the huge finite entries of
            # the overflowing step were undone with it, not sent again step after step.
            assert (skipped, undone, none_skipped) == (1, 1, 0), (name, skipped)
            # ... and the rest of the run is the run that never saw that batch, bit for bit:
            # weights, and every memory (residuals, velocities, owner residuals).
            assert all(torch.equal(a, b) for a, b in zip(with_skip, without)), name
            assert memories.keys() == memories_without.keys(), name
            assert all(torch.equal(memories[key], memories_without[key]) for key in memories), (name, [
                key for key in memories if not torch.equal(memories[key], memories_without[key])])


# ----- GradScaler -----------------------------------------------------------------------


def _scaler_worker(rank, world_size, scaled, drop_batch, hook_kwargs):
    """fp32 model; with ``scaled`` a GradScaler whose scale doubles every 2 clean steps and
    halves at the overflow injected on rank 1 at OVERFLOW_STEP."""
    model = mlp()
    ddp = DDP(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2) if scaled else None
    state = sparsecomm.register_topk_hook(ddp, density=0.05, grad_scaler=scaler, **hook_kwargs)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    scales = []
    for step, x in enumerate(rank_data(rank, 20, (8, 32))):
        if step == drop_batch:
            continue
        if scaled and step == OVERFLOW_STEP and rank == 1:
            x = x.clone()
            x[0, 0] = float("inf")
        optimizer.zero_grad()
        loss = ddp(x).pow(2).mean()
        if scaled:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
        else:
            loss.backward()
            optimizer.step()
    return params(model), scales, state.stats(), memories_finite(state)


def _scaler_runs_worker(rank, world_size):
    return [(_scaler_worker(rank, world_size, True, None, kwargs), _scaler_worker(rank, world_size, False,
                                                                                 OVERFLOW_STEP, kwargs))
            for kwargs in ({}, {"momentum": 0.9})]


def test_grad_scaler_run_equals_the_unscaled_run_bit_for_bit():
    for rank_results in run_on_ranks(_scaler_runs_worker):
        for label, (scaled, unscaled) in zip(("ef", "momentum correction"), rank_results):
            scaled_params, scales, stats, finite = scaled
            # The scale went up (growth) and down (the overflow): the residual had to
            # follow both, or the unscaled updates would be off by the factor.
            assert max(scales) > 2.0**8 and any(b < a for a, b in zip(scales, scales[1:])), label
            assert stats["skipped_steps"] == 1 and finite, label
            assert all(torch.equal(a, b) for a, b in zip(scaled_params, unscaled[0])), label


def _autocast_fp16_worker(rank, world_size, use_hook):
    """The recipe: fp16 autocast + GradScaler (its first steps overflow by design)."""
    model = mlp(width=64)
    ddp = DDP(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    state = sparsecomm.register_topk_hook(ddp, density=0.05, grad_scaler=scaler) if use_hook else None
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    evaluation = rank_data(0, 1, (64, 64), seed=7)[0]
    skipped, losses = 0, []
    for x in rank_data(rank, 30, (16, 64)):
        skipped += autocast_fp16_scaler_loop(ddp, optimizer, scaler, [x], "cpu")
        with torch.no_grad():
            losses.append(float(model(evaluation).pow(2).mean()))
    stats = None if state is None else state.stats()
    return skipped, losses, stats, memories_finite(state) if state else True, params(model)


def _autocast_both_worker(rank, world_size):
    return _autocast_fp16_worker(rank, world_size, False), _autocast_fp16_worker(rank, world_size, True)


def test_fp16_autocast_with_grad_scaler_recipe():
    plain, hooked = zip(*run_on_ranks(_autocast_both_worker))
    plain_skipped = plain[0][0]
    assert plain_skipped >= 3  # 2^24 overflows fp16 for several halvings
    for skipped, losses, stats, finite, _ in hooked:
        assert skipped == plain_skipped  # the same overflows: the hook hides none and adds none
        assert stats["skipped_steps"] == skipped and stats["sparse_calls"] > 0 and finite
        assert losses[-1] < 0.8 * losses[skipped]
    assert all(torch.equal(a, b) for a, b in zip(hooked[0][4], hooked[1][4]))


# ----- skip_step() and reset_residuals() ----------------------------------------------------


def _skip_step_worker(rank, world_size, skip_at, drop_batch):
    model = mlp()
    ddp = DDP(model)
    state = sparsecomm.register_topk_hook(ddp, density=0.05)  # on_overflow="rollback" is the default
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step, x in enumerate(rank_data(rank, 12, (8, 32))):
        if step == drop_batch:
            continue
        optimizer.zero_grad()
        ddp(x).pow(2).mean().backward()
        if step == skip_at:  # the loop's own guard rejected this step
            state.skip_step()
            continue
        optimizer.step()
    errors = []
    opted_out = sparsecomm.register_topk_hook(DDP(mlp()), density=0.05, on_overflow="drop")
    try:
        opted_out.skip_step()
    except ValueError as error:
        errors.append(str(error))
    state.reset_residuals()
    return params(model), state.stats()["skipped_steps"], errors, state.state_dict()


def _skip_step_both_worker(rank, world_size):
    return _skip_step_worker(rank, world_size, 6, None), _skip_step_worker(rank, world_size, None, 6)


def test_skip_step_undoes_a_step_the_loop_rejected():
    skipped, never_seen = zip(*run_on_ranks(_skip_step_both_worker))
    for (with_skip, count, errors, after_reset), (without, _, _, _) in zip(skipped, never_seen):
        assert count == 1
        assert all(torch.equal(a, b) for a, b in zip(with_skip, without))
        assert "on_overflow='rollback'" in errors[0] and "'drop'" in errors[0]
        residuals = [v for k, v in after_reset.items() if ".residual." in k]
        assert residuals and all(not v.any() for v in residuals)
