"""Cost of the hook's hot path against the memory-bandwidth floor (a benchmark, not a test).

For each bucket size n and density, on the same buffers, every op is timed through the
dispatch (the native kernels where built) in alternation with the floor, ``acc = grad +
residual`` (read, read, write: what any error-feedback step moves); one series after the other
let the machine's load drift between them, which moved a ratio measured that way by up to
1.5x from one run to the next. Per op: the median time, the median of the per-call ratios to
the floor (``/floor``), and what else says how it runs:

* ``ef_topk_pack``       error feedback + exact top-k + pack; a copy (read, write: the memcpy
                         reference) and the pure-torch twin (``torch.topk``: what runs without
                         the extension), with ref/op
* ``ef_threshold_pack``  with the exact k-th largest magnitude as its threshold (found untimed)
* ``unpack_add``         ``--world-size`` payloads scattered onto zeros (zero + scatter); the
                         scatter alone in M adds/s, the zeroing, the pure-torch twin
* ``chunk_encode``       ``selector="chunk"``: per index + value codec pair (``--chunk-pairs``)
                         and ``--chunk-size``; payload bytes per selected entry (every scale,
                         index and pad byte)
* ``chunk_decode_add``   world_size different payloads decoded onto zeros (zeroing included),
                         in M payload entries/s
* ``exact_topk_encode``  exact top-k on the compact wire (the hook's layout for exact top-k
                         with an index or value codec: one chunk of the whole bucket, a bf16
                         scale per 64 payload entries), per pair (``--exact-topk-pairs``), in M
                         bucket entries/s
* ``exact_topk_decode_add``  its decode, in M bucket entries/s and M payload entries/s

``--ops`` picks ops (default: all; ``--only-chunk`` the chunk ops, ``--only-exact-topk`` the
exact top-k ones). ``--all-cpu-levels`` runs the whole benchmark once per CPU level this CPU
supports (a process each: the level is chosen once per process) and prints every table.

The residual is reset before every timed call that updates it (untimed), so each call sees
the same step. Prints one table per op (the header names the CPU, its vector ISA and the level
the CPU kernels run at), writes JSON with the machine, torch version and git commit.

    python experiments/bench_kernels.py --sizes 1e6 25e6 100e6 --densities 0.001 0.01
    python experiments/bench_kernels.py --sizes 25e6 100e6 --densities 0.01 --only-chunk
    python experiments/bench_kernels.py --sizes 25e6 --densities 0.01 --threads 2 --all-cpu-levels
    python experiments/bench_kernels.py --device cuda --sizes 1e6 25e6 100e6   # on a GPU
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from cpu_info import cpu_model, describe_cpu, kernel_level, vector_isa  # experiments/cpu_info.py, beside this script
from sparsecomm import compress, ops
from sparsecomm.compress.chunk_layout import ChunkLayout
from sparsecomm.compress.owner_layout import EXACT_SCALE_GROUP
from sparsecomm.compress.packing import payload_nbytes
from sparsecomm.lab.experiment.runner import _git_commit
from sparsecomm.ops import reference

CHUNK_PAIRS = ("chunk+int2", "rice+int2", "rice+int4", "int32+fp32")
EXACT_TOPK_PAIRS = ("rice+int4", "rice+int2")
SHIFT = 104_729  # rank r's payload: the bucket's entries shifted by r x SHIFT, so ranks send different index sets
ENCODER_OF = {"chunk_decode_add": "chunk_encode", "exact_topk_decode_add": "exact_topk_encode"}  # decoder -> encoder


@dataclass
class Bucket:
    """The buffers of one bucket size and density, shared by every op's timing."""

    n: int
    density: float
    world_size: int
    grad: torch.Tensor
    residual0: torch.Tensor  # the residual every timed call starts from
    residual: torch.Tensor
    acc: torch.Tensor

    @classmethod
    def of(cls, n: int, density: float, world_size: int, device: torch.device) -> "Bucket":
        generator = torch.Generator().manual_seed(0)
        grad = torch.randn(n, generator=generator).to(device)
        residual0 = (torch.randn(n, generator=generator) * 0.1).to(device)
        return cls(n, density, world_size, grad, residual0, residual0.clone(), torch.empty_like(grad))

    def reset(self) -> None:
        self.residual.copy_(self.residual0)

    def floor(self) -> None:
        torch.add(self.grad, self.residual, out=self.acc)

    def row(self, op: str, implementation: Callable, **fields) -> dict:
        return {"op": op, "n": self.n, "density": self.density, "world_size": self.world_size,
                "implementation": implementation.__module__, **fields}


