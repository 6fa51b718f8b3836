"""Handwritten digits (scikit-learn's bundled 8x8 images) and an MLP classifier.

1,797 images ship inside scikit-learn, so this task needs no download. Small enough for
tests and quick checks; the split is fixed so every run validates on the same images.
Every rank of every run loads them: the file is read as ``load_digits`` reads it, without
importing scikit-learn (whose import, scipy's included, takes seconds of CPU per process).
"""
import gzip
import importlib.util
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from sparsecomm.lab.tasks.base import Task

NUM_FEATURES = 64
NUM_CLASSES = 10
# Fixed split: images are shuffled once with this seed, then the last VAL_SIZE held out.
SPLIT_SEED = 1234
VAL_SIZE = 360


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(pixels, labels) of scikit-learn's digits, as ``load_digits()`` gives ``data`` and
    ``target``: its file ``sklearn/datasets/data/digits.csv.gz`` read as it reads it (rows of
    64 pixel values 0..16 and the label), found without importing scikit-learn; through
    ``load_digits`` itself where the file is not there."""
    spec = importlib.util.find_spec("sklearn")  # finds the package; runs none of it
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if path is None or not path.is_file():
        from sklearn.datasets import load_digits

        bunch = load_digits()
        return bunch.data, bunch.target
    with gzip.open(path, mode="rt", encoding="utf-8") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1], data[:, -1].astype(int, copy=False)


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
        pixels, labels = digits_arrays()
        x = torch.tensor(pixels, dtype=torch.float32) / 16.0  # pixel values 0..16
        y = torch.tensor(labels, dtype=torch.int64)
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
