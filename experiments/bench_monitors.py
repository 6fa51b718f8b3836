"""Detection rate, false alarms and overhead of the SDC monitors (not a test).

Two gloo ranks (spawned here, FileStore rendezvous) train the digits MLP
(``sparsecomm.lab.tasks.digits.DigitsMLP``, 85k parameters, different data per rank) with
``TopKState(density=0.01)`` and every monitor of ``sparsecomm.monitor`` on:

1. Detection: ``--trials`` trials per (target, bit class). Each trial starts a fresh
   model, flips one bit on one random rank at a random step and element: bit 30 (top
   exponent bit) or bit 3 (low mantissa bit) of a float32 in a parameter (after the
   optimizer step), in the local gradient (before compression) or in the new residual
   (inside the hook, with ``verify_conservation=True``). Recorded: which monitor
   detected it first and after how many steps, or that nothing did within
   ``--detect-window`` steps.
2. False alarms: one clean run of ``--clean-steps`` steps with all monitors on.
3. Overhead: median step time (``--timed-steps`` steps after ``--warm-steps``, median
   over ``--repeats`` repeats, configurations interleaved) with monitors at their default
   cadence vs none, and with the conservation audit on top.

Every rank runs the loop of ``sparsecomm.monitor``'s docstring: backward in a try, the
gradient agreement vote (which also carries local failures and record-mode alarms),
optimizer step, replica digest. Guards run in record mode here so a detection on one
rank does not leave the other in a collective; the conservation check raises inside the
hook on one rank, so its DDP group gets a short timeout (``--hook-timeout``).

    python experiments/bench_monitors.py --out bench_monitors.json
"""
import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from sparsecomm import ConservationError, TopKState, topk_hook
from sparsecomm.monitor import (
    BitFlipInjector,
    CorruptionDetected,
    FiniteGuard,
    GradientAgreementMonitor,
    NonFiniteError,
    ReplicaDigestMonitor,
    StalenessMonitor,
    UpdateSpikeDetector,
)
from sparsecomm.lab.policy import Policy
from sparsecomm.lab.tasks import get_task

from cpu_info import describe_cpu  # experiments/cpu_info.py, beside this script

WORLD_SIZE = 2
TARGETS = ("parameter", "gradient", "residual")
BIT_CLASSES = {"exponent": 30, "mantissa": 3}  # float32: bit 30 = top exponent bit, bit 3 = low mantissa
FIRST_FAULT_STEP = 5  # after the 2 dense warm-up steps and a few sparse ones
REPLICA_EVERY = 10  # default cadence of the replica digest
STALENESS_EVERY = 10
PARAMETERS: list[tuple[str, int]] = []  # (name, numel) of the task's model, filled on each rank
OPTIMIZER = ["sgd"]  # set from --task on each rank
# Per task: the batch per rank and optimizer of its named experiment (digits-quick, pydoc-gpt).
TASK_DEFAULTS = {"digits-mlp": (32, "sgd"), "pydoc-gpt": (16, "adamw")}


class _Alarm(Exception):
    """A record-mode alarm of this rank, carried into the vote like a local failure."""

    def __init__(self, monitor: str, detail: str):
        self.monitor = monitor
        super().__init__(f"{monitor}: {detail}")


