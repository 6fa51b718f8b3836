"""Cost of the hook's hot path against the memory-bandwidth floor (a benchmark, not a test).

For each bucket size n and density, timed in one run on the same buffers:

* floor      ``acc = grad + residual`` (read, read, write): what any error-feedback step moves
* copy       ``dst.copy_(grad)`` (read, write): the memcpy reference
* fused      the dispatched ``ef_topk_pack`` (native kernel where built): EF + exact top-k + pack
* reference  the pure-torch twin (``torch.topk`` path): what runs without the extension
* threshold  ``ef_threshold_pack`` with the exact k-th largest magnitude as its threshold
  (found untimed by torch.topk; one pass)
* unpack     scatter-add of world_size payloads into the bucket: zero + scatter, and the
  scatter alone (M adds/s)

and the ratios: fused / floor, reference / fused. Every ratio to the floor is the median of
per-call ratios, the floor timed in alternation with the kernel (one series after the other
let the machine's load drift between them). For the chunked selection
(``selector="chunk"``), per index + value codec pair (``--chunk-pairs``):

* encode     the dispatched ``chunk_encode``: EF + per-chunk top-k + codecs, and / floor
* decode     ``chunk_decode_add`` of world_size different payloads onto zeros (zeroing
  included), in M payload entries/s
* B/entry    payload bytes (scales, indices, values, padding) per selected entry

For exact top-k on the compact wire (the hook's layout for selector="exact" with an index or
value codec: one chunk of the whole bucket, a bf16 scale per 64 payload entries), per codec
pair (``--compact-pairs``):

* encode     the dispatched ``chunk_encode``: EF + exact top-k + codecs, / floor, and in M
  bucket entries/s
* decode     ``chunk_decode_add`` of world_size different payloads onto zeros, in M bucket
  entries/s (and M payload entries/s)

``--all-cpu-levels`` runs the whole benchmark once per CPU level this CPU supports (a
process each: the level is chosen once per process) and prints every table.

The residual is reset before every timed call (untimed), so each call sees the same step.
Prints the tables (the header names the CPU, its vector ISA and the level the CPU kernels
run at), writes JSON with the machine, torch version and git commit.

    python experiments/bench_kernels.py --sizes 1e6 25e6 100e6 --densities 0.001 0.01
    python experiments/bench_kernels.py --sizes 25e6 100e6 --densities 0.01 --only-chunk
    python experiments/bench_kernels.py --sizes 25e6 100e6 --densities 0.01 --only-compact --all-cpu-levels
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
from pathlib import Path

import torch

from cpu_info import describe_cpu, vector_isa  # experiments/cpu_info.py, beside this script
from sparsecomm import compress, ops
from sparsecomm.compress.chunk_layout import ChunkLayout
from sparsecomm.compress.packing import payload_nbytes
from sparsecomm.lab.experiment.runner import _git_commit
from sparsecomm.ops import native, reference

CHUNK_PAIRS = ("chunk+int2", "rice+int2", "rice+int4", "int32+fp32")
COMPACT_PAIRS = ("rice+int4", "rice+int2")
EXACT_SCALE_GROUP = 64  # sparsecomm.compress.owner_layout.EXACT_SCALE_GROUP, the hook's


def _timer(device: torch.device):
    """A function returning median seconds of fn() over `repeats` calls, setup() untimed."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def once(fn, setup=None) -> float:
        if setup is not None:
            setup()
        sync()
        started = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - started

    def measure(fn, repeats: int, setup=None) -> float:
        once(fn, setup)  # the first call warms up (page faults, workspaces)
        return statistics.median(once(fn, setup) for _ in range(repeats))

    return measure, once


def _against_floor(device: torch.device, floor, fn, repeats: int, setup) -> tuple[float, float, float]:
    """(median fn seconds, median floor seconds, median of fn / floor), the two timed in
    alternation: on a shared machine the load drifts between two separate series, which
    moved a ratio measured that way by up to 1.5x from one run to the next."""
    _, once = _timer(device)
    once(floor), once(fn, setup)  # warm-up
    pairs = [(once(fn, setup), once(floor)) for _ in range(repeats)]
    return (statistics.median(f for f, _ in pairs), statistics.median(b for _, b in pairs),
            statistics.median(f / b for f, b in pairs))


