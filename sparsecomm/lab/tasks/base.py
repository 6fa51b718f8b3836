"""What the experiment runner needs from a task: a model, training samples, a validation loss."""
from abc import ABC, abstractmethod

import torch
import torch.nn as nn


class Task(ABC):
    """A model and its data. Training samples are addressed by integer id, so a global
    batch is a list of ids: the runner draws ids from a seeded stream (identical in every
    arm) and each rank takes its own slice."""

    name: str

    @property
    @abstractmethod
    def num_train_samples(self) -> int:
        """Ids of training samples are ``0 .. num_train_samples - 1``."""

    @abstractmethod
    def build_model(self) -> nn.Module:
        """A freshly initialised model (the caller seeds the RNG first)."""

    @abstractmethod
    def train_batch(self, sample_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of the given samples."""

    @abstractmethod
    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Scalar training loss of ``model`` (possibly DDP-wrapped) on a batch."""

    @abstractmethod
    def val_loss(self, model: nn.Module) -> float:
        """Loss on the task's fixed validation set."""