class Timer:
    """Median seconds of a call (``setup`` untimed before each), alone or against the floor."""

    def __init__(self, device: torch.device, repeats: int):
        self.device, self.repeats = device, repeats

    def once(self, fn, setup=None) -> float:
        if setup is not None:
            setup()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        started = time.perf_counter()
        fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - started

    def median(self, fn, setup=None, repeats=None) -> float:
        self.once(fn, setup)  # the first call warms up (page faults, workspaces)
        return statistics.median(self.once(fn, setup) for _ in range(repeats or self.repeats))

    def against_floor(self, bucket: Bucket, fn, setup=None) -> dict:
        """seconds, floor_seconds (medians) and over_floor (the median of per-call ratios), the
        call and the floor timed in alternation."""
        self.once(bucket.floor), self.once(fn, setup)  # warm-up
        pairs = [(self.once(fn, setup), self.once(bucket.floor)) for _ in range(self.repeats)]
        return {"seconds": statistics.median(f for f, _ in pairs),
                "floor_seconds": statistics.median(b for _, b in pairs),
                "over_floor": statistics.median(f / b for f, b in pairs)}


# --------------------------------------------------------------------------- one function per op


def _selection(bucket: Bucket):
    """k, and a payload's (int32 indices, float32 values) views."""
    k = compress.num_selected(bucket.n, bucket.density)
    payload = torch.empty(payload_nbytes(k, torch.float32), dtype=torch.uint8, device=bucket.grad.device)
    indices, values = (view[0] for view in ops.payload_views(payload, k, torch.float32))
    return k, payload, indices, values


def bench_ef_topk_pack(timer: Timer, bucket: Bucket, reference_repeats: int) -> dict:
    k, _, indices, values = _selection(bucket)
    b = bucket

    def op():
        ops.ef_topk_pack(b.grad, b.residual, b.world_size, True, k, indices, values, 0)

    row = b.row("ef_topk_pack", ops.implementation("ef_topk_pack", b.grad.device.type), k=k,
                **timer.against_floor(b, op, b.reset))
    row["copy_seconds"] = timer.median(lambda: b.acc.copy_(b.grad))
    row["reference_seconds"] = timer.median(
        lambda: reference.ef_topk_pack(b.grad, b.residual, b.world_size, True, k, indices, values, 0), b.reset,
        reference_repeats)
    row["reference_over_op"] = row["reference_seconds"] / row["seconds"]
    # The op must read grad and residual and write the residual: 3 x n x element bytes.
    row["gb_per_s"] = 3 * b.grad.element_size() * b.n / row["seconds"] / 1e9
    row["floor_gb_per_s"] = 3 * b.grad.element_size() * b.n / row["floor_seconds"] / 1e9
    return row


def bench_ef_threshold_pack(timer: Timer, bucket: Bucket) -> dict:
    k, _, _, _ = _selection(bucket)
    b = bucket
    b.reset()
    torch.add(b.grad / b.world_size, b.residual, out=b.acc)
    threshold = float(torch.topk(b.acc.abs(), k, sorted=False).values.min())  # untimed: the exact k-th magnitude
    indices = torch.empty(int(k * 1.1) + 1, dtype=torch.int32, device=b.grad.device)
    values = torch.empty(indices.numel(), device=b.grad.device)

    def op():
        ops.ef_threshold_pack(b.grad, b.residual, b.world_size, True, threshold, indices, values, 0)

    return b.row("ef_threshold_pack", ops.implementation("ef_threshold_pack", b.grad.device.type), k=k,
                 **timer.against_floor(b, op, b.reset))


