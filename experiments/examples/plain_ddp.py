"""A complete DDP training script with sparsecomm added: the two marked lines.

    torchrun --standalone --nproc-per-node 2 experiments/examples/plain_ddp.py [--out DIR] [--tensorboard DIR]

A small MLP learns to imitate a fixed random "teacher" network on generated inputs (no
download), on CPU with gloo. DistributedSampler gives every rank different samples.
With ``--out DIR`` every rank saves its own hook state (its residuals differ from every
other rank's) next to the model, and ``--resume`` loads them back. ``--tensorboard DIR``
writes rank 0's training loss and, every 10 steps, the hook's figures (bytes per step,
compression, residual norm, ...: ``sparsecomm.metrics``) to TensorBoard.
"""
import argparse
import gc
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import sparsecomm  # sparsecomm (1/2)

INPUTS, CLASSES = 32, 10


def teacher_dataset(num_samples: int, seed: int = 0) -> TensorDataset:
    """Inputs and the labels a fixed random network gives them: learnable, no download."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, INPUTS, generator=generator)
    w1 = torch.randn(INPUTS, 64, generator=generator)
    w2 = torch.randn(64, CLASSES, generator=generator)
    return TensorDataset(x, (torch.tanh(x @ w1) @ w2).argmax(dim=1))


def student() -> nn.Module:
    return nn.Sequential(nn.Linear(INPUTS, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, CLASSES))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--out", type=Path, default=None, help="save model and per-rank hook state here")
    parser.add_argument("--resume", action="store_true", help="load them from --out first")
    parser.add_argument("--tensorboard", type=Path, default=None, metavar="DIR",
                        help="rank 0's loss and the hook's figures in TensorBoard event files in DIR")
    args = parser.parse_args(argv)

    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR/PORT
    try:
        train(args)
    finally:
        # After train() returned: collect its DDP model first, which holds the process group
        # through reference cycles (a gloo group torn down at interpreter exit can abort).
        gc.collect()
        dist.destroy_process_group()


def train(args) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)  # same initial weights everywhere (DDP also broadcasts rank 0's)
    model = DDP(student())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # sparsecomm (2/2); the hook takes over SGD's momentum (momentum correction), said on rank 0
    state = sparsecomm.register_topk_hook(model, density=args.density, optimizer=optimizer)
    if args.resume:
        model.module.load_state_dict(torch.load(args.out / "model.pt", weights_only=True))
        optimizer.load_state_dict(torch.load(args.out / f"optimizer_rank{rank}.pt", weights_only=True))
        state.load_state_dict(torch.load(args.out / f"sparsecomm_rank{rank}.pt", weights_only=True))

    writer = metrics = None
    if args.tensorboard is not None and rank == 0:  # rank 0 logs (pip install 'sparsecomm[tensorboard]')
        from torch.utils.tensorboard import SummaryWriter

        from sparsecomm.metrics import MetricsLogger, TensorBoardSink

        writer = SummaryWriter(str(args.tensorboard))
        metrics = MetricsLogger(state, every=10, sinks=[TensorBoardSink(writer)])

    dataset = teacher_dataset(4096)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)  # each rank: a different shard
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    losses = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if writer is not None:
                writer.add_scalar("train/loss", losses[-1], len(losses))
                metrics.step(len(losses))  # every 10th step: the figures of the last 10
    if writer is not None:
        writer.close()

    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        if rank == 0:
            torch.save(model.module.state_dict(), args.out / "model.pt")  # replicated: one copy
        torch.save(optimizer.state_dict(), args.out / f"optimizer_rank{rank}.pt")
        torch.save(state.state_dict(), args.out / f"sparsecomm_rank{rank}.pt")  # per rank, never rank 0's for all
    stats = state.stats()
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    print(
        f"rank {rank}: {stats['steps']} steps, {stats['sparse_calls']} sparse bucket reductions, "
        f"sent {100 * stats['compression']:.1f}% of dense bytes, loss {first:.3f} -> {last:.3f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
