"""One rank of one paired run (arm x seed): train, measure every step, write the results.

Pairing: for a given seed every arm starts from the same weights (the RNG is seeded
before the model is built) and sees the same global batches (sample ids drawn from a
stream seeded by (seed, step)); rank r trains on slice r of each global batch, so ranks
see different data. Rank 0 writes ``steps.jsonl`` as it goes and ``summary.json`` at the
end (see :mod:`sparsecomm.lab.results` for the format).

Started by the runner (``python -m sparsecomm.lab.experiment.worker``), a rank writes its
summary to ``result.json`` instead, which the runner promotes to ``summary.json`` only when
every process of the launch exited cleanly: a run the runner killed (interrupted, stalled)
can never turn "ok" afterwards. A rank that raises writes ``error-rank<r>.json`` (type,
message, last frames) before it exits, so the runner records the rank's own error rather
than the launcher's. Each row of ``steps.jsonl`` is one ``write`` of a whole line after
its step completed; a reader drops a torn last line (:mod:`sparsecomm.lab.experiment.steps_log`), and a resume
cuts the file back to the checkpoint's step (atomically).
"""
import argparse
import json
import os
import sys
import statistics
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from sparsecomm.averaging import NonFiniteSyncError
from sparsecomm.lab.experiment.arm_spec import BETA2_DEFAULT
from sparsecomm.lab.experiment.arms import NOTHING_AFTER, HookMeter, after_optimizer_step, make_arm_hook
from sparsecomm.checkpoint import CheckpointManager, rebuild_buckets
from sparsecomm.dist import discover, init_distributed
from sparsecomm.lab.experiment.config import ExperimentConfig
from sparsecomm.lab.experiment.files import write_json_atomically
from sparsecomm.lab.experiment.process_tree import LAUNCH_ENV, die_with_parent
from sparsecomm.lab.experiment.rank_errors import write_rank_error
from sparsecomm.lab.experiment.steps_log import STEPS_FILE, StepLog, read_steps, rows_up_to, write_steps_atomically
from sparsecomm.hooks import TopKState, dgc_optimizer
from sparsecomm.optim.sign_sgd import SignSGD
from sparsecomm.optim import AdamS
from sparsecomm.monitor import CorruptionDetected, ReplicaDigestMonitor, StalenessMonitor, flip_bit
from sparsecomm.lab.results.layout import CHECKPOINTS_DIR, FAULT_FILE, RESULT_FILE, SUMMARY_FILE
from sparsecomm.lab.tasks import get_task


# Large odd multiplier so that (seed, step) pairs never share a sample stream.
_STEP_STREAM = 0x9E3779B97F4A7C15


def global_batch(config: ExperimentConfig, num_samples: int, seed: int, step: int) -> torch.Tensor:
    """Sample ids of the global batch of ``step``: same in every arm, random access by step."""
    generator = torch.Generator().manual_seed((seed * _STEP_STREAM + step) % (2**63 - 1))
    return torch.randint(num_samples, (config.world_size * config.batch_size,), generator=generator)


def make_optimizer(config: ExperimentConfig, params, arm: str = "dense") -> torch.optim.Optimizer:
    """The optimizer of ``arm``: the experiment's, with the arm's changes; without momentum of
    its own when the arm's hook corrects momentum (topk-dgc)."""
    return optimizer_for_spec(config.arm(arm), params)


def optimizer_for_spec(spec, params) -> torch.optim.Optimizer:
    settings = spec.optimizer
    if settings["optimizer"] == "signsgd":  # the sign mode: no momentum to take out
        return SignSGD(params, lr=settings["lr"], weight_decay=settings["weight_decay"])
    beta2 = settings.get("beta2", BETA2_DEFAULT)
    if spec.momentum_correction:
        return dgc_optimizer(params, settings["optimizer"], lr=settings["lr"], weight_decay=settings["weight_decay"],
                             beta2=beta2)
    if settings["optimizer"] == "adamw":
        return torch.optim.AdamW(params, lr=settings["lr"], betas=(0.9, beta2), weight_decay=settings["weight_decay"])
    if settings["optimizer"] == "adams":  # at AdamW's beta1 and eps (under momentum correction: refused)
        return AdamS(params, lr=settings["lr"], betas=(0.9, beta2), weight_decay=settings["weight_decay"])
    return torch.optim.SGD(params, lr=settings["lr"], momentum=settings["momentum"],
                           weight_decay=settings["weight_decay"])


