"""Bytes per rank and wall time of the exchanges: dense allreduce, all-gather, owner, shared-index.

Measured (p = 2, 4, 8 gloo ranks on this machine, on loopback and on emulated links, one
network namespace per rank): one DDP bucket of n float32 gradients (an ``nn.Linear``
without bias, so compute is one small matmul) reduced by ``dense`` (DDP's own allreduce),
``allgather`` and ``owner`` (the top-k hook with ``selector="chunk"`` and the given index
and value codecs) and ``shared-index`` (the same selection and index codec; bf16 values,
since an allreduce cannot sum quantized codes) at each density. Per exchange:

* sent, received   bytes this rank put on / took off the wire per step, from the hook's
                   counters (``stats()["last_step"]``; dense: 2 (p-1)/p x the buffer, what
                   a ring moves), the mean over ranks;
* exchange ms      median over steps of backward() with the exchange, minus backward()
                   with a hook that returns the bucket untouched (same model, same
                   process): select + encode + collectives + decode;
* recv / allgather received bytes against the all-gather's at the same density.

Modelled from loopback (for every emulated link): the loopback time plus the bytes term of
the cost model on the link's rate (its alpha terms are in the loopback figure), against
what was measured on the link: the cost model's error.

Modelled (p = 16 ... 1024, no processes): bytes received per rank from the layouts, and
seconds on a link of ``--link-gbit`` Gb/s with ``--alpha-us`` per message, from
``sparsecomm.lab.costmodel`` (labelled ``[modelled]``).

    python experiments/bench_exchange.py --numel 4e6 --densities 0.01 0.001 --ranks 2 4 8
    python experiments/bench_exchange.py --links loopback 1gbit --ranks 4 8     (root: emulated links)
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

import torch
import torch.distributed as dist

from cpu_info import describe_cpu  # experiments/cpu_info.py, beside this script
from sparsecomm import register_topk_hook
from sparsecomm.lab import costmodel
from sparsecomm.compress.chunk_layout import ChunkLayout
from sparsecomm.compress.owner_layout import OwnerLayout
from sparsecomm.links import parse_link
from sparsecomm.links.netns import INTERFACE, check_emulation_possible, maybe_emulated

EXCHANGES = ("dense", "allgather", "owner", "shared-index")
SHARED_INDEX_VALUES = torch.bfloat16  # the shared-index exchange sums its values: a float wire


def _untouched(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _backward_ms(ddp, x, steps: int) -> list[float]:
    samples = []
    for _ in range(steps):
        ddp.zero_grad(set_to_none=True)
        loss = ddp(x).sum()
        started = time.perf_counter()
        loss.backward()
        samples.append((time.perf_counter() - started) * 1e3)
    return samples


def _rank(rank, world_size, workdir, config):
    """One rank (a process of its own, in its namespace when the link is emulated)."""
    store = dist.FileStore(os.path.join(workdir, "store"), world_size)  # a file: reachable from every namespace
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    side = int(round(config["numel"] ** 0.5))
    x = torch.randn(4, side, generator=torch.Generator().manual_seed(rank))
    rows = []
    baseline_model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(side, side, bias=False),
                                                               bucket_cap_mb=1e4)
    baseline_model.register_comm_hook(None, _untouched)
    baseline = statistics.median(_backward_ms(baseline_model, x, config["steps"] + 2)[2:])
    for density in config["densities"]:
        for exchange in EXCHANGES:
            torch.manual_seed(0)
            ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(side, side, bias=False),
                                                            bucket_cap_mb=1e4)
            state = None
            if exchange != "dense":
                values = ({"value_dtype": SHARED_INDEX_VALUES} if exchange == "shared-index"
                          else {"value_codec": config["value_codec"]})
                state = register_topk_hook(ddp, density=density, selector="chunk", chunk_size=config["chunk_size"],
                                           index_codec=config["index_codec"], exchange=exchange,
                                           allow_dense_fallback=False, **values)
            samples = _backward_ms(ddp, x, config["steps"] + 3)[3:]  # past the warm-up and DDP's rebuild
            if state is None:
                nbytes = side * side * 4
                sent, received = nbytes, 2 * (world_size - 1) * nbytes / world_size
            else:
                last = state.stats()["last_step"]
                sent, received = last["bytes_sent"], last["bytes_received"]
            rows.append({"density": density, "exchange": exchange, "sent": sent, "received": received,
                         "exchange_ms": statistics.median(samples) - baseline})
            del ddp, state
    with open(os.path.join(workdir, f"rank{rank}.json"), "w") as f:
        json.dump(rows, f)
    dist.barrier()
    os._exit(0)


def measure(world_size: int, config: dict, link) -> list[dict]:
    """Every rank's rows, averaged over ranks: p processes on loopback or on an emulated link."""
    with tempfile.TemporaryDirectory() as workdir, maybe_emulated(link, world_size) as network:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            json.dump(config, f)
        procs = []
        for r in range(world_size):
            argv = [sys.executable, os.path.abspath(__file__), "--worker", str(r), str(world_size), workdir]
            env = dict(os.environ)
            if network is not None:
                argv, env["GLOO_SOCKET_IFNAME"] = network.command(r, argv), INTERFACE
            procs.append(subprocess.Popen(argv, env=env))
        deadline = time.monotonic() + config["timeout"]
        for p in procs:
            try:
                p.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        per_rank = []
        for r in range(world_size):
            path = os.path.join(workdir, f"rank{r}.json")
            if not os.path.exists(path):
                raise RuntimeError(f"p={world_size} on {link}: rank {r} produced no result (exit code "
                                   f"{procs[r].returncode})")
            with open(path) as f:
                per_rank.append(json.load(f))
    rows = []
    for position, row in enumerate(per_rank[0]):
        group = [ranks[position] for ranks in per_rank]
        rows.append({**row, "p": world_size, "sent": statistics.mean(g["sent"] for g in group),
                     "received": statistics.mean(g["received"] for g in group),
                     "exchange_ms": max(g["exchange_ms"] for g in group)})  # the slowest rank sets the step
    return rows