def bench_unpack_add(timer: Timer, bucket: Bucket, reference_repeats: int) -> dict:
    k, payload, indices, values = _selection(bucket)
    b = bucket
    b.reset()
    ops.ef_topk_pack(b.grad, b.residual, b.world_size, True, k, indices, values, 0)
    gathered = payload.repeat(b.world_size)
    rows_indices, rows_values = ops.payload_views(gathered, k, torch.float32)
    for rank in range(1, b.world_size):  # every rank sent a different index set (shifted, re-sorted)
        rows_indices[rank] = torch.sort((indices.long() + rank * SHIFT) % b.n).values.int()
    out = torch.empty_like(b.grad)
    row = b.row("unpack_add", ops.implementation("unpack_add", b.grad.device.type), k=k,
                **timer.against_floor(b, lambda: ops.unpack_add(rows_indices, rows_values, out, True)))
    row["scatter_seconds"] = timer.median(lambda: ops.unpack_add(rows_indices, rows_values, out, False))
    row["zero_seconds"] = timer.median(lambda: out.zero_())
    row["reference_seconds"] = timer.median(lambda: reference.unpack_add(rows_indices, rows_values, out, True),
                                            repeats=reference_repeats)
    row["adds_per_s"] = b.world_size * k / row["seconds"]
    row["scatter_adds_per_s"] = b.world_size * k / row["scatter_seconds"]
    return row


def bench_encode(op: str, timer: Timer, bucket: Bucket, layout: ChunkLayout) -> dict:
    """chunk_encode or exact_topk_encode of ``layout``: error feedback + selection + codecs."""
    b = bucket
    payload = torch.empty(layout.nbytes, dtype=torch.uint8, device=b.grad.device)
    encode = getattr(ops.dispatch, op)
    row = b.row(op, ops.dispatch._chunk_implementation("chunk_encode", b.grad, layout), **_layout_fields(layout),
                **timer.against_floor(b, lambda: encode(b.grad, b.residual, b.world_size, True, layout, payload),
                                      b.reset))
    row["bucket_entries_per_s"] = b.n / row["seconds"]
    return row


def bench_decode_add(op: str, timer: Timer, bucket: Bucket, layout: ChunkLayout) -> dict:
    """chunk_decode_add or exact_topk_decode_add of world_size different payloads onto zeros."""
    b = bucket
    encode = getattr(ops.dispatch, ENCODER_OF[op])
    gathered = torch.empty(b.world_size * layout.nbytes, dtype=torch.uint8, device=b.grad.device)
    for rank in range(b.world_size):  # rank r's gradient: the bucket shifted by r x SHIFT entries
        shifted = torch.roll(b.grad, rank * SHIFT)
        encode(shifted, None, b.world_size, False, layout, gathered[rank * layout.nbytes : (rank + 1) * layout.nbytes])
        del shifted
    decode = getattr(ops.dispatch, op)
    row = b.row(op, ops.dispatch._chunk_implementation("chunk_decode_add", b.acc, layout), **_layout_fields(layout),
                **timer.against_floor(b, lambda: decode(gathered, layout, b.acc, True)))
    row["bucket_entries_per_s"] = b.n / row["seconds"]
    row["entries_per_s"] = b.world_size * layout.capacity / row["seconds"]
    return row


def _layout_fields(layout: ChunkLayout) -> dict:
    return {"index_codec": layout.index_codec, "value_codec": layout.value_codec, "chunk_size": layout.chunk_size,
            "scale_group": layout.scale_group, "entries": layout.capacity, "bytes_per_entry": layout.bytes_per_entry}


def _pairs(pairs) -> list[tuple[str, str]]:
    return [tuple(pair.split("+")) for pair in pairs]