def _probe(task, config: ExperimentConfig):
    """Loss of a fixed batch: the checkpoint's semantic fingerprint (exact on CPU)."""
    ids = global_batch(config, task.num_train_samples, seed=2**20, step=0)[: config.batch_size]
    inputs, targets = task.train_batch(ids)

    def probe(module) -> float:
        with torch.no_grad():
            return task.loss(module, inputs, targets).item()

    return probe


def _resume(checkpoints: CheckpointManager, out_dir: Path | None, rank: int) -> tuple[int, dict, list, list]:
    """Restore the latest checkpoint if there is one (a restart, a re-run, a rollback);
    returns (step, ledger counters, train rows, evals) as they were at that step."""
    if checkpoints.latest_step() is None:
        return 0, {}, [], []
    loaded = checkpoints.load()
    counters = dict(loaded.ledger)
    counters["restore_seconds"] = counters.get("restore_seconds", 0.0) + loaded.seconds
    counters["residual_reset"] = counters.get("residual_reset", False) or loaded.residual_reset
    if loaded.fell_back:  # the latest checkpoint did not verify: an older one was restored
        counters["checkpoint_fallbacks"] = counters.get("checkpoint_fallbacks", []) + [
            {"restored": loaded.step, "skipped": {str(step): reason[:300] for step, reason in loaded.skipped.items()}}]
    rows, evals = [], []
    if rank == 0 and out_dir is not None:
        # Keep what was logged up to the checkpoint; the steps after it are recomputed.
        kept = rows_up_to(read_steps(out_dir), loaded.step)
        if kept is None:
            raise RuntimeError(f"{out_dir / STEPS_FILE} does not hold every step up to the checkpoint at step "
                               f"{loaded.step}: resuming would leave a gap in the record (the runner sets such "
                               "checkpoints aside and starts over)")
        write_steps_atomically(out_dir, kept)
        rows = [r for r in kept if r["kind"] == "train"]
        evals = [[r["step"], r["elapsed_seconds"], r["val_loss"]] for r in kept if r["kind"] == "eval"]
    return loaded.step, counters, rows, evals




def _read_fault_record(out_dir: Path | None) -> dict | None:
    """The injected fault's record, if this run has one (written once, atomically, by the
    rank the fault struck: safe to read from any rank)."""
    path = out_dir / FAULT_FILE if out_dir is not None else None
    return json.loads(path.read_text()) if path is not None and path.exists() else None


_FAULT_FIRED = []  # a rolled-back run recomputes the fault step: fire once per process


def _inject_fault(config: ExperimentConfig, rank: int, step: int, out_dir: Path | None, meter: HookMeter,
                  model: torch.nn.Module) -> None:
    """The configured fault, in the first attempt only (a restarted run must recover)."""
    fault = config.fault
    if fault is None or _FAULT_FIRED or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    if fault["kind"] == "hook_error" and step == fault["step"] - 1:
        meter.fail_next_call(rank == fault["rank"])
        return
    if step != fault["step"] or rank != fault["rank"]:
        return
    _FAULT_FIRED.append(step)
    if out_dir is not None:
        write_json_atomically(out_dir / FAULT_FILE, {**fault, "wall_time": time.time()})
    if fault["kind"] == "bitflip":
        flip_bit(next(model.parameters()).data, 0, 30)  # an exponent bit: a silent, large change
    if fault["kind"] == "kill":
        os._exit(1)
    if fault["kind"] == "hang":
        time.sleep(10 * config.collective_timeout_s)  # the other ranks time out and fail


