"""The package files one default bucket crosses: every file of ``sparsecomm`` with a function called
inside a steady-state step's hook call or its future callbacks, at 2 gloo ranks.

The job is the README's first example (``register_topk_hook(ddp, density=..., optimizer=AdamW)``: exact
top-k, int32 + fp32 entries, the all-gather, the model-wide budget) on a model of several DDP buckets, each
rank with its own data. Step 4 is profiled (three steps before it settle the hook): the hook call runs under
``sys.setprofile``, and so does every callback the hook chains with ``Future.then`` (they run on the
collective's threads, which a main-thread profiler does not see).

    python scripts/bucket_path.py
"""
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PACKAGE = Path(__file__).resolve().parents[1] / "sparsecomm"
PROFILED_STEP = 3  # 0-based: steps 0-2 settle the hook (the budget's window, the first all-gather of settings)


def _tracer(found: set):
    def trace(frame, event, arg):
        if event == "call":
            path = Path(frame.f_code.co_filename)
            if PACKAGE in path.parents:
                found.add(str(path.relative_to(PACKAGE.parent)) + (":" + frame.f_code.co_name if os.environ.get("BUCKET_PATH_FUNCTIONS") else ""))
    return trace


def _profiled(fn, found, active):
    def run(*args, **kwargs):
        if not active[0]:
            return fn(*args, **kwargs)
        previous = sys.getprofile()
        sys.setprofile(_tracer(found))
        try:
            return fn(*args, **kwargs)
        finally:
            sys.setprofile(previous)
    return run


def _rank(rank: int, world_size: int, port: int, out: str, bucket_cap_mb: float, with_optimizer: bool) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    import sparsecomm

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    found, active = set(), [False]
    register = ddp.register_comm_hook
    def register_profiled(state, hook):
        profiled = _profiled(hook, found, active)
        register(state, lambda state, bucket: profiled(state, bucket))  # DDP checks the argument names
    ddp.register_comm_hook = register_profiled
    then = torch._C.Future.then
    torch._C.Future.then = lambda fut, callback: then(fut, _profiled(callback, found, active))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sparsecomm.register_topk_hook(ddp, density=0.01, **({"optimizer": optimizer} if with_optimizer else {}))
    generator = torch.Generator().manual_seed(rank)
    for step in range(PROFILED_STEP + 1):
        active[0] = step == PROFILED_STEP
        x = torch.randn(32, 256, generator=generator)
        ddp(x).square().mean().backward()
        active[0] = False
        optimizer.step()
        optimizer.zero_grad()
    torch._C.Future.then = then
    dist.barrier()
    Path(out, f"rank{rank}.txt").write_text("\n".join(sorted(found)))
    dist.destroy_process_group()


def files_one_bucket_crosses(world_size: int = 2, bucket_cap_mb: float = 0.25, with_optimizer: bool = True) -> list[str]:
    """The files, sorted. ``bucket_cap_mb`` 0.25: 4 buckets of the 4-layer model (the budget counts);
    a large cap: one bucket. ``with_optimizer`` False: plain error feedback (no momentum handover)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank, args=(world_size, port, out, bucket_cap_mb, with_optimizer), nprocs=world_size, join=True)
        files = set()
        for rank in range(world_size):
            files |= set(Path(out, f"rank{rank}.txt").read_text().split())
    return sorted(files)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="the package files one default bucket crosses")
    parser.add_argument("--bucket-cap-mb", type=float, default=0.25, help="DDP's bucket cap (0.25: 4 buckets)")
    parser.add_argument("--no-optimizer", action="store_true", help="register without the optimizer (plain EF)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    files = files_one_bucket_crosses(bucket_cap_mb=args.bucket_cap_mb, with_optimizer=not args.no_optimizer)
    print(f"{len(files)} package files")
    print("\n".join(files))
