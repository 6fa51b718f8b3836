"""Small models and per-rank data shared by the multi-rank hook tests."""
import torch
import torch.nn as nn


def rank_data(rank, steps, shape, seed=1000):
    """Different inputs on every rank (same on a rank across runs)."""
    generator = torch.Generator().manual_seed(seed + rank)
    return [torch.randn(*shape, generator=generator) for _ in range(steps)]


def mlp(width=32, depth=3, out=4):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, out))


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def memories_finite(state) -> bool:
    """Every residual and velocity entry of a TopKState is finite."""
    return all(bool(torch.isfinite(v).all()) for k, v in state.state_dict().items()
               if isinstance(v, torch.Tensor) and (".residual." in k or ".velocity." in k))


def all_finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)
