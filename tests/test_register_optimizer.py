"""``register_topk_hook(ddp, density=..., optimizer=opt)``, the README's first example: the hook
takes over the optimizer's momentum, which makes it the lab's ``topk-dgc`` arm (the setting
that holds quality with AdamW), and a call without an optimizer is warned once on rank 0."""
import warnings

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm
from rank_processes import run_on_ranks
from sparsecomm.hooks.momentum_handover import OptimizerChangedWarning
from sparsecomm.lab.experiment.arms import make_arm_hook
from sparsecomm.lab.experiment.config import ExperimentConfig
from sparsecomm.lab.experiment.worker import make_optimizer

pytestmark = pytest.mark.timeout(120)

STEPS = 8


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32), torch.nn.GELU(),
                               torch.nn.Linear(32, 8))


def _train(ddp, optimizer, rank):
    generator = torch.Generator().manual_seed(100 + rank)  # different data on every rank
    for _ in range(STEPS):
        optimizer.zero_grad()
        x = torch.randn(16, 32, generator=generator)
        ddp(x).sub(x[:, :8]).pow(2).mean().backward()
        optimizer.step()
    return torch.cat([p.detach().flatten() for p in ddp.parameters()])


def _readme_vs_lab_worker(rank, world_size):
    # The README's lines, with the AdamW the lab's task uses (lr 3e-3, no weight decay): torch's
    # default betas (0.9, 0.999), nothing else set.
    ddp = DDP(_model(), bucket_cap_mb=0.002)  # several buckets
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=3e-3, weight_decay=0.0)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        state = sparsecomm.register_topk_hook(ddp, density=0.05, optimizer=optimizer)
    readme = _train(ddp, optimizer, rank)
    changed = [str(w.message) for w in said if issubclass(w.category, OptimizerChangedWarning)]

    # The lab's topk-dgc arm, built by the lab's own code from an experiment config.
    config = ExperimentConfig(name="t", task="digits-mlp", arms=("dense", "topk-dgc"), optimizer="adamw", lr=3e-3,
                              density=0.05, bucket_cap_mb=0.002)
    lab_ddp = DDP(_model(), bucket_cap_mb=0.002)
    arm = make_arm_hook("topk-dgc", config, lab_ddp, seed=0)
    lab_ddp.register_comm_hook(arm.state, arm.hook)
    lab = _train(lab_ddp, make_optimizer(config, lab_ddp.parameters(), "topk-dgc"), rank)
    return (torch.equal(readme, lab), changed, state.config.momentum, optimizer.param_groups[0]["betas"],
            state.stats()["sparse_calls"], state.config.budget)


def test_the_readme_example_with_adamw_trains_bit_for_bit_as_the_labs_topk_dgc_arm():
    for rank, (equal, changed, momentum, betas, sparse_calls, budget) in enumerate(
            run_on_ranks(_readme_vs_lab_worker, world_size=2)):
        assert sparse_calls > STEPS  # several buckets, sparse after the warm-up
        assert budget == "model"
        assert (momentum, betas) == (0.9, (0.0, 0.999))
        assert equal, f"rank {rank}"
        # Said once, on rank 0 only, naming the change.
        assert changed == ([] if rank else ["register_topk_hook: AdamW betas (0.9, 0.999) -> (0.0, 0.999): the hook's "
                                            "momentum correction (momentum=0.9) replaces AdamW's first moment (pass "
                                            "momentum=0 to keep the optimizer as it is)"])


def _warning_worker(rank, world_size, options):
    ddp = DDP(_model())
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        sparsecomm.register_topk_hook(ddp, density=0.05, **options)
    return [w.category.__name__ for w in said if "sparsecomm" in str(w.filename) or "register_topk_hook" in str(w.message)]


@pytest.mark.parametrize("options, warned", [
    ({}, ["MomentumMismatchWarning"]),  # plain error feedback into an unknown optimizer
    ({"momentum": 0}, []),  # the user's explicit choice
    ({"momentum": 0.9}, []),  # momentum correction set by hand
    ({"error_feedback": False}, []),  # no error feedback: no delayed gradients
], ids=["nothing", "momentum-0", "momentum-0.9", "no-error-feedback"])
def test_a_hook_without_its_optimizer_is_warned_once_on_rank_0_unless_momentum_is_chosen(options, warned):
    results = run_on_ranks(_warning_worker, options, world_size=2)
    assert results == [warned, []]


def _refusal_worker(rank, world_size):
    found = []
    try:
        sparsecomm.register_topk_hook(DDP(_model()), density=0.05, momentum="auto")
    except ValueError as error:
        found.append(str(error))
    ddp = DDP(_model())
    rmsprop = torch.optim.RMSprop(ddp.parameters(), lr=1e-3, momentum=0.9)
    try:
        sparsecomm.register_topk_hook(ddp, density=0.05, optimizer=rmsprop)
    except ValueError as error:
        found.append(str(error))
    unchanged = rmsprop.param_groups[0]["momentum"] == 0.9 and not ddp._comm_hooks
    sgd = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    state = sparsecomm.register_topk_hook(ddp, density=0.05, optimizer=sgd, momentum=0)
    return found, unchanged, state.config.momentum, sgd.param_groups[0]["momentum"]


def test_momentum_auto_needs_the_optimizer_and_a_refused_optimizer_changes_nothing():
    [(found, unchanged, hook_momentum, sgd_momentum)] = run_on_ranks(_refusal_worker, world_size=1)
    assert "momentum='auto' takes the optimizer's momentum into the hook, but no optimizer was given" in found[0]
    assert "cannot move the momentum of RMSprop" in found[1]
    assert unchanged  # refused before the optimizer or the model changed
    assert (hook_momentum, sgd_momentum) == (0.0, 0.9)  # momentum=0: the optimizer is left alone
