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


def backward_error(ddp, x) -> str:
    """The message of the error the hook raised in this backward ('' if none)."""
    try:
        ddp(x).float().pow(2).mean().backward()
    except Exception as error:  # DDP re-raises the hook's error from backward()
        return str(error)
    return ""


def autocast_fp16_scaler_loop(ddp, optimizer, scaler, batches, device_type: str) -> int:
    """fp16 autocast + GradScaler steps over ``batches``; returns how many the scaler skipped."""
    skipped = 0
    for x in batches:
        optimizer.zero_grad()
        with torch.autocast(device_type, dtype=torch.float16):
            loss = ddp(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        skipped += scaler.get_scale() < before
    return skipped


def fit_doubling(ddp, rank, steps, width, lr=0.05):
    """SGD on this rank's own inputs toward 2 x their first 4 features; the trained parameters."""
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr)
    for x in rank_data(rank, steps, (16, width)):
        loss = torch.nn.functional.mse_loss(ddp(x), 2 * x[:, :4])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return [p.detach().clone() for p in ddp.parameters()]


def fit_sine(ddp, rank, steps, width, lr=0.05, target=torch.sin, batch=8):
    """SGD on this rank's own inputs toward target(their first 4 features); the flat
    parameters after every step (replicas must agree on each)."""
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr)
    digests = []
    for x in rank_data(rank, steps, (batch, width)):
        loss = torch.nn.functional.mse_loss(ddp(x), target(x[:, :4]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        digests.append(torch.cat([p.detach().flatten() for p in ddp.parameters()]))
    return digests


def final_parameters(rank, world_size, hook_settings, steps=4, width=16):
    """A small mlp trained (fit_sine, lr 0.1 toward cos) under DDP with the top-k hook built
    from ``hook_settings``, or with torch's ``allreduce_hook`` when None; its flat parameters."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    import sparsecomm

    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(mlp(width=width, depth=2), bucket_cap_mb=0.001)
    if hook_settings is None:
        ddp.register_comm_hook(None, allreduce_hook)
    else:
        sparsecomm.register_topk_hook(ddp, **hook_settings)
    return fit_sine(ddp, rank, steps, width, lr=0.1, target=torch.cos)[-1]


def first_sparse_step_bytes(rank, world_size, hook_settings):
    """(bytes sent, bytes received) by this rank in the first sparse step (step 2, after the
    two dense warm-up steps) of one 100 x 100 linear layer, one bucket of 10000 entries,
    under the top-k hook built from ``hook_settings``."""
    import sparsecomm

    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(nn.Linear(100, 100, bias=False), bucket_cap_mb=25)
    state = sparsecomm.register_topk_hook(ddp, **hook_settings)
    for x in rank_data(rank, 3, (4, 100)):
        ddp(x).square().sum().backward()
    last = state.stats()["last_step"]
    return last["bytes_sent"], last["bytes_received"]
