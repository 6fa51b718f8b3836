"""The topk-dgc arm: momentum correction in the hook, no momentum in its optimizer."""
import dataclasses

import pytest
import torch

from sparsecomm.lab.experiment.arms import make_arm_hook
from sparsecomm.lab.experiment.config import ExperimentConfig
from sparsecomm.lab.experiment.named import pydoc_gpt
from sparsecomm.lab.experiment.worker import make_optimizer


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_topk_dgc_moves_momentum_from_the_optimizer_into_the_hook(optimizer):
    config = dataclasses.replace(pydoc_gpt(), optimizer=optimizer, dgc_momentum=0.8)
    model = torch.nn.Linear(4, 2)
    arm = make_arm_hook("topk-dgc", config, model, seed=0)
    assert arm.state.momentum == 0.8 and arm.state.error_feedback
    dgc, plain = make_optimizer(config, model.parameters(), "topk-dgc"), make_optimizer(config, model.parameters())
    assert not arm.state.check_optimizer(dgc)  # no double momentum
    if optimizer == "adamw":
        assert dgc.param_groups[0]["betas"] == (0.0, 0.999) and plain.param_groups[0]["betas"][0] == 0.9
    else:
        assert dgc.param_groups[0]["momentum"] == 0.0 and plain.param_groups[0]["momentum"] == config.momentum
    assert make_arm_hook("topk-ef", config, model, seed=0).state.momentum == 0.0


def test_default_experiment_has_the_topk_dgc_arm_and_checks_its_momentum():
    assert "topk-dgc" in pydoc_gpt().arms
    with pytest.raises(ValueError, match=r"dgc_momentum.*in \(0, 1\)"):
        ExperimentConfig(name="x", task="digits-mlp", dgc_momentum=1.0)


def _powersgd_worker(rank, world_size, bucket_cap_mb):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    ddp = DDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)), bucket_cap_mb=bucket_cap_mb)
    arm = make_arm_hook("powersgd", pydoc_gpt(), ddp, seed=0)
    ddp.register_comm_hook(arm.state, arm.hook)
    try:
        for step in range(4):
            ddp(torch.randn(8, 64) + rank).pow(2).mean().backward()
    except RuntimeError as error:
        return f"step {step}: {error}"
    return "trained"


def test_powersgd_on_gloo_refuses_a_second_bucket_instead_of_hanging():
    from rank_processes import run_on_ranks

    for said in run_on_ranks(_powersgd_worker, 1e-6, world_size=2):  # one bucket per parameter
        # DDP's first step has one bucket (its first bucket is 1 MB), the rebuilt layout several: refused
        # there, before PowerSGD's first compressed step (after the default experiment's 2 warm-up steps)
        assert said.startswith("step 1:") and "can hang" in said and "bucket_cap_mb" in said
    assert run_on_ranks(_powersgd_worker, 25.0, world_size=2) == ["trained", "trained"]  # one bucket: as before