def bench(n: int, density: float, world_size: int, repeats: int, reference_repeats: int, device) -> dict:
    measure, _ = _timer(device)
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
    row["fused_seconds"], row["floor_seconds"], row["fused_over_floor"] = _against_floor(
        device, lambda: torch.add(grad, residual, out=acc),
        lambda: ops.ef_topk_pack(grad, residual, world_size, True, k, indices, values, 0), repeats, reset)
    row["copy_seconds"] = measure(lambda: acc.copy_(grad), repeats)
    row["reference_seconds"] = measure(
        lambda: reference.ef_topk_pack(grad, residual, world_size, True, k, indices, values, 0),
        reference_repeats, reset)

    reset()
    torch.add(grad / world_size, residual, out=acc)
    threshold = torch.topk(acc.abs(), k, sorted=False).values.min()  # untimed: the exact k-th magnitude
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


def bench_chunk(n: int, density: float, world_size: int, repeats: int, device, chunk_size: int,
                pairs) -> list[dict]:
    """Chunked selection: encode vs the floor, decode + accumulate, bytes per entry, per codec pair."""
    measure, _ = _timer(device)
    generator = torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=generator).to(device)
    residual0 = (torch.randn(n, generator=generator) * 0.1).to(device)
    residual, acc = residual0.clone(), torch.empty_like(grad)

    def reset():
        residual.copy_(residual0)

    def floor_pass():
        torch.add(grad, residual, out=acc)

    rows = []
    for pair in pairs:
        index_codec, value_codec = pair.split("+")
        layout = ChunkLayout(n, chunk_size, density, index_codec, value_codec)
        payload = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
        encode, floor, encode_over_floor = _against_floor(
            device, floor_pass, lambda: ops.dispatch.chunk_encode(grad, residual, world_size, True, layout, payload),
            repeats, reset)
        # world_size different payloads: rank r's gradient is the bucket shifted by r entries x 104729.
        gathered = torch.empty(world_size * layout.nbytes, dtype=torch.uint8, device=device)
        for rank in range(world_size):
            shifted = torch.roll(grad, rank * 104_729)
            ops.dispatch.chunk_encode(shifted, None, world_size, False, layout,
                                      gathered[rank * layout.nbytes : (rank + 1) * layout.nbytes])
            del shifted
        decode = measure(lambda: ops.dispatch.chunk_decode_add(gathered, layout, acc, True), repeats)
        rows.append({
            "n": n, "density": density, "chunk_size": chunk_size, "world_size": world_size,
            "index_codec": index_codec, "value_codec": value_codec, "entries": layout.capacity,
            "encode_implementation": ops.dispatch._chunk_implementation("chunk_encode", grad, layout).__module__,
            "floor_seconds": floor, "encode_seconds": encode, "encode_over_floor": encode_over_floor,
            "decode_seconds": decode, "decode_entries_per_s": world_size * layout.capacity / decode,
            "bytes_per_entry": layout.bytes_per_entry,
        })
    return rows


