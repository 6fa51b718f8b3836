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
