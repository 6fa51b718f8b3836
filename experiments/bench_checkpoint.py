"""How long a checkpoint blocks training: ``save`` against ``save_async`` (not a test).

Runs 2 gloo ranks on this machine, each with an MLP of about ``--params`` million
parameters under DDP, AdamW and the top-k hook with error feedback (so a rank file holds
weights, two AdamW moments and the residuals: about 16 bytes per parameter). For each
size it trains a few steps, then alternates synchronous and asynchronous saves and
reports per save (median over ``--repeats``, rank 0):

* blocking ms: how long the training loop waits (``save`` returns; ``save_async`` returns
  once the cut is copied);
* background ms: ``save_async`` from the call until the checkpoint is committed;
* step ms: a training step alone, and the step right after ``save_async`` returns, while
  the save runs in the background (the two share the CPU cores).

    python experiments/bench_checkpoint.py --params 0.25 5 25 --out bench_checkpoint.json
"""
import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm
from sparsecomm.checkpoint import CheckpointManager, committed_steps, step_directory

WIDTH = 512  # layers of 512 x 512: 0.25M parameters each


def _model(params_millions: float) -> nn.Module:
    layers = max(1, round(params_millions * 1e6 / (WIDTH * WIDTH + WIDTH)))
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())])


def _rank(rank: int, world_size: int, workdir: str, sizes: list[float], repeats: int, result_path: str):
    store = dist.FileStore(os.path.join(workdir, "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=300))
    torch.set_num_threads(1)  # two ranks on the machine's cores
    rows = []
    for size in sizes:
        torch.manual_seed(0)
        model = _model(size)
        ddp = DDP(model)
        hook = sparsecomm.register_topk_hook(ddp, density=0.01)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        data = torch.Generator().manual_seed(rank)
        root = Path(workdir) / f"ckpt-{size}"
        manager = CheckpointManager(root, model=ddp, optimizer=optimizer, hook_state=hook, keep=2)
        step = 0

        def train() -> float:
            nonlocal step
            started = time.perf_counter()
            loss = ddp(torch.randn(8, WIDTH, generator=data)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            return time.perf_counter() - started

        for _ in range(3):
            train()
        sync, blocking, background, alone, overlapped = [], [], [], [], []
        for _ in range(repeats):
            alone.append(train())
            started = time.perf_counter()
            manager.save(step, data_position={"step": step})
            sync.append(time.perf_counter() - started)
            train()
            pending = manager.save_async(step, data_position={"step": step})
            blocking.append(pending.blocking_seconds)
            # Train on while the save runs, as a real loop would: one step on every rank (a
            # step is collective, so the ranks may not decide this by their own save's progress).
            overlapped.append(train())
            pending.wait()
            background.append(pending.seconds)
            dist.barrier()
            train()
        file_bytes = (step_directory(root, committed_steps(root)[-1]) / f"rank{rank}.pt").stat().st_size
        rows.append({
            "params": sum(p.numel() for p in model.parameters()),
            "rank_file_mb": file_bytes / 2**20,
            "sync_blocking_ms": 1e3 * statistics.median(sync),
            "async_blocking_ms": 1e3 * statistics.median(blocking),
            "async_background_ms": 1e3 * statistics.median(background),
            "step_ms": 1e3 * statistics.median(alone),
            "step_during_async_save_ms": 1e3 * statistics.median(overlapped),
        })
        del manager, ddp, model, optimizer, hook
    if rank == 0:
        Path(result_path).write_text(json.dumps(rows))
    dist.barrier()
    os._exit(0)  # skip gloo teardown, as the tests do


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, nargs="+", default=[0.25, 5.0, 25.0],
                        help="model sizes in millions of parameters (0.25: the default task's model)")
    parser.add_argument("--repeats", type=int, default=5, help="saves of each kind per size")
    parser.add_argument("--dir", type=Path, default=None, help="where to write checkpoints (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=Path("bench_checkpoint.json"), help="JSON result file")
    args = parser.parse_args(argv)
    if args.repeats < 1 or any(p <= 0 for p in args.params):
        parser.error("--repeats must be >= 1 and every --params > 0")
    with tempfile.TemporaryDirectory(dir=args.dir) as workdir:
        result_path = os.path.join(workdir, "rows.json")
        mp.start_processes(_rank, args=(2, workdir, args.params, args.repeats, result_path), nprocs=2,
                           start_method="spawn", join=True)
        rows = json.loads(Path(result_path).read_text())
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    print(f"2 gloo ranks, {os.cpu_count()} CPU cores ({cpu}), torch {torch.__version__}, median of {args.repeats}")
    print(f"{'params':>10} {'file MB':>8} {'sync block ms':>13} {'async block ms':>14} {'async total ms':>14} "
          f"{'step ms':>8} {'step ms during async':>20}")
    for r in rows:
        during = f"{r['step_during_async_save_ms']:.1f}"
        print(f"{r['params']:>10,} {r['rank_file_mb']:>8.1f} {r['sync_blocking_ms']:>13.1f} "
              f"{r['async_blocking_ms']:>14.1f} {r['async_background_ms']:>14.1f} {r['step_ms']:>8.1f} {during:>20}")
    args.out.write_text(json.dumps({"torch": torch.__version__, "cpu": cpu, "cores": os.cpu_count(),
                                    "config": {"params": args.params, "repeats": args.repeats}, "rows": rows},
                                   indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
