"""Cost of the hook's hot path against the memory-bandwidth floor (a benchmark, not a test).

For each bucket size n and density, timed in one run on the same buffers:

* floor      ``acc = grad + residual`` (read, read, write): what any error-feedback step moves
* copy       ``dst.copy_(grad)`` (read, write): the memcpy reference
* fused      the dispatched ``ef_topk_pack`` (native kernel where built): EF + exact top-k + pack
* reference  the pure-torch twin (``torch.topk`` path): what runs without the extension
* threshold  ``ef_threshold_pack`` with a threshold from ``topk_threshold`` (one pass), and
  the estimate itself with its count error
* unpack     scatter-add of world_size payloads into the bucket: zero + scatter, and the
  scatter alone (M adds/s)

and the ratios: fused / floor, reference / fused. The residual is reset before every timed
call (untimed), so each call sees the same step. Prints a table, writes JSON with the
machine, torch version and git commit.

    python experiments/bench_kernels.py --sizes 1e6 25e6 100e6 --densities 0.001 0.01
    python experiments/bench_kernels.py --device cuda --sizes 1e6 25e6 100e6   # on a GPU
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from cpu_info import describe_cpu, vector_isa  # experiments/cpu_info.py, beside this script
from sparsecomm import compress, ops
from sparsecomm.compress.packing import payload_nbytes
from sparsecomm.experiment.runner import _git_commit
from sparsecomm.ops import reference


def _timer(device: torch.device):
    """A function returning median seconds of fn() over `repeats` calls, setup() untimed."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def measure(fn, repeats: int, setup=None) -> float:
        samples = []
        for attempt in range(repeats + 1):  # the first call warms up (page faults, workspaces)
            if setup is not None:
                setup()
            sync()
            started = time.perf_counter()
            fn()
            sync()
            if attempt:
                samples.append(time.perf_counter() - started)
        return statistics.median(samples)

    return measure


def bench(n: int, density: float, world_size: int, repeats: int, reference_repeats: int, device) -> dict:
    measure = _timer(device)
    generator = torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=generator).to(device)
    residual0 = (torch.randn(n, generator=generator) * 0.1).to(device)
    residual, acc = residual0.clone(), torch.empty_like(grad)
    k = compress.num_selected(n, density)
    payload = torch.empty(payload_nbytes(k, torch.float32), dtype=torch.uint8, device=device)
    indices, values = (view[0] for view in ops.payload_views(payload, k, torch.float32))

    def reset():
        residual.copy_(residual0)

    row = {"n": n, "density": density, "k": k, "world_size": world_size,
           "fused_implementation": ops.implementation("ef_topk_pack", device.type).__module__,
           "unpack_implementation": ops.implementation("unpack_add", device.type).__module__}
    row["floor_seconds"] = measure(lambda: torch.add(grad, residual, out=acc), repeats)
    row["copy_seconds"] = measure(lambda: acc.copy_(grad), repeats)
    row["fused_seconds"] = measure(
        lambda: ops.ef_topk_pack(grad, residual, world_size, True, k, indices, values, 0), repeats, reset)
    row["reference_seconds"] = measure(
        lambda: reference.ef_topk_pack(grad, residual, world_size, True, k, indices, values, 0),
        reference_repeats, reset)

    reset()
    torch.add(grad / world_size, residual, out=acc)
    threshold, count = ops.topk_threshold(acc, k, 0.05)
    row["threshold_estimate_seconds"] = measure(lambda: ops.topk_threshold(acc, k, 0.05), repeats)
    row["threshold_count_error"] = (int(count) - k) / k
    capacity_indices = torch.empty(int(k * 1.1) + 1, dtype=torch.int32, device=device)
    capacity_values = torch.empty(capacity_indices.numel(), device=device)
    row["threshold_pack_seconds"] = measure(
        lambda: ops.ef_threshold_pack(grad, residual, world_size, True, float(threshold), capacity_indices,
                                      capacity_values, 0), repeats, reset)

    reset()
    ops.ef_topk_pack(grad, residual, world_size, True, k, indices, values, 0)
    gathered = payload.repeat(world_size)
    gathered_indices, gathered_values = ops.payload_views(gathered, k, torch.float32)
    for rank in range(1, world_size):  # every rank sent a different index set (shifted, re-sorted)
        gathered_indices[rank] = torch.sort((indices.long() + rank * 104_729) % n).values.int()
    out = torch.empty_like(grad)
    row["unpack_seconds"] = measure(lambda: ops.unpack_add(gathered_indices, gathered_values, out, True), repeats)
    row["scatter_seconds"] = measure(lambda: ops.unpack_add(gathered_indices, gathered_values, out, False), repeats)
    row["zero_seconds"] = measure(lambda: out.zero_(), repeats)
    row["reference_unpack_seconds"] = measure(
        lambda: reference.unpack_add(gathered_indices, gathered_values, out, True), reference_repeats)

    element = grad.element_size()
    row.update({
        "fused_over_floor": row["fused_seconds"] / row["floor_seconds"],
        "fused_over_copy": row["fused_seconds"] / row["copy_seconds"],
        "reference_over_fused": row["reference_seconds"] / row["fused_seconds"],
        "threshold_pack_over_floor": row["threshold_pack_seconds"] / row["floor_seconds"],
        "floor_gb_per_s": 3 * element * n / row["floor_seconds"] / 1e9,
        "copy_gb_per_s": 2 * element * n / row["copy_seconds"] / 1e9,
        # The fused op must read grad and residual and write the residual: 3 x n x 4 bytes.
        "fused_gb_per_s": 3 * element * n / row["fused_seconds"] / 1e9,
        "unpack_adds_per_s": world_size * k / row["unpack_seconds"],
        "scatter_adds_per_s": world_size * k / row["scatter_seconds"],
    })
    return row


