"""Byte-level language modelling of Python's reference docs with a small GPT.

A training sample is a window of ``context + 1`` bytes starting at the sample id; the
model predicts each next byte. Validation uses a fixed set of windows spread evenly over
the held-out 10% of the text, so every run is scored on the same bytes.
"""
import torch

from sparsecomm.lab.tasks.base import Task
from sparsecomm.lab.tasks.pydoc_text import load_pydoc_bytes
from sparsecomm.lab.tasks.tiny_gpt import GPTConfig, TinyGPT

NUM_VAL_WINDOWS = 64


class PydocGPT(Task):
    name = "pydoc-gpt"

    def __init__(self, model_config: GPTConfig = GPTConfig(num_layers=2, width=96)):
        self.model_config = model_config
        self.train_bytes, val_bytes = load_pydoc_bytes()
        span = model_config.context + 1
        starts = torch.linspace(0, len(val_bytes) - span, NUM_VAL_WINDOWS).long()
        self.val_windows = torch.stack([val_bytes[s : s + span] for s in starts.tolist()]).long()

    @property
    def num_train_samples(self) -> int:
        return len(self.train_bytes) - self.model_config.context

    def build_model(self):
        return TinyGPT(self.model_config)

    def train_batch(self, sample_ids):
        offsets = torch.arange(self.model_config.context + 1)
        windows = self.train_bytes[sample_ids[:, None] + offsets].long()  # (B, context + 1)
        return windows[:, :-1], windows[:, 1:]

    def loss(self, model, inputs, targets):
        logits = model(inputs)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    @torch.no_grad()
    def val_loss(self, model) -> float:
        return self.loss(model, self.val_windows[:, :-1], self.val_windows[:, 1:]).item()