def run_ops(selected, timer: Timer, bucket: Bucket, args) -> list[dict]:
    """Every selected op on ``bucket``, in the order of OPS."""
    chunk_layouts = [ChunkLayout(bucket.n, args.chunk_size, bucket.density, i, v) for i, v in _pairs(args.chunk_pairs)]
    exact_layouts = [ChunkLayout(bucket.n, bucket.n, bucket.density, i, v, scale_group=EXACT_SCALE_GROUP)
                     for i, v in _pairs(args.exact_topk_pairs)]
    calls = {
        "ef_topk_pack": [lambda: bench_ef_topk_pack(timer, bucket, args.reference_repeats)],
        "ef_threshold_pack": [lambda: bench_ef_threshold_pack(timer, bucket)],
        "unpack_add": [lambda: bench_unpack_add(timer, bucket, args.reference_repeats)],
        "chunk_encode": [lambda layout=layout: bench_encode("chunk_encode", timer, bucket, layout)
                         for layout in chunk_layouts],
        "chunk_decode_add": [lambda layout=layout: bench_decode_add("chunk_decode_add", timer, bucket, layout)
                             for layout in chunk_layouts],
        "exact_topk_encode": [lambda layout=layout: bench_encode("exact_topk_encode", timer, bucket, layout)
                              for layout in exact_layouts],
        "exact_topk_decode_add": [lambda layout=layout: bench_decode_add("exact_topk_decode_add", timer, bucket, layout)
                                  for layout in exact_layouts],
    }
    return [call() for op in OPS if op in selected for call in calls[op]]


# --------------------------------------------------------------------------- tables

MS, M = ("ms", 1e3, ".1f"), ("M/s", 1e-6, ".0f")
# op -> its columns after n, density (and the codecs), floor, op and /floor: (header, key, (unit, scale, format))
OPS = {
    "ef_topk_pack": [("copy", "copy_seconds", MS), ("ref", "reference_seconds", MS), ("ref/op", "reference_over_op",
                                                                                        ("", 1, ".1f"))],
    "ef_threshold_pack": [],
    "unpack_add": [("scatter", "scatter_seconds", MS), ("M add/s", "scatter_adds_per_s", M),
                   ("zero", "zero_seconds", MS), ("ref", "reference_seconds", MS)],
    "chunk_encode": [("B/entry", "bytes_per_entry", ("", 1, ".3f"))],
    "chunk_decode_add": [("M ent/s", "entries_per_s", M)],
    "exact_topk_encode": [("enc M/s", "bucket_entries_per_s", M), ("B/entry", "bytes_per_entry", ("", 1, ".3f"))],
    "exact_topk_decode_add": [("dec M/s", "bucket_entries_per_s", M), ("M ent/s", "entries_per_s", M)],
}
NOTES = {
    "ef_topk_pack": "ref = the torch.topk reference, ref/op = ref / op",
    "unpack_add": "op = zero + scatter; scatter alone in M adds/s",
    "chunk_decode_add": "world_size payloads decoded and added onto zeros (zeroing included); M ent/s = payload "
                        "entries per second",
    "exact_topk_encode": "one chunk, scales per 64 entries; enc M/s = M bucket entries per second",
    "exact_topk_decode_add": "dec M/s = M bucket entries per second, M ent/s = payload entries per second",
}


def print_table(op: str, rows: list[dict]) -> None:
    if not rows:
        return
    first = rows[0]
    codecs = "index_codec" in first
    where = f"chunk_size {first['chunk_size']}, " if op in ("chunk_encode", "chunk_decode_add") else ""
    print(f"\n{op} ({where}world_size {first['world_size']}): {first['implementation']}")
    extra = OPS[op]
    headers = [f"{'n':>11}", f"{'density':>7}", *([f"{'codecs':>11}"] if codecs else []), f"{'floor':>7}", f"{'op':>7}",
               f"{'/floor':>7}", *(f"{header:>7}" for header, _, _ in extra)]
    print(" ".join(headers))
    for r in rows:
        cells = [f"{r['n']:>11} {r['density']:>7g}"]
        if codecs:
            cells.append(f"{r['index_codec'] + '+' + r['value_codec']:>11}")
        cells.append(f"{r['floor_seconds'] * 1e3:>7.1f} {r['seconds'] * 1e3:>7.1f} {r['over_floor']:>7.2f}")
        cells += [f"{r[key] * scale:>7{fmt}}" for _, key, (_, scale, fmt) in extra]
        print(" ".join(cells))
    print("times in ms; /floor = the median of op / read-read-write floor, timed in alternation"
          + (f"; {NOTES[op]}" if op in NOTES else ""))