class Monitors:
    """Every monitor on one DDP model, with the per-step protocol of the package docstring.

    ``parts`` switches groups on for the overhead breakdown: ``observers`` (finite guard,
    spike detector, staleness), ``vote`` (gradient agreement every ``vote_every`` steps),
    ``replica`` (replica digest every 10 steps).
    """

    def __init__(self, ddp, state, *, record: bool, parts=("observers", "vote", "replica"), vote_every: int = 1):
        self.finite = FiniteGuard(state=state, action="record" if record else "raise")
        self.spike = UpdateSpikeDetector(action="record" if record else "raise")
        self.staleness = StalenessMonitor.from_policy(Policy(), every=STALENESS_EVERY)
        self.vote = GradientAgreementMonitor(ddp, every=vote_every) if "vote" in parts else None
        self.replica = ReplicaDigestMonitor(ddp, every=REPLICA_EVERY) if "replica" in parts else None
        if "observers" in parts:
            for observer in (self.finite, self.spike, self.staleness):
                state.add_observer(observer)
        self._seen = (0, 0)

    def new_alarm(self) -> _Alarm | None:
        """This rank's first record-mode alarm since the last call, if any."""
        finite, spikes = len(self.finite.alarms), len(self.spike.alarms)
        old_finite, old_spikes = self._seen
        self._seen = (finite, spikes)
        if finite > old_finite:
            return _Alarm("finite_guard", str(self.finite.alarms[old_finite]))
        if spikes > old_spikes:
            return _Alarm("update_spike", str(self.spike.alarms[old_spikes]))
        return None


def _local_monitor(error: BaseException) -> str:
    if isinstance(error, _Alarm):
        return error.monitor
    if isinstance(error, ConservationError) or "sent + residual" in str(error):
        return "conservation"
    if isinstance(error, NonFiniteError):
        return "finite_guard"
    if isinstance(error, CorruptionDetected):
        return error.check
    return f"error:{type(error).__name__}"


def _step(task, ddp, optimizer, monitors, generator, rank, step, batch, injector=None):
    """One training step with the monitors; (monitor that fired, suspect ranks) or None."""
    ids = torch.randint(task.num_train_samples, (batch,), generator=generator)
    optimizer.zero_grad(set_to_none=True)
    local = None
    try:
        task.loss(ddp, *task.train_batch(ids)).backward()
    except Exception as error:  # a guard or the conservation check in the hook, a failed collective
        local = error
    if monitors is None:
        if local is not None:
            raise local
        optimizer.step()
        return None
    local = local or monitors.new_alarm()
    if monitors.vote is not None:
        try:
            monitors.vote.check(step, local_error=local)
        except CorruptionDetected as error:
            return (_local_monitor(local) if local is not None else "gradient_agreement"), error.ranks
    elif local is not None:
        raise local
    optimizer.step()
    if injector is not None:
        injector.maybe_inject_parameters(ddp.module, step, rank)
    if monitors.replica is not None:
        try:
            monitors.replica.check(step)
        except CorruptionDetected as error:
            return "replica_digest", error.ranks
    return None


def _build(task, seed, group, *, conservation, record, parts=("observers", "vote", "replica"), vote_every=1,
           injector=None):
    torch.manual_seed(seed)
    model = task.build_model()
    ddp = DDP(model, process_group=group)
    state = TopKState(group, density=0.01, module=ddp, verify_conservation=conservation)
    ddp.register_comm_hook(state, topk_hook)
    if injector is not None and injector.target != "parameter":
        state.add_observer(injector)  # before the monitors: they must see the fault
    if OPTIMIZER[0] == "adamw":  # the default experiment's optimizer (pydoc-gpt)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    else:
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    monitors = Monitors(ddp, state, record=record, parts=parts, vote_every=vote_every) if parts else None
    return ddp, state, optimizer, monitors


