"""Bytes per selected entry of every wire format, and the cost of the reference codecs.

For one bucket of n float32 entries (a gradient-like mix of magnitudes) at a density, each
(index codec, value codec) pair encodes the bucket through the pure-torch reference
(``ChunkLayout.encode``) and reports:

* bytes/entry   every payload byte (bf16 scales, indices, values, padding) / entries sent
* x fewer       8 / bytes-per-entry: against today's int32 index + fp32 value
* encode, decode  reference seconds, and encode / floor, the floor being ``acc = grad +
  residual`` (read, read, write) on the same machine in the same run

The sizes come from encoding, not from a formula: the payload is what the hook sends.

    python experiments/bench_wire.py --size 25e6 --density 0.01
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

from cpu_info import describe_cpu  # experiments/cpu_info.py, beside this script
from sparsecomm.compress.chunk_layout import ChunkLayout
from sparsecomm.compress.index_codecs import INDEX_CODECS
from sparsecomm.compress.value_codecs import VALUE_CODECS


def gradient_like(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 2)


def _seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return sorted(samples)[len(samples) // 2]


def wire_table(n: int, density: float, chunk_size: int, value_codecs=VALUE_CODECS, index_codecs=INDEX_CODECS,
               repeats: int = 1, timed: bool = True) -> list[dict]:
    acc = gradient_like(n)
    residual = torch.empty_like(acc)
    other = torch.empty_like(acc)
    floor = _seconds(lambda: torch.add(acc, residual, out=other), 3) if timed else None
    rows = []
    for index_codec in index_codecs:
        for value_codec in value_codecs:
            layout = ChunkLayout(n, chunk_size, density, index_codec, value_codec)
            payload = torch.empty(layout.nbytes, dtype=torch.uint8)
            indices, _ = layout.encode(acc, residual, payload)
            row = {"index_codec": index_codec, "value_codec": value_codec, "entries": indices.numel(),
                   "payload_bytes": payload.numel(), "bytes_per_entry": payload.numel() / indices.numel()}
            if timed:
                row["encode_s"] = _seconds(lambda: layout.encode(acc, residual, payload), repeats)
                row["decode_s"] = _seconds(lambda: layout.decode(payload), repeats)
                row["encode_over_floor"] = row["encode_s"] / floor
            rows.append(row)
    return rows


def print_table(rows, n, density, chunk_size) -> None:
    print(f"wire formats: n={n:.3g} density={density} chunk_size={chunk_size} (reference codecs, pure torch)")
    timed = "encode_s" in rows[0]
    print(f"{'index':>6} {'value':>5} {'B/entry':>8} {'x fewer':>8}" +
          (f" {'encode s':>9} {'decode s':>9} {'enc/floor':>9}" if timed else ""))
    for row in rows:
        line = f"{row['index_codec']:>6} {row['value_codec']:>5} {row['bytes_per_entry']:8.3f} " \
               f"{8 / row['bytes_per_entry']:8.2f}"
        if timed:
            line += f" {row['encode_s']:9.3f} {row['decode_s']:9.3f} {row['encode_over_floor']:9.1f}"
        print(line)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=float, default=25e6, help="entries in the bucket (>= 1)")
    parser.add_argument("--density", type=float, default=0.01, help="fraction in (0, 1]")
    parser.add_argument("--chunk-size", type=int, default=4096, help="2..65536")
    parser.add_argument("--repeats", type=int, default=1, help="timed repeats per figure (>= 1)")
    parser.add_argument("--no-timing", action="store_true", help="sizes only (fast)")
    parser.add_argument("--out", type=Path, default=Path("bench_wire.json"), help="JSON result file")
    args = parser.parse_args(argv)
    if args.size < 1 or not 0 < args.density <= 1 or not 2 <= args.chunk_size <= 65536 or args.repeats < 1:
        parser.error("--size must be >= 1, --density in (0, 1], --chunk-size in [2, 65536], --repeats >= 1")
    n = int(args.size)
    print(describe_cpu(), f"| torch threads {torch.get_num_threads()}")
    rows = wire_table(n, args.density, args.chunk_size, repeats=args.repeats, timed=not args.no_timing)
    print_table(rows, n, args.density, args.chunk_size)
    args.out.write_text(json.dumps({"cpu": describe_cpu(), "n": n, "density": args.density,
                                    "chunk_size": args.chunk_size, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
