"""A training loop that skips overflowing steps, with and without the top-k hook.

The loop does what ``torch.amp.GradScaler`` does: a step whose gradients are not all
finite is skipped (no optimizer step). One backward overflows at step ``--overflow-step``:

- ``--kind inf-input``: an Inf in rank 0's input (NaN/Inf in almost every gradient entry);
- ``--kind scaled-loss``: every rank multiplies that step's loss by 3e38 (a loss scale that
  is too large), which leaves Inf in some gradient entries and huge finite ones (up to
  ~1e38) in the others.

Plain DDP skips that one step and trains on; so must the hook. Printed per setup: steps
skipped, and the evaluation loss after the last step.

    python experiments/overflow_loop.py [--kind scaled-loss] [--steps 40] [--overflow-step 5] [--density 0.05]

2 gloo ranks on this machine (spawned), an MLP (32-64-64-4, ReLU; inputs of scale 20 so that
the scaled gradient overflows in part), SGD lr 0.01, batches of 8, regression targets.
"""
import argparse
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

SETUPS = {  # label -> register_topk_hook keyword arguments (None: plain DDP)
    "plain DDP": None,
    "top-k hook (defaults)": {},
    "top-k hook, momentum correction 0.9": {"momentum": 0.9},
    "top-k hook, on_overflow='drop' (opt-out)": {"on_overflow": "drop"},
}
LOSS_SCALE = 3e38


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def _run(rank, args, hook_kwargs):
    import sparsecomm

    model = _model()
    ddp = DDP(model)
    if hook_kwargs is not None:
        sparsecomm.register_topk_hook(ddp, density=args.density, **hook_kwargs)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(1000 + rank)
    evaluation = torch.randn(64, 32, generator=torch.Generator().manual_seed(7))
    evaluation_targets = torch.randn(64, 4, generator=torch.Generator().manual_seed(8))
    skipped = 0
    for step in range(args.steps):
        x, y = 20 * torch.randn(8, 32, generator=data), torch.randn(8, 4, generator=data)
        overflow = step == args.overflow_step
        if overflow and args.kind == "inf-input" and rank == 0:
            x[0, 0] = float("inf")
        optimizer.zero_grad()
        loss = (ddp(x) - y).pow(2).mean()
        if overflow and args.kind == "scaled-loss":
            loss = loss * LOSS_SCALE
        loss.backward()
        if not all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()):
            skipped += 1
            continue
        optimizer.step()
    with torch.no_grad():
        loss = float((model(20 * evaluation) - evaluation_targets).pow(2).mean())
    return skipped, loss


def _rank_main(rank, args, port, results_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    rows = []
    for label, kwargs in SETUPS.items():
        try:
            rows.append((label, *_run(rank, args, kwargs)))
        except TypeError as error:  # an option this version does not have
            rows.append((label, None, str(error)))
    if rank == 0:
        torch.save(rows, results_path)
    dist.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=("scaled-loss", "inf-input"), default="scaled-loss",
                        help="how the step overflows (default scaled-loss)")
    parser.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    parser.add_argument("--overflow-step", type=int, default=5, help="step whose backward overflows on rank 0")
    parser.add_argument("--density", type=float, default=0.05, help="top-k density of the hook (default 0.05)")
    args = parser.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as workdir:
        results_path = os.path.join(workdir, "rows.pt")
        mp.spawn(_rank_main, args=(args, port, results_path), nprocs=2)
        rows = torch.load(results_path)
    where = "every rank's loss x 3e38" if args.kind == "scaled-loss" else "an Inf in rank 0's input"
    print(f"{args.steps} steps, overflow at step {args.overflow_step} ({where}), density {args.density}, 2 gloo ranks")
    print(f"{'setup':40s} {'steps skipped':>14s} {'eval loss after':>16s}")
    for label, skipped, loss in rows:
        if skipped is None:
            print(f"{label:40s} {'(not available: ' + loss + ')'}")
        else:
            print(f"{label:40s} {skipped:14d} {loss:16.4f}")


if __name__ == "__main__":
    main()
