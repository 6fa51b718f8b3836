"""Run by tests/test_mpi_transport.py as ``mpiexec -n 2 python transport.py OUT_DIR``.

Each rank writes ``OUT_DIR/rank{r}.json`` with what it observed; the test asserts on it.

1. The transport alone: variable counts per rank (one rank sends nothing), float32 and
   bfloat16, several requests in flight, the Future's tensor sharing ``recv``'s memory,
   and errors for misuse.
2. DDP training with the hook, each rank on different data: exact top-k over MPI and over
   c10d (same math, so the same parameters bit for bit), and the sampled selector over
   MPI, which sends a different number of entries per rank; every reduced bucket is
   compared with the rank-order sum of what each rank says it sent, and the fused kernel
   path (no observers) must train to the same bits.
"""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm
from sparsecomm.comm import MPIAllgatherv
from sparsecomm.dist import init_distributed, shutdown

STEPS = 8
# Buckets of ~13k float32 entries: above the sampled selector's 4096-entry sample, so its
# threshold is an estimate and the counts differ per rank; several buckets are in flight.
BUCKET_CAP_MB = 0.05


def transport_checks(rank: int, world_size: int) -> dict:
    transport = MPIAllgatherv()
    report = {}
    for dtype, sizes in ((torch.float32, [0, 5]), (torch.bfloat16, [3, 7])):
        send = (torch.arange(sizes[rank]) + 100 * rank).to(dtype)
        counts = transport.allgather_counts(send.numel())
        recv = torch.full((sum(counts) + 4,), -1.0, dtype=dtype)
        gathered = transport.allgatherv(send, recv, counts).wait()
        expected = torch.cat([(torch.arange(n) + 100 * r).to(dtype) for r, n in enumerate(sizes)])
        report[str(dtype)] = {
            "counts": counts,
            "gathered": gathered.float().tolist(),
            "expected": expected.float().tolist(),
            "shares_recv_memory": gathered.data_ptr() == recv.data_ptr(),
            "tail_untouched": bool(recv[sum(counts):].eq(-1).all()),
        }
    # Several requests in flight, waited for in reverse order.
    futures, expectations = [], []
    for i in range(4):
        n = 1000 * (i + 1) + 17 * rank
        counts = [1000 * (i + 1) + 17 * r for r in range(world_size)]
        send = torch.full((n,), float(10 * i + rank))
        futures.append(transport.allgatherv(send, torch.empty(sum(counts)), counts))
        expectations.append(torch.cat([torch.full((c,), float(10 * i + r)) for r, c in enumerate(counts)]))
    report["in_flight_equal"] = [torch.equal(f.wait(), e) for f, e in reversed(list(zip(futures, expectations)))]
    errors = {}
    for name, call in {
        "count_mismatch": lambda: transport.allgatherv(torch.zeros(3), torch.zeros(10), [2] * world_size),
        "recv_too_small": lambda: transport.allgatherv(torch.zeros(3), torch.zeros(5), [3] * world_size),
        "wrong_number_of_counts": lambda: transport.allgatherv(torch.zeros(3), torch.zeros(9), [3]),
        "dtype_mismatch": lambda: transport.allgatherv(torch.zeros(3), torch.zeros(9, dtype=torch.float64),
                                                       [3] * world_size),
    }.items():
        try:
            call()
            errors[name] = None
        except ValueError as error:
            errors[name] = str(error)
    report["errors"] = errors
    transport.close()
    return report


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 128),
                         nn.Tanh(), nn.Linear(128, 1))


def _batches(rank: int):
    generator = torch.Generator().manual_seed(1000 + rank)  # different data on every rank
    return [(torch.randn(16, 32, generator=generator), torch.randn(16, 1, generator=generator))
            for _ in range(STEPS)]


