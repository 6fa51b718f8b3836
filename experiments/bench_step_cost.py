"""What one hook option costs on the default task's training step (not a test).

Two gloo ranks (spawned here, FileStore rendezvous) train the default experiment's task
(``pydoc-gpt``: byte-level GPT, 2 layers, width 96, 0.25M parameters; AdamW at lr 3e-3,
batch 16 per rank, different samples per rank) with ``topk_hook``. For every arm of the
default experiment that runs the hook (``topk-ef``: density 1% + error feedback;
``topk-dgc``: the same + momentum correction 0.9, AdamW betas (0, 0.999)) and every value
of ``--option``, one model trains; the configurations step in rounds, one step each, in an
order that rotates every round, so load from elsewhere on the machine hits them alike.
Each step starts after a barrier, and a step's time is the slower rank's. Printed: the
median step of each configuration and its ratio to the first value's (boundary: step).

    python experiments/bench_step_cost.py --option on_overflow --values drop rollback
    python experiments/bench_step_cost.py --option budget --values '"bucket"' '"model"'   # 11 buckets a step
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm
from sparsecomm.lab.tasks import get_task

from cpu_info import describe_cpu  # experiments/cpu_info.py, beside this script

WORLD_SIZE = 2
BATCH = 16  # per rank, as the default experiment (sparsecomm.lab.experiment.named.pydoc_gpt)
LR = 3e-3
ARMS = {  # the default experiment's hook arms (sparsecomm.lab.experiment.arm_spec presets)
    "topk-ef": ({"density": 0.01}, (0.9, 0.999)),
    "topk-dgc": ({"density": 0.01, "momentum": 0.9}, (0.0, 0.999)),
}


def _value(text: str):
    """An option value from the command line: JSON (numbers, true, null) or a plain string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _configurations(args) -> dict:
    return {f"{arm} {args.option}={value}": ({**options, args.option: _value(value)}, betas)
            for arm, (options, betas) in ARMS.items() if arm in args.arms for value in args.values}


def _rank_main(rank, args, workdir):
    store = dist.FileStore(os.path.join(workdir, "store"), WORLD_SIZE)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=120))
    torch.set_num_threads(1)  # two ranks on a small machine: one intra-op thread each
    task = get_task("pydoc-gpt")
    runs = {}
    for name, (options, betas) in _configurations(args).items():
        torch.manual_seed(args.seed)
        ddp = DDP(task.build_model(), bucket_cap_mb=args.bucket_cap_mb)
        sparsecomm.register_topk_hook(ddp, **options)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=LR, betas=betas)
        runs[name] = (ddp, optimizer, torch.Generator().manual_seed(args.seed + 1 + rank))
    names = list(runs)
    times = {name: [] for name in names}
    for step in range(args.warm_steps + args.timed_steps):
        shift = step % len(names)
        for name in names[shift:] + names[:shift]:
            ddp, optimizer, generator = runs[name]
            ids = torch.randint(task.num_train_samples, (BATCH,), generator=generator)
            dist.barrier()  # start every step together: time the step, not the skew
            started = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            task.loss(ddp, *task.train_batch(ids)).backward()
            optimizer.step()
            times[name].append(time.perf_counter() - started)
    result = {}
    for name in names:
        timed = torch.tensor(times[name][args.warm_steps:], dtype=torch.float64)
        dist.all_reduce(timed, op=dist.ReduceOp.MAX)  # a step ends when both ranks are done
        result[name] = timed.tolist()
    if rank == 0:
        Path(workdir, "result.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--option", required=True, help="a TopKState keyword, e.g. on_overflow")
    parser.add_argument("--values", nargs="+", required=True,
                        help="its values (JSON or plain strings); ratios are to the first")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--warm-steps", type=int, default=10, help="untimed steps (the first 2 are dense warm-up)")
    parser.add_argument("--timed-steps", type=int, default=150)
    parser.add_argument("--bucket-cap-mb", type=float, default=0.1,
                        help="DDP's bucket size; 0.1 (the default task's: 11 buckets a step), 25 (DDP's: one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the step times as JSON here")
    args = parser.parse_args(argv)
    if args.warm_steps < 2 or args.timed_steps < 1:
        parser.error("--warm-steps must be >= 2 (the hook's dense warm-up) and --timed-steps >= 1")
    if not args.bucket_cap_mb > 0:
        parser.error(f"--bucket-cap-mb must be a number > 0, got {args.bucket_cap_mb}")
    with tempfile.TemporaryDirectory() as workdir:
        mp.spawn(_rank_main, args=(args, workdir), nprocs=WORLD_SIZE, join=True)
        result = json.loads(Path(workdir, "result.json").read_text())
    print(f"CPU: {describe_cpu()}; torch {torch.__version__}; {WORLD_SIZE} gloo ranks, 1 thread each")
    print(f"pydoc-gpt step (boundary: step), bucket_cap_mb {args.bucket_cap_mb:g}, median of {args.timed_steps} steps "
          f"after {args.warm_steps} warm")
    for arm in args.arms:
        first = None
        for value in args.values:
            name = f"{arm} {args.option}={value}"
            median = statistics.median(result[name])
            first = first or median
            print(f"  {name:<40} {median * 1e3:8.2f} ms   x{median / first:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"cpu": describe_cpu(), "args": vars(args), "step_seconds": result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