def bench_compact(n: int, density: float, world_size: int, repeats: int, device, pairs) -> list[dict]:
    """Exact top-k on the compact wire: encode vs the floor, decode + accumulate, per codec pair."""
    measure, _ = _timer(device)
    generator = torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=generator).to(device)
    residual0 = (torch.randn(n, generator=generator) * 0.1).to(device)
    residual, acc = residual0.clone(), torch.empty_like(grad)

    def reset():
        residual.copy_(residual0)

    def floor_pass():
        torch.add(grad, residual, out=acc)

    rows = []
    for pair in pairs:
        index_codec, value_codec = pair.split("+")
        layout = ChunkLayout(n, n, density, index_codec, value_codec, scale_group=EXACT_SCALE_GROUP)
        payload = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
        encode, floor, encode_over_floor = _against_floor(
            device, floor_pass, lambda: ops.dispatch.chunk_encode(grad, residual, world_size, True, layout, payload),
            repeats, reset)
        gathered = torch.empty(world_size * layout.nbytes, dtype=torch.uint8, device=device)
        for rank in range(world_size):  # rank r's gradient: the bucket shifted by r x 104729 entries
            shifted = torch.roll(grad, rank * 104_729)
            ops.dispatch.chunk_encode(shifted, None, world_size, False, layout,
                                      gathered[rank * layout.nbytes : (rank + 1) * layout.nbytes])
            del shifted
        decode = measure(lambda: ops.dispatch.chunk_decode_add(gathered, layout, acc, True), repeats)
        rows.append({
            "n": n, "density": density, "scale_group": EXACT_SCALE_GROUP, "world_size": world_size,
            "index_codec": index_codec, "value_codec": value_codec, "entries": layout.capacity,
            "encode_implementation": ops.dispatch._chunk_implementation("chunk_encode", grad, layout).__module__,
            "floor_seconds": floor, "encode_seconds": encode, "encode_over_floor": encode_over_floor,
            "encode_bucket_entries_per_s": n / encode,
            "decode_seconds": decode, "decode_bucket_entries_per_s": n / decode,
            "decode_entries_per_s": world_size * layout.capacity / decode,
            "bytes_per_entry": layout.bytes_per_entry,
        })
    return rows


def _kernel_level() -> str:
    try:
        return native.cpu_capability()
    except RuntimeError as error:
        return f"none ({error})"


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
    info["cpu_kernel_level"] = _kernel_level()
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _print_exact(rows) -> None:
    print(f"fused: {rows[0]['fused_implementation']}, unpack: {rows[0]['unpack_implementation']}")
    print(f"{'n':>11} {'density':>7} {'floor':>7} {'copy':>7} {'fused':>7} {'f/floor':>7} {'ref':>8} {'ref/f':>6} "
          f"{'thr-pk':>7} {'unpack':>7} {'scatter':>7} {'M add/s':>7} {'zero':>6}")
    for r in rows:
        print(f"{r['n']:>11} {r['density']:>7g} {r['floor_seconds'] * 1e3:>7.1f} {r['copy_seconds'] * 1e3:>7.1f} "
              f"{r['fused_seconds'] * 1e3:>7.1f} {r['fused_over_floor']:>7.2f} {r['reference_seconds'] * 1e3:>8.1f} "
              f"{r['reference_over_fused']:>6.1f} {r['threshold_pack_seconds'] * 1e3:>7.1f} "
              f"{r['unpack_seconds'] * 1e3:>7.1f} {r['scatter_seconds'] * 1e3:>7.1f} "
              f"{r['scatter_adds_per_s'] / 1e6:>7.0f} {r['zero_seconds'] * 1e3:>6.1f}")
    print("times in ms; f/floor = fused / read-read-write pass; ref/f = torch.topk reference / fused; "
          "M add/s = scatter alone (unpack = zero + scatter)")


def _print_chunk(rows) -> None:
    if not rows:
        return
    print(f"chunked selection (chunk_size {rows[0]['chunk_size']}, world_size {rows[0]['world_size']}), "
          f"encode: {rows[0]['encode_implementation']}")
    print(f"{'n':>11} {'density':>7} {'codecs':>11} {'floor':>7} {'encode':>7} {'e/floor':>7} {'decode':>7} "
          f"{'M ent/s':>7} {'B/entry':>7}")
    for r in rows:
        print(f"{r['n']:>11} {r['density']:>7g} {r['index_codec'] + '+' + r['value_codec']:>11} "
              f"{r['floor_seconds'] * 1e3:>7.1f} {r['encode_seconds'] * 1e3:>7.1f} {r['encode_over_floor']:>7.2f} "
              f"{r['decode_seconds'] * 1e3:>7.1f} {r['decode_entries_per_s'] / 1e6:>7.0f} "
              f"{r['bytes_per_entry']:>7.3f}")
    print("times in ms; e/floor = fused chunk encode / read-read-write pass; decode = world_size payloads "
          "decoded and added onto zeros (zeroing included), M ent/s = payload entries per second")


