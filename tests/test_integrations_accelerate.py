"""register_topk_hook_accelerate with a real Accelerator: 2 gloo ranks, different data per rank.

One spawned run: the hook runs sparse on the prepared model, save_state writes one hook
file per process, a fresh Accelerator's load_state gives each rank its own residuals back
bit for bit and training goes on sparse, and the wrong inputs are refused. A second: the
defaults' momentum handover, and the hook's figures through ``accelerator.log`` to the
TensorBoard tracker.
"""
import os

import pytest
import torch

from rank_processes import run_on_ranks
from integration_checks import assert_defaults_are_topk_dgc, assert_sparse_then_restored
from metrics_checks import bytes_sent_per_step, scalars

STEPS, MORE_STEPS = 6, 2
DENSITY = 0.01


@pytest.fixture(scope="module")
def accelerate():
    return pytest.importorskip("accelerate")


def _prepared(accelerator, make_optimizer=lambda params: torch.optim.SGD(params, lr=0.1)):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    optimizer = make_optimizer(model.parameters())
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(256, 16, generator=generator)
    # Same dataset everywhere; the prepared loader hands each process a different shard.
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :4].sin()), batch_size=8)
    return (*accelerator.prepare(model, optimizer, loader), model)


def _train(accelerator, model, optimizer, loader, steps):
    batches = iter(loader)
    for _ in range(steps):
        x, y = next(batches)
        optimizer.zero_grad()
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()


def _residuals(state):
    return {k: v for k, v in state.state_dict().items() if ".residual." in k}


def _accelerate_worker(rank, world_size, root):
    # run_on_ranks already joined the gloo group; Accelerate reads these and keeps it.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    from accelerate import Accelerator
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

    from sparsecomm.integrations import register_topk_hook_accelerate

    accelerator = Accelerator(cpu=True)
    model, optimizer, loader, raw_model = _prepared(accelerator)
    state = register_topk_hook_accelerate(accelerator, model, density=DENSITY)
    _train(accelerator, model, optimizer, loader, STEPS)
    accelerator.save_state(root)
    saved, stats = _residuals(state), state.stats()
    errors = {}
    for name, call in [
        ("twice", lambda: register_topk_hook_accelerate(accelerator, model, density=DENSITY)),
        ("unprepared", lambda: register_topk_hook_accelerate(accelerator, raw_model, density=DENSITY)),
    ]:
        try:
            call()
        except (TypeError, ValueError) as error:
            errors[name] = (type(error).__name__, str(error))

    fresh = Accelerator(cpu=True)
    model, optimizer, loader, _ = _prepared(fresh)
    restored_state = register_topk_hook_accelerate(fresh, model, density=DENSITY)
    fresh.load_state(root)
    restored, restored_step = _residuals(restored_state), restored_state.step
    _train(fresh, model, optimizer, loader, MORE_STEPS)

    fp16_kwargs = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)
    fp16 = Accelerator(cpu=True, kwargs_handlers=[fp16_kwargs])
    try:
        register_topk_hook_accelerate(fp16, _prepared(fp16)[0], density=DENSITY)
    except ValueError as error:
        errors["comm_hook"] = ("ValueError", str(error))
    return dict(saved=saved, stats=stats, restored=restored, restored_step=restored_step,
                resumed_stats=restored_state.stats(), errors=errors, distributed_type=str(accelerator.distributed_type))


@pytest.mark.timeout(90)
def test_prepared_model_runs_sparse_and_load_state_restores_each_ranks_residuals(accelerate, tmp_path):
    results = run_on_ranks(_accelerate_worker, str(tmp_path), timeout=80)
    for rank, r in enumerate(results):
        assert r["distributed_type"] == "DistributedType.MULTI_CPU"
        assert_sparse_then_restored(r, rank, steps=STEPS, more_steps=MORE_STEPS, density=DENSITY)
        errors = r["errors"]
        assert errors["twice"][0] == "ValueError"
        assert "already has a communication hook (topk_hook)" in errors["twice"][1]
        assert errors["unprepared"][0] == "TypeError" and "got Sequential" in errors["unprepared"][1]
        assert "comm_hook=DDPCommunicationHookType.FP16" in errors["comm_hook"][1]
    saved0, saved1 = results[0]["saved"], results[1]["saved"]
    for key0, key1 in zip(sorted(saved0), sorted(saved1)):
        assert key0.replace("rank0.", "rank1.") == key1
        assert not torch.equal(saved0[key0], saved1[key1]), f"{key0}: ranks hold the same residual"
    # One file per process, each holding only that process's residuals.
    for rank, saved in enumerate((saved0, saved1)):
        stored = torch.load(tmp_path / f"sparsecomm_topk_0_rank{rank}.pt", weights_only=True)
        assert {k for k in stored if ".residual." in k} == saved.keys()