def _trial(task, rank, args, target, bit_class, trial):
    rng = random.Random(f"{args.seed}-{target}-{bit_class}-{trial}")  # identical on every rank
    fault_step = rng.randrange(FIRST_FAULT_STEP, FIRST_FAULT_STEP + args.fault_span)
    fault_rank = rng.randrange(WORLD_SIZE)
    seed = rng.randrange(2**31)
    # The conservation check raises inside the hook on one rank: give the DDP group a short
    # timeout so the other rank's wait for the missing payload ends quickly.
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=args.hook_timeout)) if target == "residual" else None
    position = rng.randrange(sum(numel for _, numel in PARAMETERS))  # uniform over all float32 entries
    for name, numel in PARAMETERS:
        if position < numel:
            break
        position -= numel
    injector = BitFlipInjector(target, step=fault_step, rank=fault_rank, bit=BIT_CLASSES[bit_class],
                               index=position, name=name)
    ddp, state, optimizer, monitors = _build(task, seed, group, conservation=True, record=True, injector=injector)
    generator = torch.Generator().manual_seed(seed + 1 + rank)
    outcome = {"target": target, "bit_class": bit_class, "fault_step": fault_step, "fault_rank": fault_rank,
               "parameter": name, "element": position, "monitor": None, "delay": None, "false_alarm": None}
    for step in range(fault_step + args.detect_window + 1):
        fired = _step(task, ddp, optimizer, monitors, generator, rank, step, args.batch, injector)
        if fired is not None:
            monitor, _ = fired
            if step < fault_step:
                outcome["false_alarm"] = (monitor, step)
            else:
                outcome["monitor"], outcome["delay"] = monitor, step - fault_step
            break
    # The rank that failed locally knows which monitor it was; the other only saw the vote.
    everyone = [None] * WORLD_SIZE
    dist.all_gather_object(everyone, (outcome["monitor"], injector.injected))
    local_names = [m for m, _ in everyone if m not in (None, "gradient_agreement")]
    if outcome["monitor"] == "gradient_agreement" and local_names:
        outcome["monitor"] = local_names[0]
    injected = [record for _, records in everyone for record in records]
    outcome["before"], outcome["after"] = (injected[0]["before"], injected[0]["after"]) if injected else (None, None)
    return outcome


def _clean_run(task, rank, args):
    ddp, state, optimizer, monitors = _build(task, args.seed, None, conservation=True, record=True)
    generator = torch.Generator().manual_seed(args.seed + 1 + rank)
    alarms = []
    for step in range(args.clean_steps):
        fired = _step(task, ddp, optimizer, monitors, generator, rank, step, args.batch)
        if fired is not None:
            alarms.append((step, fired[0]))
            break  # the vote stopped every rank: nothing later would be a clean step
    return {"steps": args.clean_steps, "alarms": alarms, "max_clean_spike_ratio": monitors.spike.max_clean_ratio,
            "staleness": monitors.staleness.report(), "val_loss": task.val_loss(ddp.module)}


def _overhead(task, rank, args):
    configs = {  # cumulative, so each row's increment is one group of monitors
        "off": dict(parts=(), conservation=False),
        "observers": dict(parts=("observers",), conservation=False),
        "+ replica digest /10": dict(parts=("observers", "replica"), conservation=False),
        "+ gradient vote /1 (default)": dict(parts=("observers", "replica", "vote"), conservation=False),
        "  same, gradient vote /10": dict(parts=("observers", "replica", "vote"), vote_every=10, conservation=False),
        "+ conservation audit": dict(parts=("observers", "replica", "vote"), conservation=True),
    }
    stats = {name: {"median": [], "mean": []} for name in configs}
    for repeat in range(args.repeats):
        order = list(configs) if repeat % 2 == 0 else list(reversed(configs))  # interleave, alternate order
        for name in order:
            ddp, state, optimizer, monitors = _build(task, args.seed, None, record=False, **configs[name])
            generator = torch.Generator().manual_seed(args.seed + 1 + rank)
            times = []
            for step in range(args.warm_steps + args.timed_steps):
                dist.barrier()  # start every step together: time the step, not the skew
                started = time.perf_counter()
                fired = _step(task, ddp, optimizer, monitors, generator, rank, step, args.batch)
                times.append(time.perf_counter() - started)
                assert fired is None, f"alarm in the overhead run: {fired}"
            # A step ends when both ranks are done: take the slower rank's time.
            timed = torch.tensor(times[args.warm_steps:], dtype=torch.float64)
            dist.all_reduce(timed, op=dist.ReduceOp.MAX)
            stats[name]["median"].append(statistics.median(timed.tolist()))
            stats[name]["mean"].append(statistics.fmean(timed.tolist()))  # includes the every-N checks
    return stats


