"""Your own model and data as a task of the experiment runner: a worked example.

    sparsecomm compare --task experiments/examples/user_task.py:make_task --arms dense topk-dgc

A task is a subclass of ``sparsecomm.lab.tasks.Task``: training samples addressed by
integer id (the runner draws the ids of each global batch from a stream seeded by
(seed, step), the same in every arm, and gives rank r its slice), a model built after the
runner has seeded torch with the run's seed, a training loss and a validation loss. The
runner does everything else: pairing, per-rank shards, checkpoints, faults, the ledger.

Here a small MLP learns a fixed random "teacher" network's outputs on generated inputs (no
download): regression, so the validation loss is a mean squared error.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from sparsecomm.lab.tasks import Task

INPUTS, HIDDEN = 16, 64


class TeacherRegression(Task):
    name = "teacher-regression"

    def __init__(self, train_samples: int = 4096, val_samples: int = 512):
        # The data depend on nothing but this fixed seed: every rank and every arm sees the same set.
        generator = torch.Generator().manual_seed(1234)
        x = torch.randn(train_samples + val_samples, INPUTS, generator=generator)
        w1 = torch.randn(INPUTS, HIDDEN, generator=generator) / INPUTS**0.5
        w2 = torch.randn(HIDDEN, 1, generator=generator) / HIDDEN**0.5
        y = torch.tanh(x @ w1) @ w2 + 0.05 * torch.randn(len(x), 1, generator=generator)
        self.train_x, self.train_y = x[:train_samples], y[:train_samples]
        self.val_x, self.val_y = x[train_samples:], y[train_samples:]

    @property
    def num_train_samples(self) -> int:
        return len(self.train_x)

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(INPUTS, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 1))

    def train_batch(self, sample_ids: torch.Tensor):
        return self.train_x[sample_ids], self.train_y[sample_ids]

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(inputs), targets)

    def val_loss(self, model: nn.Module) -> float:
        with torch.no_grad():
            return F.mse_loss(model(self.val_x), self.val_y).item()


def make_task() -> Task:
    """The factory the runner calls (``--task user_task.py:make_task``)."""
    return TeacherRegression()