def _print_compact(rows) -> None:
    if not rows:
        return
    print(f"exact top-k on the compact wire (one chunk, scales per {rows[0]['scale_group']} entries, world_size "
          f"{rows[0]['world_size']}), encode: {rows[0]['encode_implementation']}")
    print(f"{'n':>11} {'density':>7} {'codecs':>11} {'floor':>7} {'encode':>7} {'e/floor':>7} {'enc M/s':>7} "
          f"{'decode':>7} {'dec M/s':>7} {'M ent/s':>7} {'B/entry':>7}")
    for r in rows:
        print(f"{r['n']:>11} {r['density']:>7g} {r['index_codec'] + '+' + r['value_codec']:>11} "
              f"{r['floor_seconds'] * 1e3:>7.1f} {r['encode_seconds'] * 1e3:>7.1f} {r['encode_over_floor']:>7.2f} "
              f"{r['encode_bucket_entries_per_s'] / 1e6:>7.0f} {r['decode_seconds'] * 1e3:>7.1f} "
              f"{r['decode_bucket_entries_per_s'] / 1e6:>7.0f} {r['decode_entries_per_s'] / 1e6:>7.0f} "
              f"{r['bytes_per_entry']:>7.3f}")
    print("times in ms; e/floor = encode / read-read-write pass; enc M/s, dec M/s = M bucket entries per second; "
          "decode = world_size payloads decoded and added onto zeros (zeroing included), M ent/s = payload "
          "entries per second")


def _every_cpu_level(argv) -> int:
    """Runs this script once per CPU level this CPU supports (SPARSECOMM_CPU_CAPABILITY set),
    each writing its own JSON next to --out."""
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
    parser.add_argument("--world-size", type=int, default=2, help="payloads to unpack (>= 1)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per figure (>= 1)")
    parser.add_argument("--reference-repeats", type=int, default=1,
                        help="timed repeats of the slow pure-torch reference (>= 1)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads (>= 1)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    parser.add_argument("--chunk-size", type=int, default=4096, help="chunk size of the chunked rows (2..65536)")
    parser.add_argument("--chunk-pairs", nargs="*", default=list(CHUNK_PAIRS),
                        help="index+value codec pairs of the chunked rows (none: no chunked rows)")
    parser.add_argument("--only-chunk", action="store_true", help="only the chunked rows")
    parser.add_argument("--compact-pairs", nargs="*", default=list(COMPACT_PAIRS),
                        help="index+value codec pairs of the exact-top-k compact-wire rows (none: no such rows)")
    parser.add_argument("--only-compact", action="store_true", help="only the exact-top-k compact-wire rows")
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
    torch.set_num_threads(args.threads)
    only = args.only_chunk or args.only_compact
    rows = [] if only else [bench(int(n), d, args.world_size, args.repeats, args.reference_repeats, device)
                            for n in args.sizes for d in args.densities]
    chunk_rows = [] if args.only_compact else [
        row for n in args.sizes for d in args.densities
        for row in bench_chunk(int(n), d, args.world_size, args.repeats, device, args.chunk_size, args.chunk_pairs)]
    compact_rows = [] if args.only_chunk else [
        row for n in args.sizes for d in args.densities
        for row in bench_compact(int(n), d, args.world_size, args.repeats, device, args.compact_pairs)]
    machine = _machine(device)
    print(f"{describe_cpu()}; {args.threads} threads, device {device}, torch {torch.__version__}")
    print(f"CPU {machine.get('cpu_model', platform.processor())}; vector ISA {machine['vector_isa']}; "
          f"CPU kernels at level {machine['cpu_kernel_level']}")
    if rows:
        _print_exact(rows)
    _print_chunk(chunk_rows)
    _print_compact(compact_rows)
    args.out.write_text(json.dumps({**machine, "git_commit": _git_commit(), "rows": rows, "chunk_rows": chunk_rows,
                                    "compact_rows": compact_rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