def _rank_main(rank, args, workdir):
    OPTIMIZER[0] = TASK_DEFAULTS[args.task][1]
    store = dist.FileStore(os.path.join(workdir, "store"), WORLD_SIZE)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=120))
    torch.set_num_threads(1)  # two ranks on a small machine: one intra-op thread each
    task = get_task(args.task)
    PARAMETERS[:] = [(n, p.numel()) for n, p in task.build_model().named_parameters()]
    started = time.perf_counter()
    trials, everyone = [], []
    if not args.only_overhead:
        trials = [_trial(task, rank, args, target, bit_class, trial)
                  for target in TARGETS for bit_class in BIT_CLASSES for trial in range(args.trials)]
    detection_seconds = time.perf_counter() - started
    if not args.only_overhead:
        clean = _clean_run(task, rank, args)
        everyone = [None] * WORLD_SIZE
        dist.all_gather_object(everyone, clean)
    overhead = _overhead(task, rank, args)
    if rank == 0:
        result = {"trials": trials, "clean": everyone, "overhead": overhead, "detection_seconds": detection_seconds}
        Path(workdir, "result.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _git_commit() -> str:
    """HEAD's commit read from .git (no git process); "unknown" outside a checkout."""
    git = Path(__file__).resolve().parent.parent / ".git"
    try:
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head
        ref = head[5:]
        if (git / ref).exists():
            return (git / ref).read_text().strip()
        for line in (git / "packed-refs").read_text().splitlines():
            if line.endswith(" " + ref):
                return line.split()[0]
    except OSError:
        pass
    return "unknown"


def summarise(result: dict) -> dict:
    rows = []
    for target in TARGETS:
        for bit_class in BIT_CLASSES:
            trials = [t for t in result["trials"] if t["target"] == target and t["bit_class"] == bit_class]
            detected = [t for t in trials if t["monitor"] is not None]
            by_monitor = {}
            for t in detected:
                by_monitor[t["monitor"]] = by_monitor.get(t["monitor"], 0) + 1
            rows.append({
                "target": target,
                "bit": f"{bit_class} (bit {BIT_CLASSES[bit_class]})",
                "trials": len(trials),
                "detected": len(detected),
                "rate": len(detected) / len(trials) if trials else None,
                "by_monitor": by_monitor,
                "median_delay_steps": statistics.median(t["delay"] for t in detected) if detected else None,
                "max_delay_steps": max(t["delay"] for t in detected) if detected else None,
                "false_alarms_before_fault": sum(t["false_alarm"] is not None for t in trials),
            })
    step = {name: {kind: statistics.median(values) for kind, values in kinds.items()}
            for name, kinds in result["overhead"].items()}
    ratio = {name: {kind: step[name][kind] / step["off"][kind] for kind in ("median", "mean")}
             for name in step if name != "off"}
    return {"rows": rows, "step_seconds": step, "overhead_ratio": ratio}


def print_report(summary: dict, result: dict, args) -> None:
    print(f"{describe_cpu()}; task {args.task}, batch {args.batch} per rank, {WORLD_SIZE} gloo ranks, "
          f"torch {torch.__version__}")
    if not args.only_overhead:
        _print_detection(summary, result, args)
    _print_overhead(summary, args)


def _print_detection(summary: dict, result: dict, args) -> None:
    print(f"detection: {args.trials} trials per row, fault at a random step in [{FIRST_FAULT_STEP}, "
          f"{FIRST_FAULT_STEP + args.fault_span}), random rank and entry; window {args.detect_window} steps")
    print(f"{'target':<10} {'bit':<16} {'detected':>9} {'rate':>6} {'median/max delay':>17}  by monitor")
    for r in summary["rows"]:
        delays = "-" if r["median_delay_steps"] is None else f"{r['median_delay_steps']:g} / {r['max_delay_steps']}"
        monitors = ", ".join(f"{k} {v}" for k, v in sorted(r["by_monitor"].items())) or "-"
        print(f"{r['target']:<10} {r['bit']:<16} {r['detected']:>4}/{r['trials']:<4} {r['rate']:>6.0%} {delays:>17}  {monitors}")
    false_before = sum(r["false_alarms_before_fault"] for r in summary["rows"])
    clean = result["clean"][0]
    alarms = [a for c in result["clean"] for a in c["alarms"]]
    print(f"false alarms: {len(alarms)} in a clean run of {clean['steps']} steps x {WORLD_SIZE} ranks "
          f"(largest clean spike ratio {max(c['max_clean_spike_ratio'] for c in result['clean']):.2f} vs threshold "
          f"{UpdateSpikeDetector().threshold:g}); {false_before} before the fault step in the trials")
    print(f"staleness (clean run, rank 0): max age {clean['staleness']['max_age']} steps, "
          f"exceeded limit {clean['staleness']['limit']}: {clean['staleness']['exceeded']}")

def _print_overhead(summary: dict, args) -> None:
    print(f"overhead (boundary: step; slower rank per step; median over {args.repeats} repeats of "
          f"{args.timed_steps} steps; target ratio <= 1.05)")
    print(f"  {'configuration':<30} {'median step':>11} {'ratio':>6} {'mean step':>10} {'ratio':>6}")
    for name, times in summary["step_seconds"].items():
        ratio = summary["overhead_ratio"].get(name, {"median": 1.0, "mean": 1.0})
        print(f"  {name:<30} {times['median'] * 1e3:>8.2f} ms {ratio['median']:>6.3f} "
              f"{times['mean'] * 1e3:>7.2f} ms {ratio['mean']:>6.3f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20, help="trials per (target, bit class)")
    parser.add_argument("--fault-span", type=int, default=10, help="fault step drawn from [5, 5 + span)")
    parser.add_argument("--detect-window", type=int, default=REPLICA_EVERY,
                        help="steps after the fault a detection may take (the replica digest needs <= its cadence)")
    parser.add_argument("--clean-steps", type=int, default=200, help="steps of the false-alarm run")
    parser.add_argument("--repeats", type=int, default=5, help="overhead repeats per configuration")
    parser.add_argument("--warm-steps", type=int, default=5, help="untimed steps per overhead repeat")
    parser.add_argument("--timed-steps", type=int, default=40, help="timed steps per overhead repeat")
    parser.add_argument("--task", choices=sorted(TASK_DEFAULTS), default="digits-mlp",
                        help="model and data: digits-mlp (85k parameters, ~4 ms steps) or pydoc-gpt (the default "
                             "experiment's task, 0.25M parameters, ~45 ms steps)")
    parser.add_argument("--only-overhead", action="store_true",
                        help="measure the overhead only (skip the detection trials and the clean run)")
    parser.add_argument("--batch", type=int, default=None,
                        help="samples per rank per step (default: the task's experiment: 32 digits-mlp, 16 pydoc-gpt)")
    parser.add_argument("--hook-timeout", type=float, default=1.0, help="seconds: DDP group timeout in residual trials")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench_monitors.json"), help="JSON result file")
    args = parser.parse_args(argv)
    if args.batch is None:
        args.batch = TASK_DEFAULTS[args.task][0]
    if min(args.batch, args.repeats, args.timed_steps) < 1 or args.warm_steps < 0:
        parser.error("--batch, --repeats and --timed-steps must be >= 1, --warm-steps >= 0")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as workdir:
        mp.start_processes(_rank_main, args=(args, workdir), nprocs=WORLD_SIZE, join=True, start_method="spawn")
        result = json.loads(Path(workdir, "result.json").read_text())
    summary = summarise(result)
    print_report(summary, result, args)
    wall = time.perf_counter() - started
    print(f"wall time {wall:.0f} s (detection trials {result['detection_seconds']:.0f} s)")
    environment = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
                   "processor": platform.processor(), "system": platform.platform(), "cpu_count": os.cpu_count(),
                   "git_commit": _git_commit()}
    args.out.write_text(json.dumps({"environment": environment, "config": vars(args) | {"out": str(args.out)},
                                    "summary": summary, "clean": result["clean"], "trials": result["trials"],
                                    "overhead_step_seconds": result["overhead"], "wall_seconds": wall}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