def _machine(device) -> dict:
    info = {"machine": platform.machine(), "processor": platform.processor(), "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "device": str(device),
            "cpu_model": cpu_model(), "vector_isa": vector_isa(), "cpu_kernel_level": kernel_level()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _every_cpu_level(argv) -> int:
    """Runs this script once per CPU level this CPU supports (SPARSECOMM_CPU_CAPABILITY set),
    each writing its own JSON next to --out."""
    from sparsecomm.ops import native

    args = [a for a in argv if a != "--all-cpu-levels"]
    out = Path(args[args.index("--out") + 1]) if "--out" in args else Path("bench_kernels.json")
    args = [a for i, a in enumerate(args) if a != "--out" and (i == 0 or args[i - 1] != "--out")]
    failed = 0
    for level in native.supported_cpu_levels():
        print(f"===== SPARSECOMM_CPU_CAPABILITY={level}", flush=True)
        env = {**os.environ, "SPARSECOMM_CPU_CAPABILITY": level}
        target = out.with_name(f"{out.stem}.{level}{out.suffix}")
        failed |= subprocess.run([sys.executable, __file__, *args, "--out", str(target)], env=env).returncode
    return failed


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--all-cpu-levels" in argv:
        return _every_cpu_level(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", type=float, default=[1e6, 25e6], help="elements per bucket (>= 1)")
    parser.add_argument("--densities", nargs="+", type=float, default=[0.001, 0.01], help="fractions in (0, 1]")
    parser.add_argument("--ops", nargs="+", choices=list(OPS), default=list(OPS), help="the ops to time (default: all)")
    parser.add_argument("--only-chunk", action="store_true", help="only chunk_encode and chunk_decode_add")
    parser.add_argument("--only-exact-topk", "--only-compact", action="store_true",
                        help="only exact_topk_encode and exact_topk_decode_add (--only-compact: the former name)")
    parser.add_argument("--world-size", type=int, default=2, help="payloads to unpack or decode (>= 1)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per figure (>= 1)")
    parser.add_argument("--reference-repeats", type=int, default=1,
                        help="timed repeats of the slow pure-torch references (>= 1)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads (>= 1)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    parser.add_argument("--chunk-size", type=int, default=4096, help="chunk size of the chunk ops' layouts (2..65536)")
    parser.add_argument("--chunk-pairs", nargs="*", default=list(CHUNK_PAIRS),
                        help="index+value codec pairs of the chunk ops (none: no such rows)")
    parser.add_argument("--exact-topk-pairs", "--compact-pairs", nargs="*", default=list(EXACT_TOPK_PAIRS),
                        help="index+value codec pairs of the exact top-k ops (none: no such rows; --compact-pairs: "
                             "the former name)")
    parser.add_argument("--all-cpu-levels", action="store_true",
                        help="run everything once per CPU level this CPU supports (a process each)")
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
    selected = set(args.ops)
    if args.only_chunk or args.only_exact_topk:
        selected = ({"chunk_encode", "chunk_decode_add"} if args.only_chunk else set()) | (
            {"exact_topk_encode", "exact_topk_decode_add"} if args.only_exact_topk else set())
    torch.set_num_threads(args.threads)
    timer = Timer(device, args.repeats)
    rows = [row for n in args.sizes for d in args.densities
            for row in run_ops(selected, timer, Bucket.of(int(n), d, args.world_size, device), args)]
    machine = _machine(device)
    print(f"{describe_cpu()}; {args.threads} threads, device {device}, torch {torch.__version__}")
    print(f"CPU {machine['cpu_model']}; vector ISA {machine['vector_isa']}; CPU kernels at level "
          f"{machine['cpu_kernel_level']}")
    for op in OPS:
        print_table(op, [row for row in rows if row["op"] == op])
    args.out.write_text(json.dumps({**machine, "git_commit": _git_commit(), "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
