"""The quick demo: a real DDP job trained densely, with top-k + error feedback, and without.

Each arm is a 2-rank gloo job (launched with torch's elastic launcher, as torchrun does)
training an MLP on scikit-learn's bundled digits. Arms share the seed, the initial
weights and the data order; each rank reads a different slice of every global batch.
Prints the loss and how many bytes each rank sent per step compared with dense.

    sparsecomm demo                  # defaults below
    sparsecomm demo --density 0.001 --steps 400
"""
import argparse
import math
import os
import time
import uuid
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from sparsecomm.hooks import register_topk_hook
from sparsecomm.tasks.digits import load_digits_data, make_mlp


@dataclass(frozen=True)
class Arm:
    """One way of reducing gradients."""

    name: str
    density: float | None = None  # None: DDP's own dense allreduce, no hook
    error_feedback: bool = True
    # DGC momentum correction: the hook owns SGD momentum. Off by default: on this task it
    # ended 2x above plain error feedback with the optimizer's momentum (3 seeds, 600 steps).
    momentum_correction: bool = False


@dataclass(frozen=True)
class DemoConfig:
    steps: int = 600
    """Optimizer steps per arm."""
    batch_size: int = 32
    """Samples per rank per step."""
    lr: float = 0.05
    momentum: float = 0.9
    """SGD momentum (in the optimizer; in the hook for arms with momentum_correction)."""
    density: float = 0.01
    """Fraction of each gradient bucket the top-k arms send."""
    seed: int = 0
    eval_every: int = 100
    world_size: int = 2
    bucket_cap_mb: float = 0.1
    """Small buckets so the hook sees several per step, as in a large model."""


def default_arms(density: float) -> list[Arm]:
    return [
        Arm("dense"),
        Arm("topk-ef", density=density, error_feedback=True),
        Arm("topk-noef", density=density, error_feedback=False),
    ]


def _global_batch_indices(cfg: DemoConfig, num_train: int):
    """The same sequence of global batches for every arm and rank (paired runs)."""
    generator = torch.Generator().manual_seed(cfg.seed)
    for _ in range(cfg.steps):
        yield torch.randint(num_train, (cfg.world_size * cfg.batch_size,), generator=generator)


def train(rank: int, world_size: int, arm: Arm, cfg: DemoConfig) -> dict:
    """Train one arm on an initialised process group; returns losses and hook stats."""
    torch.manual_seed(cfg.seed)  # identical initial weights in every arm
    data = load_digits_data()
    model = make_mlp()
    ddp = DDP(model, bucket_cap_mb=cfg.bucket_cap_mb)
    state = None
    optimizer_momentum = cfg.momentum
    if arm.density is not None:
        hook_momentum = cfg.momentum if arm.error_feedback and arm.momentum_correction else 0.0
        optimizer_momentum = cfg.momentum - hook_momentum
        state = register_topk_hook(
            ddp,
            density=arm.density,
            error_feedback=arm.error_feedback,
            momentum=hook_momentum,
            warmup_steps=2,
            seed=cfg.seed,
        )
    optimizer = torch.optim.SGD(ddp.parameters(), lr=cfg.lr, momentum=optimizer_momentum)
    train_losses, evals = [], []
    started = time.perf_counter()
    for step, global_indices in enumerate(_global_batch_indices(cfg, len(data.y_train)), start=1):
        mine = global_indices[rank * cfg.batch_size : (rank + 1) * cfg.batch_size]
        loss = F.cross_entropy(ddp(data.x_train[mine]), data.y_train[mine])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        train_losses.append(mean_loss.item() / world_size)
        if step % cfg.eval_every == 0 or step == cfg.steps:
            evals.append((step, *_evaluate(model, data)))
            if rank == 0:
                print(f"[{arm.name}] step {step:5d}  train loss {train_losses[-1]:.4f}  "
                      f"val loss {evals[-1][1]:.4f}  val acc {evals[-1][2]:.3f}", flush=True)
    seconds = time.perf_counter() - started
    dense_bytes_per_step = sum(p.numel() * p.element_size() for p in model.parameters())
    stats = state.stats() if state is not None else None
    bytes_per_step = stats["bytes_sent"] / stats["steps"] if stats else dense_bytes_per_step
    return {
        "arm": asdict(arm),
        "train_losses": train_losses,
        "evals": evals,
        "seconds": seconds,
        "bytes_per_step": bytes_per_step,
        "dense_bytes_per_step": dense_bytes_per_step,
        "stats": stats,
    }


