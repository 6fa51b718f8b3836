"""One rank of one paired run (arm x seed): train, measure every step, write the results.

Pairing: for a given seed every arm starts from the same weights (the RNG is seeded
before the model is built) and sees the same global batches (sample ids drawn from a
stream seeded by (seed, step)); rank r trains on slice r of each global batch, so ranks
see different data. Rank 0 writes ``steps.jsonl`` as it goes and ``summary.json`` at the
end (see :mod:`sparsecomm.results` for the format).
"""
import argparse
import json
import os
import sys
import statistics
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from sparsecomm.experiment.arms import HookMeter, make_arm_hook
from sparsecomm.experiment.config import ExperimentConfig
from sparsecomm.tasks import get_task

# Large odd multiplier so that (seed, step) pairs never share a sample stream.
_STEP_STREAM = 0x9E3779B97F4A7C15


def global_batch(config: ExperimentConfig, num_samples: int, seed: int, step: int) -> torch.Tensor:
    """Sample ids of the global batch of ``step``: same in every arm, random access by step."""
    generator = torch.Generator().manual_seed((seed * _STEP_STREAM + step) % (2**63 - 1))
    return torch.randint(num_samples, (config.world_size * config.batch_size,), generator=generator)


def make_optimizer(config: ExperimentConfig, params) -> torch.optim.Optimizer:
    if config.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)


def train_run(config: ExperimentConfig, arm: str, seed: int, out_dir: Path | None, launch_wall_time: float) -> dict:
    """Train one run on an initialised process group; returns the summary (all ranks)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    task = get_task(config.task)
    torch.manual_seed(seed)
    model = task.build_model()
    ddp = DDP(model, bucket_cap_mb=config.bucket_cap_mb)
    arm_hook = make_arm_hook(arm, config, ddp, seed)
    meter = HookMeter(arm_hook)
    meter.register(ddp)
    optimizer = make_optimizer(config, ddp.parameters())
    writer = open(out_dir / "steps.jsonl", "w") if rank == 0 and out_dir is not None else None
    rows, evals = [], []
    first_touch_wall = time.time()
    first_touch = time.perf_counter()
    try:
        for step in range(1, config.steps + 1):
            started = time.perf_counter()
            ids = global_batch(config, task.num_train_samples, seed, step)
            inputs, targets = task.train_batch(ids[rank * config.batch_size : (rank + 1) * config.batch_size])
            loss = task.loss(ddp, inputs, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            backward_done = time.perf_counter()
            optimizer.step()
            finished = time.perf_counter()
            measured = meter.take_step()
            # Outside the timed region: the mean loss over ranks, for the record.
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            comm_wait = max(0.0, backward_done - measured["last_hook_return"]) if measured["last_hook_return"] else 0.0
            row = {
                "kind": "train",
                "step": step,
                "train_loss": mean_loss.item() / world_size,
                "step_seconds": finished - started,
                "compute_seconds": finished - started - measured["hook_seconds"] - comm_wait,
                "compress_seconds": measured["hook_seconds"],
                "comm_wait_seconds": comm_wait,
                "bytes_sent": measured["bytes_sent"],
                "bytes_dense": measured["bytes_dense"],
                "elapsed_seconds": time.perf_counter() - first_touch,
            }
            rows.append(row)
            _write(writer, row)
            if step % config.eval_every == 0 or step == config.steps:
                val_loss = task.val_loss(model)
                evals.append([step, time.perf_counter() - first_touch, val_loss])
                _write(writer, {"kind": "eval", "step": step, "val_loss": val_loss, "elapsed_seconds": evals[-1][1]})
    finally:
        if writer is not None:
            writer.close()
    steady = rows[config.warmup_steps :] or rows  # warm-up steps are dense in every arm

    def median(key):
        return statistics.median(r[key] for r in steady)

    summary = {
        "arm": arm,
        "seed": seed,
        "status": "ok",
        "config_hash": config.run_hash(arm, seed),
        "hook": arm_hook.description,
        "setup_seconds": first_touch_wall - launch_wall_time,
        "median_step_seconds": median("step_seconds"),
        "median_compute_seconds": median("compute_seconds"),
        "median_compress_seconds": median("compress_seconds"),
        "median_comm_wait_seconds": median("comm_wait_seconds"),
        "bytes_sent_per_step": statistics.fmean(r["bytes_sent"] for r in steady),
        "bytes_dense_per_step": statistics.fmean(r["bytes_dense"] for r in steady),
        "total_seconds": rows[-1]["elapsed_seconds"],
        "evals": evals,
        "hook_stats": arm_hook.stats(arm_hook.state),
        "world_size": world_size,
        "torch_version": torch.__version__,
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }
    if rank == 0 and out_dir is not None:
        write_json_atomically(out_dir / "summary.json", summary)
    return summary


def _write(writer, row: dict) -> None:
    if writer is not None:
        writer.write(json.dumps(row) + "\n")
        writer.flush()


def write_json_atomically(path: Path, payload: dict) -> None:
    """Write to a temporary file and rename: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    """Entry point of one rank under torchrun: ``python -m sparsecomm.experiment.worker``."""
    parser = argparse.ArgumentParser(prog="python -m sparsecomm.experiment.worker")
    parser.add_argument("--experiment-json", required=True, type=Path, help="experiment.json of the run directory")
    parser.add_argument("--arm", required=True)
    parser.add_argument("--seed", required=True, type=int)
    parser.add_argument("--out", required=True, type=Path, help="this run's directory")
    parser.add_argument("--launch-time", required=True, type=float, help="wall clock (time.time()) at launch")
    args = parser.parse_args(argv)
    config = ExperimentConfig.from_dict(json.loads(args.experiment_json.read_text())["config"])
    torch.set_num_threads(1)  # ranks share the machine's cores, as torchrun arranges
    dist.init_process_group("gloo", timeout=timedelta(seconds=config.collective_timeout_s))
    try:
        train_run(config, args.arm, args.seed, args.out, args.launch_time)
        dist.barrier()  # no rank leaves while another still has a collective in flight
    finally:
        dist.destroy_process_group()
    # Skip interpreter teardown: gloo/DDP threads destroyed there occasionally abort the
    # process ("terminate called without an active exception", SIGABRT) after all work is
    # done and the summary is written, which torchrun would report as a failed run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