class Recorder:
    """Per (step, bucket): the entries this rank sent (decoded from its payload) and the reduced bucket."""

    def __init__(self):
        self.sent, self.reduced, self.counts = {}, {}, {}

    def __call__(self, event):
        key = (event.step, event.bucket_index)
        if event.stage == "packed" and not event.dense:
            indices, payload = event.tensors["indices"], event.tensors["payload"]
            m = indices.numel()
            values = payload[4 * m : 8 * m].view(torch.float32)
            sent = torch.zeros_like(event.tensors["acc"])
            sent[payload[: 4 * m].view(torch.int32).long()] = values
            self.sent[key], self.counts[key] = sent, m
        elif event.stage == "reduced" and key in self.sent:
            self.reduced[key] = event.tensors["reduced"].clone()


def train(rank: int, transport: str, selector: str, recorder: Recorder | None = None, **settings):
    model = DDP(_model(), bucket_cap_mb=BUCKET_CAP_MB)
    # budget="bucket" on both transports: MPI's cannot share one budget (its counts are all-reduced over c10d)
    state = sparsecomm.register_topk_hook(model, density=0.02, selector=selector, transport=transport,
                                          allow_dense_fallback=False, verify_conservation=recorder is not None,
                                          budget="bucket", momentum=0, **settings)
    if recorder is not None:
        state.add_observer(recorder)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in _batches(rank):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    return params, losses, state.stats()


def training_checks(rank: int, world_size: int) -> dict:
    report = {}
    c10d_params, c10d_losses, _ = train(rank, "c10d", "exact")
    mpi_params, mpi_losses, mpi_stats = train(rank, "mpi", "exact")
    report["exact"] = {
        "params_equal": torch.equal(c10d_params, mpi_params),
        "max_abs_diff": (c10d_params - mpi_params).abs().max().item(),
        "losses_c10d": c10d_losses, "losses_mpi": mpi_losses,
        "sparse_calls": mpi_stats["sparse_calls"], "transport": mpi_stats["transport"],
    }
    owner = {"exchange": "owner", "chunk_size": 256, "index_codec": "rice", "value_codec": "int4"}
    c10d_params, c10d_losses, _ = train(rank, "c10d", "chunk", **owner)
    mpi_params, mpi_losses, mpi_stats = train(rank, "mpi", "chunk", **owner)
    report["owner"] = {
        "params_equal": torch.equal(c10d_params, mpi_params),
        "max_abs_diff": (c10d_params - mpi_params).abs().max().item(),
        "losses_c10d": c10d_losses, "losses_mpi": mpi_losses,
        "owner_calls": mpi_stats["owner_calls"], "sparse_calls": mpi_stats["sparse_calls"],
    }
    recorder = Recorder()
    params, losses, stats = train(rank, "mpi", "sampled", recorder)
    # Every reduced bucket must be the rank-order sum of what each rank sent, bit for bit.
    mismatched = []
    for key in sorted(recorder.sent):
        parts = [torch.empty_like(recorder.sent[key]) for _ in range(world_size)]
        dist.all_gather(parts, recorder.sent[key])
        total = torch.zeros_like(parts[0])
        for part in parts:
            total += part
        if not torch.equal(total, recorder.reduced[key]):
            mismatched.append(list(key))
    # Without observers or the audit the hook takes the fused kernel path: same bits.
    fused_params, _, _ = train(rank, "mpi", "sampled")
    replica = params.clone()
    dist.broadcast(replica, src=0)
    report["sampled"] = {
        "counts": {f"{step},{bucket}": m for (step, bucket), m in sorted(recorder.counts.items())},
        "buckets_checked": len(recorder.sent),
        "mismatched_buckets": mismatched,
        "replicas_equal": torch.equal(params, replica),
        "fused_equals_observed": torch.equal(fused_params, params),
        "losses": losses,
        "stats": stats,
    }
    return report


def main(out_dir: str) -> None:
    info = init_distributed()
    report = {"launch": [info.launcher, info.rank, info.world_size]}
    report["transport"] = transport_checks(info.rank, info.world_size)
    report["training"] = training_checks(info.rank, info.world_size)
    with open(os.path.join(out_dir, f"rank{info.rank}.json"), "w") as f:
        json.dump(report, f)
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
