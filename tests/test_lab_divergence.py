"""A run whose replicas diverge is a measured result, not a failed run.

The local-steps averager refuses, on every rank alike, a sync that would spread non-finite
weights (``sparsecomm.averaging.NonFiniteSyncError``). In the lab's training loop that
means the arm diverged: the run ends there with a non-finite final validation loss (its
verdict is then inconclusive, as for any other arm that diverges) and says why.
"""
import math
import time

import pytest
import torch

from rank_processes import run_on_ranks
from sparsecomm.lab.experiment.named import digits_quick
from sparsecomm.lab.experiment.worker import train_run

pytestmark = pytest.mark.timeout(120)

# SGD at lr 1e6 on the digits MLP: the local weights overflow within a few steps.
CONFIG = digits_quick().with_overrides(
    arms=("dense", "local-delta"), seeds=(0,), steps=20, eval_every=10, lr=1e6, momentum=0.0,
    arm_definitions={"local-delta": {"reducer": "sparse-delta", "options": {"period": 2}}})


def _diverging_run(rank, world_size):
    torch.set_num_threads(1)
    return train_run(CONFIG, "local-delta", 0, None, time.time())


def test_an_averager_that_refuses_a_non_finite_sync_ends_the_run_as_diverged():
    for summary in run_on_ranks(_diverging_run):
        assert summary["status"] == "ok"
        assert "not finite" in summary["diverged"] or "non-finite" in summary["diverged"], summary["diverged"]
        last_step, _, final_loss = summary["evals"][-1]
        assert math.isnan(final_loss) and last_step < CONFIG.steps  # it stopped where it diverged
