"""What the wire checksum (``wire_checksum``) costs (a benchmark, not a test).

Two parts:

* ``kernel``: the CRC-32C of payloads at the sizes the hook sends, against a memcpy of the
  same bytes (``dst.copy_(src)``), interleaved call by call, at every CPU level this machine
  supports (one subprocess each: a process picks its level once). Per payload size: the
  sender's seal (one payload) and a receiver's check (``--rows`` payloads at once), in GB/s,
  and the ratio checksum / memcpy; also the pure-torch twin (the path GPUs take), on one
  payload.
* ``agreement``: the step's agreement alone (every rank raises alike, also for a fault
  only some receivers saw: one blocking 8-byte allreduce after the last bucket): the
  default task's step (``pydoc-gpt``, 2 gloo ranks, AdamW) with the checksum off, with and
  without one more 8-byte allreduce after backward, interleaved step by step; the median
  step and the ratio.

The step cost of the whole option (seal, check, agreement):
``python bench_step_cost.py --option wire_checksum --values false true``.

    cd experiments && python bench_wire_checksum.py kernel
    cd experiments && python bench_wire_checksum.py agreement --timed-steps 150
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch

from cpu_info import describe_cpu  # experiments/cpu_info.py, beside this script
from sparsecomm.compress.chunk_layout import ChunkLayout
from sparsecomm.compress.layout import PayloadLayout
from sparsecomm.ops import native, reference

# (name, payload bytes): the default task's payload (0.25M parameters, 1%, int32 + fp32), and
# a 25M-entry bucket at 1% on the default wire and on the compact one (rice + int4).
PAYLOADS = (
    ("pydoc-gpt 1% int32+fp32", PayloadLayout(2546, torch.float32).nbytes),
    ("25M 1% rice+int4", ChunkLayout(25_000_000, 25_000_000, 0.01, "rice", "int4", scale_group=64).nbytes),
    ("25M 1% int32+fp32", PayloadLayout(250_000, torch.float32).nbytes),
)


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def _kernel_level(args) -> dict:
    """This process's level: seconds of crc32c and of memcpy per payload size (fastest of
    ``repeats``, calls interleaved)."""
    torch.set_num_threads(args.threads)
    out = {"level": native.cpu_capability(), "sizes": {}}
    generator = torch.Generator().manual_seed(0)
    for name, nbytes in PAYLOADS:
        rows = torch.randint(0, 256, (args.rows, nbytes), dtype=torch.uint8, generator=generator)
        copy = torch.empty_like(rows)
        one, one_copy = rows[0], copy[0]
        timed = {"seal": [], "seal_memcpy": [], "check": [], "check_memcpy": []}
        for _ in range(args.repeats):  # interleaved: load from elsewhere hits both alike
            timed["seal"].append(_best(lambda: native.crc32c(one), 1))
            timed["seal_memcpy"].append(_best(lambda: one_copy.copy_(one), 1))
            timed["check"].append(_best(lambda: native.crc32c(rows), 1))
            timed["check_memcpy"].append(_best(lambda: copy.copy_(rows), 1))
        result = {key: min(values) for key, values in timed.items()}
        if nbytes <= 2**20:
            result["twin"] = _best(lambda: reference.crc32c(one), 3)
        out["sizes"][name] = {"nbytes": nbytes, **result}
    return out


def kernel(args) -> int:
    levels = native.supported_cpu_levels()
    results = {}
    for level in levels:
        env = dict(os.environ, SPARSECOMM_CPU_CAPABILITY=level)
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            subprocess.run([sys.executable, __file__, "_level", f.name, "--repeats", str(args.repeats), "--rows",
                            str(args.rows), "--threads", str(args.threads)], env=env, check=True)
            results[level] = json.loads(Path(f.name).read_text())
    print(f"CPU: {describe_cpu()}; torch {torch.__version__}; {args.threads} thread(s), fastest of {args.repeats}")
    print(f"{'payload':<26} {'level':<8} {'seal GB/s':>10} {'memcpy':>8} {'ratio':>6}   "
          f"{'check x' + str(args.rows) + ' GB/s':>16} {'memcpy':>8} {'ratio':>6}   {'twin GB/s':>9}")
    for name, nbytes in PAYLOADS:
        for level in levels:
            r = results[level]["sizes"][name]
            gb = lambda seconds, n=nbytes: n / seconds / 1e9  # noqa: E731
            twin = f"{gb(r['twin']):9.3f}" if "twin" in r else f"{'':>9}"
            print(f"{name:<26} {level:<8} {gb(r['seal']):10.2f} {gb(r['seal_memcpy']):8.2f} "
                  f"{r['seal'] / r['seal_memcpy']:6.2f}   {gb(r['check'] / args.rows):16.2f} "
                  f"{gb(r['check_memcpy'] / args.rows):8.2f} {r['check'] / r['check_memcpy']:6.2f}   {twin}")
    if args.out:
        Path(args.out).write_text(json.dumps({"cpu": describe_cpu(), "args": vars(args), "results": results}))
    return 0


def _agreement_rank(rank, args, workdir):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import sparsecomm
    from sparsecomm.lab.tasks import get_task

    store = dist.FileStore(os.path.join(workdir, "store"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    task = get_task("pydoc-gpt")
    runs = {}
    for name in ("checksum off", "+ agreement allreduce"):
        torch.manual_seed(args.seed)
        ddp = DDP(task.build_model())
        sparsecomm.register_topk_hook(ddp, wire_checksum=False)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
        runs[name] = (ddp, optimizer, torch.Generator().manual_seed(args.seed + 1 + rank))
    verdict = torch.zeros(2, dtype=torch.int32)  # 8 bytes: the smallest verdict worth agreeing on
    names, times = list(runs), {name: [] for name in runs}
    for step in range(args.warm_steps + args.timed_steps):
        shift = step % len(names)
        for name in names[shift:] + names[:shift]:
            ddp, optimizer, generator = runs[name]
            ids = torch.randint(task.num_train_samples, (16,), generator=generator)
            dist.barrier()
            started = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            task.loss(ddp, *task.train_batch(ids)).backward()
            if name != "checksum off":
                dist.all_reduce(verdict)
            optimizer.step()
            times[name].append(time.perf_counter() - started)
    result = {}
    for name in names:
        timed = torch.tensor(times[name][args.warm_steps:], dtype=torch.float64)
        dist.all_reduce(timed, op=dist.ReduceOp.MAX)
        result[name] = timed.tolist()
    if rank == 0:
        Path(workdir, "result.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def agreement(args) -> int:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as workdir:
        mp.spawn(_agreement_rank, args=(args, workdir), nprocs=2, join=True)
        result = json.loads(Path(workdir, "result.json").read_text())
    print(f"CPU: {describe_cpu()}; torch {torch.__version__}; 2 gloo ranks, 1 thread each")
    print(f"pydoc-gpt step, median of {args.timed_steps} after {args.warm_steps} warm")
    first = None
    for name, steps in result.items():
        median = statistics.median(steps)
        first = first or median
        print(f"  {name:<24} {median * 1e3:8.2f} ms   x{median / first:.4f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"cpu": describe_cpu(), "args": vars(args), "step_seconds": result}))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=("kernel", "agreement", "_level"))
    parser.add_argument("level_out", nargs="?", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=50, help="kernel: calls timed per size (fastest kept)")
    parser.add_argument("--rows", type=int, default=4, help="kernel: payloads a receiver checks at once")
    parser.add_argument("--threads", type=int, default=1, help="kernel: torch threads")
    parser.add_argument("--warm-steps", type=int, default=10, help="agreement: untimed steps")
    parser.add_argument("--timed-steps", type=int, default=150, help="agreement: timed steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args(argv)
    if args.part == "_level":  # one CPU level, in a subprocess of `kernel`
        Path(args.level_out).write_text(json.dumps(_kernel_level(args)))
        return 0
    return kernel(args) if args.part == "kernel" else agreement(args)


if __name__ == "__main__":
    sys.exit(main())