def modelled(p: int, config: dict, density: float) -> list[dict]:
    numel = config["numel"]
    payload = ChunkLayout(numel, config["chunk_size"], density, config["index_codec"], config["value_codec"]).nbytes
    owner = OwnerLayout(numel, config["chunk_size"], density, config["index_codec"], config["value_codec"], p)
    rate, alpha = config["link_gbit"] * 1e9 / 8, config["alpha_us"] * 1e-6
    dense_bytes = numel * 4
    rows = []
    for exchange in EXCHANGES:
        if exchange == "owner":
            received = (p - 1) * (statistics.mean(owner.part_nbytes) + owner.slot_nbytes)
            seconds = costmodel.owner_exchange_seconds(payload, p, rate_bytes_per_s=rate, alpha_s=alpha)
        elif exchange == "shared-index":
            index_bytes, values = _shared_index_bytes(config, density)
            received = index_bytes * (p - 1) / p + 2 * (p - 1) / p * values  # the leader rotates
            seconds = (costmodel.broadcast_seconds(index_bytes, p, rate_bytes_per_s=rate, alpha_s=alpha)
                       + costmodel.ring_allreduce_seconds(values, p, rate_bytes_per_s=rate, alpha_s=alpha))
        else:
            received = costmodel.exchange_bytes_received(exchange, payload, dense_bytes, p)
            seconds = (costmodel.ring_allreduce_seconds(dense_bytes, p, rate_bytes_per_s=rate, alpha_s=alpha)
                       if exchange == "dense" else
                       costmodel.ring_allgather_seconds(payload, p, rate_bytes_per_s=rate, alpha_s=alpha))
        rows.append({"p": p, "density": density, "exchange": exchange, "received": received,
                     "seconds": seconds})
    return rows


def _format_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _shared_index_bytes(config: dict, density: float) -> tuple[int, int]:
    """(index region the leader broadcasts, value bytes every rank allreduces)."""
    layout = ChunkLayout(config["numel"], config["chunk_size"], density, config["index_codec"], "fp32")
    return layout.index_bytes, layout.capacity * SHARED_INDEX_VALUES.itemsize


def bandwidth_seconds(exchange: str, p: int, payload: float, dense_bytes: float, rate: float,
                      shared: tuple[int, int] = (0, 0)) -> float:
    """The bytes term of each exchange's cost (costmodel with alpha = 0)."""
    if exchange == "shared-index":
        return (costmodel.broadcast_seconds(shared[0], p, rate_bytes_per_s=rate, alpha_s=0.0)
                + costmodel.ring_allreduce_seconds(shared[1], p, rate_bytes_per_s=rate, alpha_s=0.0))
    if exchange == "dense":
        return costmodel.ring_allreduce_seconds(dense_bytes, p, rate_bytes_per_s=rate, alpha_s=0.0)
    if exchange == "owner":
        return costmodel.owner_exchange_seconds(payload, p, rate_bytes_per_s=rate, alpha_s=0.0)
    return costmodel.ring_allgather_seconds(payload, p, rate_bytes_per_s=rate, alpha_s=0.0)


def _payload(config: dict, density: float) -> int:
    return ChunkLayout(config["numel"], config["chunk_size"], density, config["index_codec"],
                       config["value_codec"]).nbytes


def print_measured(rows: list[dict], link) -> None:
    for row in rows:
        gather = next(r for r in rows if r["density"] == row["density"] and r["exchange"] == "allgather"
                      and r["p"] == row["p"])
        print(f"[measured, {link}] {row['p']:>3} {row['density']:>8g} {row['exchange']:>10} "
              f"{_format_bytes(row['sent']):>11} {_format_bytes(row['received']):>11} "
              f"{row['received'] / gather['received']:>14.2f}x {row['exchange_ms']:>12.1f}")


