"""Convergence on a small real task: top-k 1% with error feedback vs dense vs no feedback.

Digits MLP (scikit-learn's bundled images), 2 gloo ranks, 500 SGD steps (momentum 0.9 in
the optimizer), 2 seeds, through the experiment runner's own training loop. Deterministic
on CPU, so the numbers reproduce; they are printed on failure. Measured when written
(final validation loss; seeds 0/1, then 2/3/4, which the test does not run):

    steps 500  dense      0.0693 0.0775 | 0.1060 0.1157 0.1007
               topk-ef    0.0513 0.0484 | 0.0436 0.0574 0.0566
               topk-noef  0.1340 0.1736 | 0.1525 0.1656 0.1907

At 500 steps error feedback has caught up with dense on every one of the five seeds (at
450 it was still 0.028 behind on seed 2, 0.1056 against 0.0779: at the tolerance's edge);
without feedback the run stays 0.08 to 0.13 behind it on each of them. 600 steps and 3
seeds, as this test ran before, gave the same picture at 1.8x the cost.
"""
import time

import pytest
import torch

from rank_processes import run_on_ranks
from sparsecomm.lab.experiment.named import digits_quick
from sparsecomm.lab.experiment.worker import train_run

pytestmark = pytest.mark.timeout(300)

ARMS = ("dense", "topk-ef", "topk-noef")
SEEDS = (0, 1)
CONFIG = digits_quick().with_overrides(arms=ARMS, seeds=SEEDS, steps=500, eval_every=500, density=0.01)
# Dense's own seed-to-seed range of the final validation loss is ~0.02 at 600 steps (~0.04
# at 500); a sparse run within 0.03 of its paired dense run counts as reaching dense's loss.
TOLERANCE = 0.03
# Dropping the unsent gradient must cost clearly more than seed noise: at least the same
# 0.03 in mean final validation loss.
MIN_NOEF_GAP = 0.03


def _all_runs_worker(rank, world_size):
    torch.set_num_threads(1)
    return {
        (arm, seed): train_run(CONFIG, arm, seed, None, time.time())["evals"][-1][2]
        for seed in SEEDS
        for arm in ARMS
    }


def test_topk_with_error_feedback_reaches_dense_loss_and_without_does_not():
    finals, finals_rank1 = run_on_ranks(_all_runs_worker, timeout=280)
    assert finals == finals_rank1  # both ranks evaluate the same replicated model
    table = "\n".join(f"{arm:<10} " + " ".join(f"{finals[(arm, s)]:.4f}" for s in SEEDS) for arm in ARMS)
    for seed in SEEDS:
        assert finals[("topk-ef", seed)] <= finals[("dense", seed)] + TOLERANCE, table
    mean = {arm: sum(finals[(arm, s)] for s in SEEDS) / len(SEEDS) for arm in ARMS}
    assert mean["topk-noef"] - mean["topk-ef"] >= MIN_NOEF_GAP, table
    print("\nfinal validation loss per seed:\n" + table)