@torch.no_grad()
def _evaluate(model, data) -> tuple[float, float]:
    logits = model(data.x_val)
    loss = F.cross_entropy(logits, data.y_val).item()
    accuracy = (logits.argmax(dim=1) == data.y_val).float().mean().item()
    return loss, accuracy


def _launched_train(arm: Arm, cfg: DemoConfig) -> dict:
    """Entry point of one launched rank: join the group from the launcher's environment."""
    torch.set_num_threads(1)  # ranks share the machine's cores, as torchrun arranges
    dist.init_process_group("gloo")
    try:
        return train(dist.get_rank(), dist.get_world_size(), arm, cfg)
    finally:
        dist.destroy_process_group()


def launch(arm: Arm, cfg: DemoConfig) -> dict:
    """Run one arm as a ``cfg.world_size``-rank job; returns rank 0's result."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    launch_config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.world_size,
        run_id=f"sparsecomm-demo-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # any free port, as torchrun --standalone
        max_restarts=0,
        monitor_interval=0.1,
    )
    return elastic_launch(launch_config, _launched_train)(arm, cfg)[0]


def format_report(results: list[dict], cfg: DemoConfig) -> str:
    header = (f"{'arm':<10} {'density':>8} {'final train':>11} {'val loss':>9} {'val acc':>8} "
              f"{'bytes/step':>11} {'vs dense':>9} {'eff. density':>12} {'s/step':>8}")
    lines = [f"digits MLP, {cfg.world_size} gloo ranks, {cfg.steps} steps, batch {cfg.batch_size}/rank, "
             "bytes = what each rank contributes per step", header, "-" * len(header)]
    for r in results:
        arm, stats = r["arm"], r["stats"]
        tail = r["train_losses"][-20:]
        _, val_loss, val_acc = r["evals"][-1]
        eff = stats["effective_density"] if stats else None
        lines.append(
            f"{arm['name']:<10} {arm['density'] or 1.0:>8.3g} {sum(tail) / len(tail):>11.4f} "
            f"{val_loss:>9.4f} {val_acc:>8.3f} {r['bytes_per_step']:>11.0f} "
            f"{r['bytes_per_step'] / r['dense_bytes_per_step']:>9.4f} "
            f"{'-' if eff is None else f'{eff:.4f}':>12} {r['seconds'] / cfg.steps:>8.4f}"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    defaults = DemoConfig()
    p = argparse.ArgumentParser(prog="sparsecomm demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps per arm (>= 3)")
    p.add_argument("--density", type=float, default=defaults.density, help="top-k density in (0, 1]")
    p.add_argument("--batch-size", type=int, default=defaults.batch_size, help="samples per rank per step (>= 1)")
    p.add_argument("--lr", type=float, default=defaults.lr, help="SGD learning rate (> 0)")
    p.add_argument("--world-size", type=int, default=defaults.world_size, help="ranks per arm (>= 2)")
    p.add_argument("--seed", type=int, default=defaults.seed, help="seed shared by all arms (>= 0)")
    return p


def config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> DemoConfig:
    """Validate CLI values before anything is launched."""
    checks = [
        ("--steps", args.steps >= 3, ">= 3"),
        ("--density", 0 < args.density <= 1, "in (0, 1]"),
        ("--batch-size", args.batch_size >= 1, ">= 1"),
        ("--lr", math.isfinite(args.lr) and args.lr > 0, "> 0"),
        ("--world-size", args.world_size >= 2, ">= 2"),
        ("--seed", args.seed >= 0, ">= 0"),
    ]
    for flag, ok, accepted in checks:
        if not ok:
            parser.error(f"{flag} must be {accepted}, got {getattr(args, flag[2:].replace('-', '_'))}")
    return replace(DemoConfig(), steps=args.steps, density=args.density, batch_size=args.batch_size,
                   lr=args.lr, world_size=args.world_size, seed=args.seed,
                   eval_every=max(1, args.steps // 6))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    cfg = config_from_args(parser.parse_args(argv), parser)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = [launch(arm, cfg) for arm in default_arms(cfg.density)]
    print()
    print(format_report(results, cfg))
    return 0
