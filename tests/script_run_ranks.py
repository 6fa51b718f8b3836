"""Rank functions for tests/rank_processes.py's run_on_ranks that drive sparsecomm.lab.experiment.script_run
directly (a run's script, minus the launch)."""
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from sparsecomm.lab.experiment.config import ExperimentConfig
from sparsecomm.lab.experiment.script_run import Run


def finish_without_the_metric(rank: int, world_size: int, script: str, run_dir: str):
    """A run of ``script`` that applies the arm and takes 3 optimizer steps, then calls
    ``run.finish()`` without ever logging the metric: (exception type, message, steps taken),
    or None when finish() did not raise."""
    config = ExperimentConfig(name="s", script=script, arms=("dense",), seeds=(0,), steps=3, world_size=world_size)
    run = Run(arm="dense", seed=0, config=config, run_dir=Path(run_dir), config_hash=config.run_hash("dense", 0))
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 2))
    optimizer = run.apply(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(3):
        model(torch.randn(8, 4) + rank).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    try:
        run.finish()
    except RuntimeError as error:
        return type(error).__name__, str(error), run.steps_taken
    return None
