"""Cost of the hook's hot path against the memory-bandwidth floor (not a test).

For each size n and density: the fused error-feedback + select + pack step, the
scatter-add unpack of world_size payloads, and a plain read-read-write pass over the same
buffers (``acc = grad + residual``: the bandwidth floor every EF implementation pays),
all timed in one run, with ratios. Until native kernels land, "select_and_pack" is the
pure-torch reference (torch.topk), i.e. the baseline the kernels must beat.

    python experiments/bench_kernels.py --sizes 1e6 25e6 --densities 0.001 0.01 --out bench_kernels.json
"""
import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from sparsecomm import compress, ops
from sparsecomm.compress.packing import payload_nbytes
from sparsecomm.experiment.runner import _git_commit


def _time(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` after one untimed warm-up call."""
    fn()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def bench(n: int, density: float, world_size: int, repeats: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=generator)
    residual = torch.randn(n, generator=generator) * 0.1
    acc = torch.empty(n)
    new_residual = torch.empty(n)
    k = compress.num_selected(n, density)
    payload = torch.empty(payload_nbytes(k, torch.float32), dtype=torch.uint8)
    torch.add(grad, residual, out=acc)
    ops.select_and_pack(acc, k, compress.topk_indices, payload, torch.float32, residual_out=new_residual)
    gathered = payload.repeat(world_size)
    out = torch.empty(n)

    def floor():  # reads grad and residual, writes acc: what any EF step must move
        torch.add(grad, residual, out=acc)

    def fused():
        torch.add(grad, residual, out=acc)
        ops.select_and_pack(acc, k, compress.topk_indices, payload, torch.float32, residual_out=new_residual)

    def unpack():
        ops.unpack_add(gathered, out, k, torch.float32)

    floor_s, fused_s, unpack_s = _time(floor, repeats), _time(fused, repeats), _time(unpack, repeats)
    return {
        "n": n, "density": density, "k": k, "world_size": world_size,
        "implementation": ops.implementation("select_and_pack", "cpu").__module__,
        "floor_seconds": floor_s, "select_pack_seconds": fused_s, "unpack_seconds": unpack_s,
        "select_pack_over_floor": fused_s / floor_s,
        "floor_gb_per_s": 3 * 4 * n / floor_s / 1e9,
        "unpack_adds_per_s": world_size * k / unpack_s,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", type=float, default=[1e6, 25e6], help="elements per bucket")
    parser.add_argument("--densities", nargs="+", type=float, default=[0.001, 0.01], help="fractions in (0, 1]")
    parser.add_argument("--world-size", type=int, default=2, help="payloads to unpack (>= 1)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per figure (>= 1)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads (>= 1)")
    parser.add_argument("--out", type=Path, default=Path("bench_kernels.json"), help="JSON result file")
    args = parser.parse_args(argv)
    if any(not 0 < d <= 1 for d in args.densities):
        parser.error(f"--densities must be in (0, 1], got {args.densities}")
    if args.repeats < 1 or args.world_size < 1 or args.threads < 1:
        parser.error("--repeats, --world-size and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    rows = [bench(int(n), d, args.world_size, args.repeats) for n in args.sizes for d in args.densities]
    print(f"threads {args.threads}, select_and_pack implementation: {rows[0]['implementation']}")
    print(f"{'n':>11} {'density':>8} {'floor ms':>9} {'sel+pack ms':>11} {'ratio':>7} {'unpack ms':>9} {'M adds/s':>9}")
    for r in rows:
        print(f"{r['n']:>11} {r['density']:>8g} {r['floor_seconds'] * 1e3:>9.2f} {r['select_pack_seconds'] * 1e3:>11.2f} "
              f"{r['select_pack_over_floor']:>7.1f} {r['unpack_seconds'] * 1e3:>9.2f} {r['unpack_adds_per_s'] / 1e6:>9.1f}")
    args.out.write_text(json.dumps({"torch": torch.__version__, "machine": platform.machine(), "cpu_count": __import__("os").cpu_count(),
                                    "git_commit": _git_commit(), "threads": args.threads, "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
