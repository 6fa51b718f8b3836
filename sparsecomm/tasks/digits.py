"""Handwritten digits (scikit-learn's bundled 8x8 images) and an MLP classifier.

1,797 images ship inside scikit-learn, so this task needs no download. Small enough for
tests and the quick demo; the split is fixed so every run validates on the same images.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn

NUM_FEATURES = 64
NUM_CLASSES = 10
# Fixed split: images are shuffled once with this seed, then the last VAL_SIZE held out.
SPLIT_SEED = 1234
VAL_SIZE = 360


@dataclass(frozen=True)
class DigitsData:
    x_train: torch.Tensor  # (N, 64) float32 in [0, 1]
    y_train: torch.Tensor  # (N,) int64
    x_val: torch.Tensor
    y_val: torch.Tensor


def load_digits_data() -> DigitsData:
    """The bundled digits, pixel values scaled to [0, 1], split into train and validation."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.tensor(bunch.data, dtype=torch.float32) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(SPLIT_SEED))
    x, y = x[order], y[order]
    return DigitsData(x[:-VAL_SIZE], y[:-VAL_SIZE], x[-VAL_SIZE:], y[-VAL_SIZE:])


def make_mlp(hidden: int = 256) -> nn.Module:
    """64 -> hidden -> hidden -> 10 MLP (85k parameters at hidden=256)."""
    return nn.Sequential(
        nn.Linear(NUM_FEATURES, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, NUM_CLASSES),
    )