def train_run(config: ExperimentConfig, arm: str, seed: int, out_dir: Path | None, launch_wall_time: float, *,
              summary_name: str = SUMMARY_FILE) -> dict:
    """Train one run on an initialised process group; returns the summary (all ranks).

    With ``checkpoint_every`` a verified checkpoint is saved every N steps under
    ``out_dir/checkpoints``; a restarted run (torchrun ``--max-restarts``) resumes from
    the latest one and records the recovery time (fault -> first completed step after
    the restore) and the recomputed steps. A new launch of a run that has checkpoints (a
    re-run after an interruption) resumes from the latest one too; its wall clock then
    continues from the checkpoint's (the time between the launches and the new start-up
    are not the run's), and it is not counted as a recovery. Rank 0 writes the summary to
    ``out_dir/summary_name``.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    task = get_task(config.task)
    torch.manual_seed(seed)
    model = task.build_model()
    if config.hsdp_shape is None:
        ddp = DDP(model, bucket_cap_mb=config.bucket_cap_mb)
        arm_hook = make_arm_hook(arm, config, ddp, seed)
        meter = HookMeter(arm_hook)
        meter.register(ddp)
    else:  # FSDP2 hybrid sharding: the model is trained as it is, sharded in place
        from sparsecomm.lab.experiment import hsdp_arms

        mesh = hsdp_arms.build_mesh(config)
        hsdp_arms.shard_model(model, mesh)
        ddp = model
        arm_hook, meter = hsdp_arms.hsdp_arm(arm, config, model, mesh, seed)
    optimizer = make_optimizer(config, ddp.parameters(), arm)
    if isinstance(arm_hook.state, TopKState) and arm_hook.state.config.exchange == "shared-mask":
        arm_hook.state.attach_optimizer(optimizer)  # SCAPE's reducer synchronises AdamS's first moment
    checkpoints = None
    start_step, counters, rows, evals = 0, {}, [], []
    if config.checkpoint_every and out_dir is not None:
        checkpoints = CheckpointManager(
            out_dir / CHECKPOINTS_DIR, model=ddp, optimizer=optimizer,
            hook_state=arm_hook.checkpoint_state,
            probe=_probe(task, config), config_hash=config.run_hash(arm, seed), keep=config.keep_checkpoints,
        )
        start_step, counters, rows, evals = _resume(checkpoints, out_dir, rank)
        if start_step and isinstance(arm_hook.state, TopKState):
            # A new process: let DDP rebuild its buckets before the first real step.
            ids = global_batch(config, task.num_train_samples, seed, 0)[: config.batch_size]
            rebuild_buckets(ddp, arm_hook.state, lambda: (task.loss(ddp, *task.train_batch(ids)) * 0).backward())
            meter.take_step()  # that pass sent nothing; do not count it
        if start_step and arm_hook.state is not None and checkpoints.hook_state is None:
            # A peer hook whose state we cannot checkpoint (PowerSGD's memories are keyed
            # by bucket index) restarts its error feedback from nothing: say so.
            counters["residual_reset"] = True
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # A resume in another launch than the one that saved the checkpoint (not a torchrun
    # restart, not a rollback): a re-run of an interrupted run.
    new_launch = bool(start_step) and (counters["launch_wall_time"] != launch_wall_time
                                       if "launch_wall_time" in counters else restart == 0)
    if new_launch:
        resumed_elapsed = counters.get("saved_elapsed")
        if resumed_elapsed is None:  # a checkpoint from before saved_elapsed was recorded
            resumed_elapsed = rows[-1]["elapsed_seconds"] if rows else 0.0
        counters.setdefault("setup_seconds", time.time() - launch_wall_time)
        # The kept rows end at the checkpoint; the clock goes on from there, so the record
        # reads like an uninterrupted run's (the interruption is not the arm's cost).
        counters["first_touch_wall"] = time.time() - resumed_elapsed
        counters["resumed_from"] = [*counters.get("resumed_from", []), start_step]
        counters.pop("detected_step", None)
    counters["launch_wall_time"] = launch_wall_time
    counters.setdefault("first_touch_wall", time.time())
    counters.setdefault("setup_seconds", counters["first_touch_wall"] - launch_wall_time)
    counters.setdefault("checkpoint_seconds", 0.0)
    counters.setdefault("num_checkpoints", 0)
    counters.setdefault("rollbacks", 0)
    first_touch_wall = counters["first_touch_wall"]
    replicas = ReplicaDigestMonitor(model, every=config.monitor_every) if config.monitor_every else None
    staleness = None
    if isinstance(arm_hook.state, TopKState) and arm_hook.state.error_feedback:
        staleness = StalenessMonitor.from_policy(config.policy)  # records; marks the run unverified
        arm_hook.state.add_observer(staleness)

    def open_log():
        return StepLog(out_dir, append=bool(rows or evals)) if rank == 0 and out_dir is not None else None

    def elapsed() -> float:  # wall clock across restarts: lost time counts
        return time.time() - first_touch_wall

    writer = open_log()
    # Recovery is measured after a fault (a torchrun restart), not after a re-run.
    step, recovering = start_step, bool(start_step) and not new_launch
    diverged = None
    last_step = config.steps_of(arm)  # dense's steps, or its step_budget x them
    try:
        while step < last_step:
            step += 1
            started = time.perf_counter()
            ids = global_batch(config, task.num_train_samples, seed, step)
            inputs, targets = task.train_batch(ids[rank * config.batch_size : (rank + 1) * config.batch_size])
            loss = task.loss(ddp, inputs, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            backward_done = time.perf_counter()
            optimizer.step()
            try:
                after = after_optimizer_step(arm_hook)  # an averager's outer sync, every period steps
                if checkpoints is not None and step % config.checkpoint_every == 0 and arm_hook.averager is not None:
                    arm_hook.averager.flush()  # overlap: the sync in flight lands before the checkpoint's cut
            except NonFiniteSyncError as error:
                # A replica's weights stopped being finite and the averager refused the sync on
                # every rank alike: the run diverged. That is a measured result (a non-finite
                # final loss: its verdict is inconclusive), as for the other arms, not a failure.
                diverged, after = str(error), dict(NOTHING_AFTER)
            finished = time.perf_counter()
            measured = meter.take_step()
            # Outside the timed region: the mean loss over ranks, for the record.
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            comm_wait = max(0.0, backward_done - measured["last_hook_return"]) if measured["last_hook_return"] else 0.0
            comm_wait += after["comm_seconds"] + measured.get("exchange_seconds", 0.0)  # HSDP: the hooks wait
            compress = measured["hook_seconds"] + after["compress_seconds"]
            row = {
                "kind": "train",
                "step": step,
                "train_loss": mean_loss.item() / world_size,
                "step_seconds": finished - started,
                "compute_seconds": finished - started - compress - comm_wait,
                "compress_seconds": compress,
                "comm_wait_seconds": comm_wait,
                "bytes_sent": measured["bytes_sent"] + after["bytes_sent"],
                "bytes_dense": measured["bytes_dense"],
                "buckets": measured["buckets"],
                "elapsed_seconds": elapsed(),
            }
            rows.append(row)
            _write(writer, row)
            if recovering:
                # Work lost: from the step the fault was noticed (a silent one when a check
                # caught it, a crash at once) back to the step the run resumed from.
                fault = _read_fault_record(out_dir)
                noticed = counters.pop("detected_step", None) or (fault["step"] if fault is not None else None)
                if noticed is not None:
                    counters.setdefault("lost_steps", noticed - (step - 1))
                if fault is not None:  # an injected fault knows when it struck
                    counters.setdefault("recovery_seconds", time.time() - fault["wall_time"])
            recovering = False
            if diverged is not None:
                evals.append([step, elapsed(), float("nan")])
                _write(writer, {"kind": "eval", "step": step, "val_loss": float("nan"),
                                "elapsed_seconds": evals[-1][1]})
                break
            # At dense's last step too: where a longer run (step_budget) is judged against dense.
            if step % config.eval_every == 0 or step in (config.steps, last_step):
                with arm_hook.evaluation():  # an averager's consensus weights, the same on every rank
                    val_loss = task.val_loss(model)
                evals.append([step, elapsed(), val_loss])
                _write(writer, {"kind": "eval", "step": step, "val_loss": val_loss, "elapsed_seconds": evals[-1][1]})
            if replicas is not None:
                try:
                    replicas.check(step)
                except CorruptionDetected as error:
                    if config.on_corruption == "stop":
                        raise
                    # Roll back to the last verified checkpoint and recompute from there.
                    # Every rank raised at this step; the detection step travels in the
                    # counters (the fault record has one writer: the rank it struck).
                    if writer is not None:
                        writer.close()
                    kept = {k: counters[k] for k in ("rollbacks", "checkpoint_seconds", "num_checkpoints")}
                    step, counters, rows, evals = _resume(checkpoints, out_dir, rank)
                    counters.update(kept, rollbacks=kept["rollbacks"] + 1, last_corruption=str(error)[:500],
                                    detected_step=error.step)
                    writer, recovering = open_log(), True
                    continue
            if checkpoints is not None and step % config.checkpoint_every == 0:
                save_started = time.perf_counter()
                counters["num_checkpoints"] += 1
                counters["saved_elapsed"] = elapsed()
                if writer is not None:
                    writer.sync()  # the rows up to this step reach the disk before the checkpoint
                checkpoints.save(step, data_position={"step": step}, ledger=counters)
                counters["checkpoint_seconds"] += time.perf_counter() - save_started
            _inject_fault(config, rank, step, out_dir, meter, model)
    finally:
        if writer is not None:
            writer.close()
    summary = {
        "arm": arm,
        "seed": seed,
        "status": "ok",
        "config_hash": config.run_hash(arm, seed),
        "hook": arm_hook.description,
        "arm_spec": config.arm(arm).to_dict(),
        "setup_seconds": counters["setup_seconds"],
        **steady_figures(rows, config.warmup_steps),
        "total_seconds": rows[-1]["elapsed_seconds"],
        "checkpoint_seconds": counters["checkpoint_seconds"] if checkpoints is not None else None,
        "num_checkpoints": counters["num_checkpoints"],
        "restore_seconds": counters.get("restore_seconds"),
        "recovery_seconds": counters.get("recovery_seconds"),
        "lost_steps": counters.get("lost_steps"),
        "residual_reset": counters.get("residual_reset", False),
        "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "rollbacks": counters["rollbacks"],
        "checkpoint_fallbacks": counters.get("checkpoint_fallbacks", []),
        "resumed_from_steps": counters.get("resumed_from", []),
        "last_corruption": counters.get("last_corruption"),
        "diverged": diverged,
        "staleness": staleness.report() if staleness is not None else None,
        "unverified_reason": staleness.report().get("unverified_reason") if staleness is not None else None,
        "evals": evals,
        "hook_stats": arm_hook.stats(arm_hook.state),
        "world_size": world_size,
        "parallelism": config.parallelism,
        "torch_version": torch.__version__,
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }
    if os.environ.get(LAUNCH_ENV):
        summary["launch_id"] = os.environ[LAUNCH_ENV]
    if rank == 0 and out_dir is not None:
        write_json_atomically(out_dir / summary_name, summary)
    return summary


def steady_figures(rows: list[dict], warmup_steps: int) -> dict:
    """The summary's per-step figures: medians of the times and means of the bytes over the
    steps after warm-up (dense in every arm; all rows if the run is no longer than that)."""
    steady = rows[warmup_steps:] or rows

    def median(key):
        return statistics.median(r[key] for r in steady)

    return {
        "median_step_seconds": median("step_seconds"),
        "median_compute_seconds": median("compute_seconds"),
        "median_compress_seconds": median("compress_seconds"),
        "median_comm_wait_seconds": median("comm_wait_seconds"),
        "bytes_sent_per_step": statistics.fmean(r["bytes_sent"] for r in steady),
        "bytes_dense_per_step": statistics.fmean(r["bytes_dense"] for r in steady),
        # DDP buckets (FSDP modules) the gradient was reduced in, per step; rows written before it was recorded have none
        "buckets_per_step": median("buckets") if all("buckets" in r for r in steady) else None,
    }


def _write(writer, row: dict) -> None:
    if writer is not None:
        writer.write(row)


def result_line(summary: dict) -> str:
    """How a finished run ended, in one line: final validation loss and step time."""
    metric = summary.get("metric", "val_loss").replace("val_loss", "val loss")
    return f"final {metric} {summary['evals'][-1][2]:.4f}, {summary['median_step_seconds'] * 1e3:.1f} ms/step"


INIT_TRIES = 3


def _init_process_group(config: ExperimentConfig) -> None:
    """Join the gloo group through the launcher's store, retrying a failed mesh connection.

    Rank and world size come from the launcher's variables (:func:`sparsecomm.dist.discover`:
    torchrun, one process per rank on an emulated link, mpiexec, srun). Without
    MASTER_ADDR/MASTER_PORT (mpiexec or srun) :func:`sparsecomm.dist.init_distributed`
    finds the rendezvous. After a torchrun restart, gloo's full-mesh connect sometimes
    fails with "Connection refused" (seen in about a third of restarts on this machine);
    every rank then fails the same attempt, and all retry under a fresh store prefix.
    """
    info = discover()
    if info.world_size != config.world_size:
        raise ValueError(f"the launcher started {info.world_size} processes ({info.launcher}), but the experiment's "
                         f"world_size is {config.world_size}: start exactly world_size processes")
    timeout = timedelta(seconds=config.collective_timeout_s)
    if info.master_addr is None:
        init_distributed("gloo", timeout=timeout)
        return
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # torchrun's agent hosts the store; without an agent (one process per rank on an
    # emulated link, or an MPI launch with MASTER_ADDR set) rank 0 does.
    hosts_store = info.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    base = dist.TCPStore(info.master_addr, info.master_port, info.world_size, is_master=hosts_store, timeout=timeout)
    for attempt in range(INIT_TRIES):
        store = dist.PrefixStore(f"sparsecomm/restart{restart}/init{attempt}", base)
        try:
            dist.init_process_group("gloo", store=store, rank=info.rank, world_size=info.world_size, timeout=timeout)
            return
        except RuntimeError as error:
            if "connectFullMesh" not in str(error) or attempt == INIT_TRIES - 1:
                raise
            time.sleep(1.0)


def run_rank(config: ExperimentConfig, arm: str, seed: int, out_dir: Path, launch_wall_time: float, *,
             announce: bool = False, summary_name: str = SUMMARY_FILE, claim=None) -> None:
    """This process's part of one run: join the group, train, leave; never returns (see below).

    ``announce``: rank 0 prints the run's final validation loss and step time.
    ``summary_name``: the file rank 0 writes the summary to (the runner's workers write
    ``result.json``, which the runner promotes). ``claim``: called on rank 0 once every
    rank has joined; an ``(exit_code, message)`` it returns stops every rank with that
    exit code, rank 0 printing the message (``sparsecomm run`` claims the run directory's
    lock this way); None lets the run go on. A rank that raises
    records its error in ``error-rank<r>.json`` (:func:`write_rank_error`) and exits 1.
    """
    torch.set_num_threads(1)  # ranks share the machine's cores, as torchrun arranges
    try:
        _init_process_group(config)
        refusal = [None]
        if claim is not None:  # every rank of a launch passes one, or none does
            refusal = [claim() if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(refusal, src=0)
        if refusal[0] is not None:
            code, message = refusal[0]
            if dist.get_rank() == 0:
                print(message, file=sys.stderr if code else sys.stdout)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        summary = train_run(config, arm, seed, out_dir, launch_wall_time, summary_name=summary_name)
        dist.barrier()  # no rank leaves while another still has a collective in flight
        if announce and dist.get_rank() == 0:
            print(f"{arm} seed {seed}: {result_line(summary)} -> {out_dir}")
        dist.destroy_process_group()
    except BaseException as error:
        if isinstance(error, SystemExit) and error.code in (None, 0):
            raise
        # Recorded first, with the group still up: a peer's error caused by this one (its
        # connection closes when this process exits) comes later. No teardown (see below).
        write_rank_error(out_dir, error)
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    # Skip interpreter teardown: gloo/DDP threads destroyed there occasionally abort the
    # process ("terminate called without an active exception", SIGABRT) after all work is
    # done and the summary is written, which a launcher would report as a failed run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    """Entry point of one rank started by the runner: ``python -m sparsecomm.lab.experiment.worker``."""
    parser = argparse.ArgumentParser(prog="python -m sparsecomm.lab.experiment.worker")
    parser.add_argument("--experiment-json", required=True, type=Path,
                        help="the run's config: run-config.json in the run directory (or an experiment.json)")
    parser.add_argument("--arm", required=True)
    parser.add_argument("--seed", required=True, type=int)
    parser.add_argument("--out", required=True, type=Path, help="this run's directory")
    parser.add_argument("--launch-time", required=True, type=float, help="wall clock (time.time()) at launch")
    args = parser.parse_args(argv)
    die_with_parent()
    try:
        raw = json.loads(args.experiment_json.read_text())
        config = ExperimentConfig.of_run(raw)
        expected = raw.get("config_hash")
        if expected is not None and config.run_hash(args.arm, args.seed) != expected:
            raise ValueError(f"{args.experiment_json}: its config hashes to {config.run_hash(args.arm, args.seed)} "
                             f"for {args.arm} seed {args.seed}, not to the run's {expected}")
    except Exception as error:
        write_rank_error(args.out, error)
        raise
    run_rank(config, args.arm, args.seed, args.out, args.launch_time, summary_name=RESULT_FILE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