def _defaults_worker(rank, world_size, root):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    import warnings

    from accelerate import Accelerator

    from sparsecomm.integrations import register_topk_hook_accelerate
    from sparsecomm.hooks.momentum_handover import OptimizerChangedWarning

    def train(make_optimizer, **options):
        accelerator = Accelerator(cpu=True)
        model, optimizer, loader, _ = _prepared(accelerator, make_optimizer)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                state = register_topk_hook_accelerate(accelerator, model, density=DENSITY, **options)
            except ValueError as error:
                return dict(error=str(error), groups=[{k: v for k, v in g.items() if k != "params"}
                                                      for g in optimizer.param_groups])
        _train(accelerator, model, optimizer, loader, 4)
        return dict(params=[p.detach().clone() for p in model.parameters()], momentum=state.config.momentum,
                    betas=[g["betas"] for g in optimizer.param_groups], sparse_calls=state.stats()["sparse_calls"],
                    announced=[str(w.message) for w in caught if issubclass(w.category, OptimizerChangedWarning)])

    adamw = lambda params: torch.optim.AdamW(params, lr=1e-2)  # noqa: E731
    no_optimizer = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = no_optimizer.prepare(torch.nn.Linear(16, 4))
    try:
        register_topk_hook_accelerate(no_optimizer, model, density=DENSITY)
        no_optimizer_error = None
    except ValueError as error:
        no_optimizer_error = str(error)
    return dict(
        metrics=_metrics_run(root),
        defaults=train(adamw),
        # The topk-dgc setting built by hand: AdamW without a first moment, the hook's momentum 0.9.
        by_hand=train(lambda params: torch.optim.AdamW(params, lr=1e-2, betas=(0.0, 0.999)), momentum=0.9),
        plain_ef=train(adamw, momentum=0),
        refused=train(lambda params: torch.optim.RMSprop(params, lr=1e-2, momentum=0.9)),
        no_optimizer=no_optimizer_error,
    )


def _metrics_run(root):
    """The hook's figures every 2 steps into the accelerator's TensorBoard tracker."""
    from accelerate import Accelerator

    from sparsecomm.integrations import register_topk_hook_accelerate

    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=os.path.join(root, "tb"))
    accelerator.init_trackers("run")
    model, optimizer, loader, raw_model = _prepared(accelerator)
    state = register_topk_hook_accelerate(accelerator, model, density=DENSITY, budget="bucket", log_every=2)
    _train(accelerator, model, optimizer, loader, 6)
    for tracker in accelerator.trackers:  # (end_training() would also destroy the process group)
        tracker.finish()
    return dict(numel=sum(p.numel() for p in raw_model.parameters()), steps=state.step)


@pytest.fixture(scope="module")
def defaults_and_metrics(accelerate, tmp_path_factory):
    root = tmp_path_factory.mktemp("defaults")
    return run_on_ranks(_defaults_worker, str(root), timeout=80), root


@pytest.mark.timeout(90)
def test_defaults_move_adamws_first_moment_into_the_hook_and_say_so_on_rank_0(defaults_and_metrics):
    for rank, runs in enumerate(defaults_and_metrics[0]):
        assert_defaults_are_topk_dgc(runs, rank, "register_topk_hook_accelerate", sparse_calls=2)
        # Refused before anything changes: an optimizer whose momentum cannot move, and "auto"
        # with no prepared optimizer to take it from.
        refused = runs["refused"]
        assert "register_topk_hook_accelerate: cannot move the momentum of RMSprop" in refused["error"]
        assert refused["groups"][0]["momentum"] == 0.9
        assert "momentum='auto' takes the optimizer's momentum into the hook, but there is no optimizer" in \
            runs["no_optimizer"]


@pytest.mark.timeout(90)
def test_figures_reach_the_accelerators_trackers(defaults_and_metrics):
    results, root = defaults_and_metrics
    numel = results[0]["metrics"]["numel"]
    assert results[0]["metrics"]["steps"] == 6
    logged = scalars(root / "tb" / "run")  # the tracker's directory: project_dir / run name, main process only
    expected = [(step, pytest.approx(bytes_sent_per_step(numel, DENSITY, step - 1, step))) for step in (2, 4, 6)]
    assert logged["sparsecomm/bytes_sent_per_step"] == expected
    assert [value for _, value in logged["sparsecomm/steps"]] == [2, 4, 6]
    assert {"sparsecomm/compression", "sparsecomm/effective_density", "sparsecomm/residual_norm"} <= logged.keys()


def test_bad_arguments_are_refused(accelerate):
    from sparsecomm.integrations import register_topk_hook_accelerate

    with pytest.raises(TypeError, match="accelerator must be an accelerate.Accelerator, got str"):
        register_topk_hook_accelerate("accelerator", torch.nn.Linear(1, 1))
    from accelerate import Accelerator

    with pytest.raises(ValueError, match="log_every must be None or an integer >= 1 .* got 'auto'"):
        register_topk_hook_accelerate(Accelerator(cpu=True), torch.nn.Linear(1, 1), log_every="auto")
