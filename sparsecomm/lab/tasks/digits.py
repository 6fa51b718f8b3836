"""Handwritten digits (scikit-learn's bundled 8x8 images) and an MLP classifier.

1,797 images ship inside scikit-learn, so this task needs no download. Small enough for
tests and quick checks; the split is fixed so every run validates on the same images.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from sparsecomm.lab.tasks.base import Task

NUM_FEATURES = 64
NUM_CLASSES = 10
# Fixed split: images are shuffled once with this seed, then the last VAL_SIZE held out.
SPLIT_SEED = 1234
VAL_SIZE = 360


def make_mlp(hidden: int = 256) -> nn.Module:
    """64 -> hidden -> hidden -> 10 MLP (85k parameters at hidden=256)."""
    return nn.Sequential(
        nn.Linear(NUM_FEATURES, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, NUM_CLASSES),
    )


class DigitsMLP(Task):
    name = "digits-mlp"

    def __init__(self):
        from sklearn.datasets import load_digits

        bunch = load_digits()
        x = torch.tensor(bunch.data, dtype=torch.float32) / 16.0  # pixel values 0..16
        y = torch.tensor(bunch.target, dtype=torch.int64)
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(SPLIT_SEED))
        x, y = x[order], y[order]
        self.x_train, self.y_train = x[:-VAL_SIZE], y[:-VAL_SIZE]
        self.x_val, self.y_val = x[-VAL_SIZE:], y[-VAL_SIZE:]

    @property
    def num_train_samples(self) -> int:
        return len(self.y_train)

    def build_model(self) -> nn.Module:
        return make_mlp()

    def train_batch(self, sample_ids):
        return self.x_train[sample_ids], self.y_train[sample_ids]

    def loss(self, model, inputs, targets):
        return F.cross_entropy(model(inputs), targets)

    @torch.no_grad()
    def val_loss(self, model) -> float:
        return F.cross_entropy(model(self.x_val), self.y_val).item()