def _machine(device) -> dict:
    info = {"machine": platform.machine(), "processor": platform.processor(), "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "device": str(device)}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info["vector_isa"] = vector_isa()
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", type=float, default=[1e6, 25e6], help="elements per bucket (>= 1)")
    parser.add_argument("--densities", nargs="+", type=float, default=[0.001, 0.01], help="fractions in (0, 1]")
    parser.add_argument("--world-size", type=int, default=2, help="payloads to unpack (>= 1)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per figure (>= 1)")
    parser.add_argument("--reference-repeats", type=int, default=1,
                        help="timed repeats of the slow pure-torch reference (>= 1)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads (>= 1)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    parser.add_argument("--out", type=Path, default=Path("bench_kernels.json"), help="JSON result file")
    args = parser.parse_args(argv)
    if any(not 0 < d <= 1 for d in args.densities):
        parser.error(f"--densities must be in (0, 1], got {args.densities}")
    if any(n < 1 for n in args.sizes):
        parser.error(f"--sizes must be >= 1, got {args.sizes}")
    if min(args.repeats, args.reference_repeats, args.world_size, args.threads) < 1:
        parser.error("--repeats, --reference-repeats, --world-size and --threads must be >= 1")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    torch.set_num_threads(args.threads)
    rows = [bench(int(n), d, args.world_size, args.repeats, args.reference_repeats, device)
            for n in args.sizes for d in args.densities]
    machine = _machine(device)
    print(f"{describe_cpu()}; {args.threads} threads, device {device}, torch {torch.__version__}")
    print(f"fused: {rows[0]['fused_implementation']}, unpack: {rows[0]['unpack_implementation']}")
    print(f"{'n':>11} {'density':>7} {'floor':>7} {'copy':>7} {'fused':>7} {'f/floor':>7} {'ref':>8} {'ref/f':>6} "
          f"{'thr-pk':>7} {'estim':>7} {'err%':>5} {'unpack':>7} {'scatter':>7} {'M add/s':>7} {'zero':>6}")
    for r in rows:
        print(f"{r['n']:>11} {r['density']:>7g} {r['floor_seconds'] * 1e3:>7.1f} {r['copy_seconds'] * 1e3:>7.1f} "
              f"{r['fused_seconds'] * 1e3:>7.1f} {r['fused_over_floor']:>7.2f} {r['reference_seconds'] * 1e3:>8.1f} "
              f"{r['reference_over_fused']:>6.1f} {r['threshold_pack_seconds'] * 1e3:>7.1f} "
              f"{r['threshold_estimate_seconds'] * 1e3:>7.1f} {100 * r['threshold_count_error']:>5.1f} "
              f"{r['unpack_seconds'] * 1e3:>7.1f} {r['scatter_seconds'] * 1e3:>7.1f} "
              f"{r['scatter_adds_per_s'] / 1e6:>7.0f} {r['zero_seconds'] * 1e3:>6.1f}")
    print("times in ms; f/floor = fused / read-read-write pass; ref/f = torch.topk reference / fused; "
          "M add/s = scatter alone (unpack = zero + scatter)")
    args.out.write_text(json.dumps({**machine, "git_commit": _git_commit(), "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