def print_predictions(loopback: list[dict], emulated: list[dict], link, config: dict) -> None:
    """The emulated link's exchange time predicted from loopback: loopback ms + the bytes term
    on the link (the alpha terms are in the loopback figure), against what was measured."""
    print(f"\n[modelled from loopback vs measured, {link}] {'p':>3} {'density':>8} {'exchange':>10} "
          f"{'predicted ms':>13} {'measured ms':>12} {'error':>7}")
    base = {(r["p"], r["density"], r["exchange"]): r["exchange_ms"] for r in loopback}
    for row in emulated:
        key = (row["p"], row["density"], row["exchange"])
        if key not in base:
            continue
        extra = bandwidth_seconds(row["exchange"], row["p"], _payload(config, row["density"]), config["numel"] * 4,
                                  link.bytes_per_s, _shared_index_bytes(config, row["density"]))
        predicted = base[key] + extra * 1e3
        print(f"[modelled from loopback vs measured, {link}] {row['p']:>3} {row['density']:>8g} {row['exchange']:>10} "
              f"{predicted:>13.1f} {row['exchange_ms']:>12.1f} {predicted / row['exchange_ms'] - 1:>+7.0%}")


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        rank, world_size, workdir = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
        with open(os.path.join(workdir, "config.json")) as f:
            _rank(rank, world_size, workdir, json.load(f))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=float, default=4e6, help="gradient entries in the bucket (default 4e6)")
    parser.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.001])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8], help="measured world sizes")
    parser.add_argument("--links", nargs="+", default=["loopback"],
                        help="links to measure on: loopback (default) and emulated ones, e.g. 1gbit (needs root)")
    parser.add_argument("--modelled-ranks", type=int, nargs="*", default=[16, 32, 64, 256, 1024])
    parser.add_argument("--chunk-size", type=int, default=4096)
    parser.add_argument("--index-codec", default="rice")
    parser.add_argument("--value-codec", default="int2")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per exchange (median)")
    parser.add_argument("--link-gbit", type=float, default=1.0, help="modelled link rate (default 1 Gb/s)")
    parser.add_argument("--alpha-us", type=float, default=50.0, help="modelled latency per message (default 50 us)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per measured world size and link")
    parser.add_argument("--json", help="also write every row to this file")
    args = parser.parse_args(argv)
    if args.numel < args.chunk_size or any(not 0 < d <= 1 for d in args.densities):
        parser.error("--numel must be >= --chunk-size and every density in (0, 1]")
    try:
        links = [parse_link(text) for text in args.links]
        for link in links:
            check_emulation_possible(link)
    except (ValueError, RuntimeError) as error:
        parser.error(f"--links: {error}")
    config = {"numel": int(round(args.numel ** 0.5)) ** 2, "densities": args.densities, "chunk_size": args.chunk_size,
              "index_codec": args.index_codec, "value_codec": args.value_codec, "steps": args.steps,
              "link_gbit": args.link_gbit, "alpha_us": args.alpha_us, "timeout": args.timeout}
    print(describe_cpu())
    print(f"bucket: {config['numel']} float32 entries ({_format_bytes(config['numel'] * 4)}), chunks of "
          f"{args.chunk_size}, {args.index_codec} indices + {args.value_codec} values; gloo")
    measured_rows = {}
    for link in links:
        print(f"\n[measured, {link}] {'p':>3} {'density':>8} {'exchange':>10} {'sent/rank':>11} {'recv/rank':>11} "
              f"{'recv/allgather':>15} {'exchange ms':>12}")
        rows = []
        for p in args.ranks:
            measured = measure(p, config, link)
            print_measured(measured, link)
            rows += measured
        measured_rows[str(link)] = rows
    loopback = measured_rows.get("loopback")
    for link in links:
        if link.emulated and loopback:
            print_predictions(loopback, measured_rows[str(link)], link, config)
    modelled_rows = []
    print(f"\n[modelled, {args.link_gbit:g} Gb/s, {args.alpha_us:g} us/message] {'p':>5} {'density':>8} "
          f"{'exchange':>10} {'recv/rank':>11} {'vs dense':>9} {'seconds':>9}")
    for p in args.modelled_ranks:
        for density in args.densities:
            rows = modelled(p, config, density)
            modelled_rows += rows
            dense = rows[0]["received"]
            for row in rows:
                print(f"[modelled, {args.link_gbit:g} Gb/s, {args.alpha_us:g} us/message] {p:>5} {density:>8g} "
                      f"{row['exchange']:>10} {_format_bytes(row['received']):>11} {dense / row['received']:>8.1f}x "
                      f"{row['seconds']:>9.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": config, "measured": measured_rows, "modelled": modelled_rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
