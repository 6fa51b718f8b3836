"""A plain DDP training script with the sparsecomm hook, launched by mpiexec (or torchrun).

    mpiexec -n 2 python experiments/examples/mpi_ddp.py
    mpiexec -n 2 python experiments/examples/mpi_ddp.py --transport mpi --selector sampled
    torchrun --nproc-per-node 2 experiments/examples/mpi_ddp.py

``sparsecomm.dist.init_distributed()`` reads the rank and world size from the launcher
(MPICH, Open MPI, SLURM or torchrun) and, when MASTER_ADDR/MASTER_PORT are not set, lets
rank 0 pick them and broadcast them with mpi4py. The model is a small MLP regressing a
fixed random teacher network; every rank draws its own samples (seeded by rank), so the
gradients differ per rank and the hook has something to reduce.
"""
import argparse
import json
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm
from sparsecomm.dist import init_distributed, shutdown


def make_model(width: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)  # same initial weights on every rank (DDP would broadcast them anyway)
    return nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))


def make_batches(rank: int, steps: int, batch_size: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Inputs differ per rank; targets come from one teacher shared by all ranks."""
    teacher = torch.Generator().manual_seed(seed)
    weights = torch.randn(16, 1, generator=teacher)
    samples = torch.Generator().manual_seed(seed * 1000 + rank)
    batches = []
    for _ in range(steps):
        x = torch.randn(batch_size, 16, generator=samples)
        batches.append((x, torch.sin(x @ weights / 4)))  # (B, 1), targets of order 1
    return batches


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--density", type=float, default=0.05)
    parser.add_argument("--selector", default="exact", choices=["exact", "sampled", "random"])
    parser.add_argument("--transport", default="c10d", choices=["c10d", "mpi"])
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--summary", help="rank 0 writes losses, hook stats and a parameter digest here (JSON)")
    args = parser.parse_args(argv)

    info = init_distributed()  # gloo on CPU, NCCL with GPUs
    try:
        return train(args, info)
    finally:
        shutdown()  # after train() returned: its DDP model no longer holds the process group


def train(args, info) -> int:
    if info.rank == 0:
        print(f"launcher={info.launcher} world_size={info.world_size} rendezvous={info.master_addr}:"
              f"{info.master_port} backend={dist.get_backend()}", flush=True)

    model = DDP(make_model(args.width, args.seed))
    state = sparsecomm.register_topk_hook(model, density=args.density, selector=args.selector,
                                          transport=args.transport)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    losses = []
    for step, (x, y) in enumerate(make_batches(info.rank, args.steps, args.batch_size, args.seed)):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if info.rank == 0 and (step % 20 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.5f}", flush=True)

    # Replicas must agree after training: compare every rank's parameters with rank 0's.
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    replica = flat.clone()
    dist.broadcast(replica, src=0)
    if not torch.equal(flat, replica):
        raise RuntimeError(f"rank {info.rank}: parameters differ from rank 0's after training")
    stats = state.stats()
    if info.rank == 0:
        print(f"effective density {stats['effective_density']:.4f}, compression {stats['compression']:.3f}, "
              f"transport {stats['transport']}", flush=True)
        if args.summary:
            summary = {"launch": {"launcher": info.launcher, "world_size": info.world_size},
                       "losses": losses, "stats": stats, "parameters": flat.tolist()}
            with open(args.summary, "w") as f:
                json.dump(summary, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
