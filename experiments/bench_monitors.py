"""Detection rate, detection latency, false alarms and overhead of the SDC monitors (not a test).

Two gloo ranks (spawned here, FileStore rendezvous) train a task of the lab (``--task``:
the digits MLP, 85k parameters, SGD, or the default experiment's byte-level GPT, 0.25M
parameters, AdamW; different data per rank) with ``TopKState(density=0.01)`` and the
monitors of ``sparsecomm.monitor`` at their default settings: FiniteGuard,
UpdateSpikeDetector, StalenessMonitor (every 10 steps), ReplicaDigestMonitor and
GradientAgreementMonitor (each every 10 steps: their defaults).

1. Detection: ``--trials`` trials per (target, bit class). Each trial starts a fresh
   model, flips one bit on one random rank at a random step and element: bit 30 (top
   exponent bit) or bit 3 (low mantissa bit) of a float32 in a parameter (after the
   optimizer step), in the local gradient (before compression), in the new residual
   (inside the hook) or in the reduced gradient one rank received (after the collective).
   Recorded: which monitor detected it first and after how many steps, or that nothing
   did within ``--detect-window`` steps. ``--vote-every 1`` measures the vote on every
   step (the cadence before the 5% budget); ``--audit`` adds the opt-in conservation
   audit (``verify_conservation=True``).
2. False alarms: one clean run of ``--clean-steps`` steps with the same monitors.
3. Overhead (``--overhead-only`` runs this part alone, a few minutes on the default task):
   every configuration trains its own model, and the configurations take turns step by
   step (one step each per round, the order rotating), so a burst of load hits all of
   them alike. Reported per configuration: the median over blocks of 10 steps of the
   slower rank's mean step (a block holds one check of every every-10 monitor), its
   ratio to no monitors, the median of the same ratio block by block (paired), the
   step thread's CPU time, and the CPU time of the monitors' own calls per step as a
   share of a step's CPU time without monitors (less sensitive to other jobs on the
   machine than wall time; it leaves out what they cost the hook indirectly).

Every rank runs the loop of ``sparsecomm.monitor``'s docstring: backward in a try, the
gradient vote (on its vote steps it also carries local failures and record-mode alarms),
optimizer step, replica digest. Guards run in record mode here and the ranks tell each
other after every trial step whether one of them detected something (a collective of the
benchmark, not of the monitors), so a detection on one rank ends the trial on every rank
at that step, as a raising guard would stop that rank. With ``--audit`` the conservation
check raises inside the hook on one rank, so the DDP group gets a short timeout
(``--hook-timeout``).

    python experiments/bench_monitors.py --out bench_monitors.json            # digits MLP, ~10 min on 2 cores
    python experiments/bench_monitors.py --task pydoc-gpt --overhead-only     # the 5% budget, ~4 min
"""
import argparse
import json
import math
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
from sparsecomm.monitor.gradient_agreement import DEFAULT_EVERY as VOTE_EVERY
from sparsecomm.monitor.replica_digest import DEFAULT_EVERY as REPLICA_EVERY
from sparsecomm.lab.results.policy import Policy
from sparsecomm.lab.tasks import get_task

from cpu_info import describe_cpu  # experiments/cpu_info.py, beside this script

WORLD_SIZE = 2
TARGETS = ("parameter", "gradient", "residual", "reduced")
BIT_CLASSES = {"exponent": 30, "mantissa": 3}  # float32: bit 30 = top exponent bit, bit 3 = low mantissa
FIRST_FAULT_STEP = 5  # after the 2 dense warm-up steps and a few sparse ones
STALENESS_EVERY = 10  # as in StalenessMonitor's usage example: its default (1) tracks ages exactly, at a cost
PARAMETERS: list[tuple[str, int]] = []  # (name, numel) of the task's model, filled on each rank
OPTIMIZER = ["sgd"]  # set from --task on each rank
# Per task: the batch per rank and optimizer of its named experiment (digits-quick, pydoc-gpt).
TASK_DEFAULTS = {"digits-mlp": (32, "sgd"), "pydoc-gpt": (16, "adamw")}
ALL_PARTS = ("finite", "spike", "staleness", "replica", "vote")


class _Alarm(Exception):
    """A record-mode alarm of this rank, carried into the vote like a local failure."""

    def __init__(self, monitor: str, detail: str):
        self.monitor = monitor
        super().__init__(f"{monitor}: {detail}")


class _Timed:
    """Calls ``function`` and adds the calling thread's CPU time to ``seconds[0]``: what a
    monitor itself costs, measured on the thread that runs it (the step's own thread), so
    that other jobs on the machine slow it less than they slow the step's wall time."""

    def __init__(self, function, seconds: list[float]):
        self.function, self.seconds = function, seconds
        self.needs_acc = getattr(function, "needs_acc", True)  # an observer keeps its effect on the hook

    def __call__(self, *args, **kwargs):
        started = time.thread_time()
        try:
            return self.function(*args, **kwargs)
        finally:
            self.seconds[0] += time.thread_time() - started


class Monitors:
    """The monitors named in ``parts`` on one DDP model, with the per-step protocol of the
    package docstring: ``finite`` (FiniteGuard), ``spike`` (UpdateSpikeDetector),
    ``staleness`` (StalenessMonitor, every 10 steps unless ``staleness_every`` says otherwise),
    ``replica`` (ReplicaDigestMonitor),
    ``vote`` (GradientAgreementMonitor); the last two at their default settings unless
    ``vote`` names the vote's (``every``, ``window``).
    """

    def __init__(self, ddp, state, *, record: bool, parts=ALL_PARTS, vote: dict | None = None,
                 staleness_every: int = STALENESS_EVERY):
        self.cpu_seconds = [0.0]  # the monitors' own CPU time so far (see _Timed)
        self.finite = FiniteGuard(state=state, action="record" if record else "raise")
        self.spike = UpdateSpikeDetector(action="record" if record else "raise")
        self.staleness = StalenessMonitor.from_policy(Policy(), every=staleness_every)
        self.vote = GradientAgreementMonitor(ddp, **(vote or {})) if "vote" in parts else None
        self.replica = ReplicaDigestMonitor(ddp) if "replica" in parts else None
        for part, observer in (("finite", self.finite), ("spike", self.spike), ("staleness", self.staleness)):
            if part in parts:
                state.add_observer(_Timed(observer, self.cpu_seconds))
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
    """One training step with the monitors; the name of the monitor that fired on this rank, or None."""
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
            _Timed(monitors.vote.check, monitors.cpu_seconds)(step, local_error=local)
        except Exception as error:
            if error is local:  # a step that ends no window: this rank stops alone
                return _local_monitor(local)
            if not isinstance(error, CorruptionDetected):
                raise
            return _local_monitor(local) if local is not None else "gradient_agreement"
    elif local is not None:
        return _local_monitor(local)
    optimizer.step()
    if injector is not None:
        injector.maybe_inject_parameters(ddp.module, step, rank)
    if monitors.replica is not None:
        try:
            _Timed(monitors.replica.check, monitors.cpu_seconds)(step)
        except CorruptionDetected:
            return "replica_digest"
    return None


def _build(task, seed, group, *, conservation, record, parts=ALL_PARTS, vote=None, staleness_every=STALENESS_EVERY,
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
    monitors = Monitors(ddp, state, record=record, parts=parts, vote=vote, staleness_every=staleness_every) \
        if parts else None
    return ddp, state, optimizer, monitors


def _first_detection(fired_by_rank: list) -> str | None:
    """The monitor that detected: a named monitor of any rank before the vote (which only
    relays it) and before a rank's failed collective (a consequence), else what there is."""
    fired = [f for f in fired_by_rank if f is not None]
    for relayed in (False, True):
        for name in fired:
            if relayed == (name == "gradient_agreement" or name.startswith("error:")):
                return name
    return None


def _vote_settings(args) -> dict:
    """The vote's settings named on the command line (the rest: its defaults)."""
    every = {} if args.vote_every is None else {"every": args.vote_every}
    return every | ({"window": True} if args.vote_window else {})


def _trial(task, rank, args, target, bit_class, trial):
    rng = random.Random(f"{args.seed}-{target}-{bit_class}-{trial}")  # identical on every rank
    fault_step = rng.randrange(FIRST_FAULT_STEP, FIRST_FAULT_STEP + args.fault_span)
    fault_rank = rng.randrange(WORLD_SIZE)
    seed = rng.randrange(2**31)
    # The conservation audit raises inside the hook on one rank: give the DDP group a short
    # timeout so the other rank's wait for the missing payload ends quickly.
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=args.hook_timeout)) if args.audit else None
    position = rng.randrange(sum(numel for _, numel in PARAMETERS))  # uniform over all float32 entries
    for name, numel in PARAMETERS:
        if position < numel:
            break
        position -= numel
    injector = BitFlipInjector(target, step=fault_step, rank=fault_rank, bit=BIT_CLASSES[bit_class],
                               index=position, name=name)
    ddp, state, optimizer, monitors = _build(task, seed, group, conservation=args.audit, record=True,
                                             vote=_vote_settings(args), injector=injector)
    generator = torch.Generator().manual_seed(seed + 1 + rank)
    outcome = {"target": target, "bit_class": bit_class, "fault_step": fault_step, "fault_rank": fault_rank,
               "parameter": name, "element": position, "monitor": None, "delay": None, "false_alarm": None}
    for step in range(fault_step + args.detect_window + 1):
        fired = _step(task, ddp, optimizer, monitors, generator, rank, step, args.batch, injector)
        everyone = [None] * WORLD_SIZE
        dist.all_gather_object(everyone, fired)  # the benchmark's own exchange: stop every rank together
        monitor = _first_detection(everyone)
        if monitor is not None:
            if step < fault_step:
                outcome["false_alarm"] = (monitor, step)
            else:
                outcome["monitor"], outcome["delay"] = monitor, step - fault_step
            break
    everyone = [None] * WORLD_SIZE
    dist.all_gather_object(everyone, injector.injected)
    injected = [record for records in everyone for record in records]
    outcome["before"], outcome["after"] = (injected[0]["before"], injected[0]["after"]) if injected else (None, None)
    return outcome


def _clean_run(task, rank, args):
    ddp, state, optimizer, monitors = _build(task, args.seed, None, conservation=args.audit, record=True,
                                             vote=_vote_settings(args))
    generator = torch.Generator().manual_seed(args.seed + 1 + rank)
    alarms = []
    for step in range(args.clean_steps):
        fired = _step(task, ddp, optimizer, monitors, generator, rank, step, args.batch)
        everyone = [None] * WORLD_SIZE
        dist.all_gather_object(everyone, fired)
        if any(everyone):
            alarms.append((step, _first_detection(everyone)))
            break  # a monitor stopped the run: nothing later would be a clean step
    return {"steps": args.clean_steps, "alarms": alarms, "max_clean_spike_ratio": monitors.spike.max_clean_ratio,
            "staleness": monitors.staleness.report(), "val_loss": task.val_loss(ddp.module)}


OVERHEAD_CONFIGS = {  # name -> monitors on (each at its default settings), vote cadence, conservation audit
    "off": dict(parts=()),
    "finite guard": dict(parts=("finite",)),
    "update spike": dict(parts=("spike",)),
    "staleness /10": dict(parts=("staleness",)),
    "replica digest /10": dict(parts=("replica",)),
    "gradient vote /10": dict(parts=("vote",)),
    "defaults (all of the above)": dict(parts=ALL_PARTS),
    "defaults, vote /10 with window": dict(parts=ALL_PARTS, vote={"window": True}),
    "defaults, vote every step": dict(parts=ALL_PARTS, vote={"every": 1}),
    "defaults + conservation audit": dict(parts=ALL_PARTS, conservation=True),
    "staleness /1 (the lab's)": dict(parts=("staleness",), staleness_every=1),
}
DEFAULTS = "defaults (all of the above)"


def _overhead(task, rank, args):
    """Step times of every configuration, interleaved step by step in one run.

    Each configuration trains its own model (same seed, same data); a round runs one step
    of each, in an order that rotates every round, so a burst of load on the machine hits
    every configuration alike. Returns, per configuration and timed step: the slower rank's
    wall time, and the mean over the ranks of the step thread's CPU time and of the part
    of it the monitors' own calls took.
    """
    runs = {}
    for name, config in OVERHEAD_CONFIGS.items():
        ddp, _, optimizer, monitors = _build(task, args.seed, None, record=False,
                                             **{"conservation": False} | config)
        runs[name] = (ddp, optimizer, monitors, torch.Generator().manual_seed(args.seed + 1 + rank))
    names = list(runs)
    times = {name: [] for name in names}  # (wall, step CPU, monitors' CPU) per step
    for step in range(args.warm_steps + args.timed_steps):
        shift = step % len(names)
        for name in names[shift:] + names[:shift]:
            ddp, optimizer, monitors, generator = runs[name]
            monitor_cpu = monitors.cpu_seconds[0] if monitors is not None else 0.0
            dist.barrier()  # start every step together: time the step, not the skew
            started, started_cpu = time.perf_counter(), time.thread_time()
            fired = _step(task, ddp, optimizer, monitors, generator, rank, step, args.batch)
            wall, cpu = time.perf_counter() - started, time.thread_time() - started_cpu
            times[name].append((wall, cpu, (monitors.cpu_seconds[0] if monitors is not None else 0.0) - monitor_cpu))
            assert fired is None, f"alarm in the overhead run: {fired}"
    # A step ends when both ranks are done: the slower rank's wall time; CPU times: the ranks' mean.
    result = {}
    for name in names:
        timed = torch.tensor(times[name][args.warm_steps:], dtype=torch.float64).t().contiguous()
        slowest, mean = timed.clone(), timed.clone()
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        dist.all_reduce(mean, op=dist.ReduceOp.SUM)
        mean /= WORLD_SIZE
        result[name] = {"wall": slowest[0].tolist(), "cpu": mean[1].tolist(), "monitor_cpu": mean[2].tolist()}
    return result


def _rank_main(rank, args, workdir):
    OPTIMIZER[0] = TASK_DEFAULTS[args.task][1]
    store = dist.FileStore(os.path.join(workdir, "store"), WORLD_SIZE)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=120))
    torch.set_num_threads(1)  # two ranks on a small machine: one intra-op thread each
    task = get_task(args.task)
    PARAMETERS[:] = [(n, p.numel()) for n, p in task.build_model().named_parameters()]
    started = time.perf_counter()
    trials, everyone = [], []
    if not args.overhead_only:
        trials = [_trial(task, rank, args, target, bit_class, trial)
                  for target in TARGETS for bit_class in BIT_CLASSES for trial in range(args.trials)]
    detection_seconds = time.perf_counter() - started
    if not args.overhead_only:
        clean = _clean_run(task, rank, args)
        everyone = [None] * WORLD_SIZE
        dist.all_gather_object(everyone, clean)
    overhead = {} if args.detection_only else _overhead(task, rank, args)
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


BLOCK_STEPS = 10  # steps per block: every monitor's cadence divides it, so each block holds every check once


def _blocks(times: list[float]) -> list[float]:
    """Mean step of each whole block of ``BLOCK_STEPS`` consecutive steps."""
    return [statistics.fmean(times[i : i + BLOCK_STEPS]) for i in range(0, len(times) - BLOCK_STEPS + 1, BLOCK_STEPS)]


def overhead_summary(overhead: dict) -> dict:
    """Per configuration: median block, its ratio to ``off``, the median of the block-by-block
    (paired) ratios, the plain median step, the median CPU time of a step's thread and the
    monitors' own CPU time per step (mean: it counts the every-N checks) as a share of the
    CPU time of a step without monitors."""
    off_blocks = _blocks(overhead["off"]["wall"])
    off_block = statistics.median(off_blocks)
    off_cpu = statistics.median(overhead["off"]["cpu"])
    rows = {}
    for name, times in overhead.items():
        blocks = _blocks(times["wall"])
        rows[name] = {
            "block_median_s": statistics.median(blocks),
            "ratio": statistics.median(blocks) / off_block,
            "paired_ratio": statistics.median(b / o for b, o in zip(blocks, off_blocks)),
            "step_median_s": statistics.median(times["wall"]),
            "cpu_median_s": statistics.median(times["cpu"]),
            "cpu_ratio": statistics.median(times["cpu"]) / off_cpu,
            "monitor_cpu_s": statistics.fmean(times["monitor_cpu"]),
            "monitor_share": statistics.fmean(times["monitor_cpu"]) / off_cpu,
        }
    return rows


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
    return {"rows": rows, "overhead": overhead_summary(result["overhead"]) if result["overhead"] else None}


def print_report(summary: dict, result: dict, args) -> None:
    print(f"CPU: {describe_cpu()}")
    print(f"task {args.task}, batch {args.batch} per rank, {WORLD_SIZE} gloo ranks, torch {torch.__version__}")
    if not args.overhead_only:
        _print_detection(summary, result, args)
    if summary["overhead"]:
        _print_overhead(summary["overhead"], args)


def _print_detection(summary: dict, result: dict, args) -> None:
    vote = GradientAgreementMonitor(torch.nn.Linear(1, 1), **_vote_settings(args))
    print(f"detection: {args.trials} trials per row, fault at a random step in [{FIRST_FAULT_STEP}, "
          f"{FIRST_FAULT_STEP + args.fault_span}), random rank and entry; looked for {args.detect_window} steps; "
          f"gradient vote every {vote.every} step(s){' with window' if vote.window else ''}; "
          f"conservation audit {'on' if args.audit else 'off'}")
    print(f"{'target':<10} {'bit':<16} {'detected':>9} {'rate':>6} {'delay median/max':>17}  by monitor")
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


def _print_overhead(rows: dict, args) -> None:
    print(f"overhead: {args.timed_steps} timed steps per configuration after {args.warm_steps} warm-up steps, "
          f"configurations taking turns step by step; time of a step = the slower rank's")
    print(f"  {'configuration':<32} {'median 10-step block':>20} {'ratio':>6} {'paired':>7}   {'median step':>11}"
          f"   {'step CPU':>9} {'ratio':>6}   {'monitors CPU':>12} {'share':>6}")
    for name, row in rows.items():
        print(f"  {name:<32} {row['block_median_s'] * 1e3:>17.2f} ms {row['ratio']:>6.3f} {row['paired_ratio']:>7.3f}"
              f"   {row['step_median_s'] * 1e3:>8.2f} ms"
              f"   {row['cpu_median_s'] * 1e3:>6.2f} ms {row['cpu_ratio']:>6.3f}"
              f"   {row['monitor_cpu_s'] * 1e3:>9.3f} ms {row['monitor_share']:>6.1%}")
    defaults = rows[DEFAULTS]
    print(f"THE DEFAULTS COST {defaults['ratio']:.3f}x THE STEP WITHOUT MONITORS (median 10-step blocks "
          f"{defaults['block_median_s'] * 1e3:.2f} / {rows['off']['block_median_s'] * 1e3:.2f} ms; paired "
          f"{defaults['paired_ratio']:.3f}x; the monitors' own CPU {defaults['monitor_share']:.1%} of a step's; "
          f"budget 1.05x) on {describe_cpu()}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20, help="trials per (target, bit class)")
    parser.add_argument("--fault-span", type=int, default=10, help="fault step drawn from [5, 5 + span)")
    parser.add_argument("--detect-window", type=int, default=max(REPLICA_EVERY, VOTE_EVERY),
                        help="steps after the fault a detection may take (a check every N steps needs up to N - 1)")
    parser.add_argument("--clean-steps", type=int, default=200, help="steps of the false-alarm run")
    parser.add_argument("--warm-steps", type=int, default=5,
                        help="untimed steps per configuration before the timed ones")
    parser.add_argument("--timed-steps", type=int, default=200,
                        help=f"timed steps per configuration (blocks of {BLOCK_STEPS})")
    parser.add_argument("--task", choices=sorted(TASK_DEFAULTS), default="digits-mlp",
                        help="model and data: digits-mlp (85k parameters, ~4 ms steps) or pydoc-gpt (the default "
                             "experiment's task, 0.25M parameters, ~45 ms steps)")
    parser.add_argument("--overhead-only", action="store_true",
                        help="measure the overhead only (skip the detection trials and the clean run)")
    parser.add_argument("--detection-only", action="store_true",
                        help="run the detection trials and the clean run only (skip the overhead)")
    parser.add_argument("--vote-every", type=int, default=None,
                        help="cadence of the gradient vote in the detection trials and the clean run (default: the "
                             "monitor's default; 1 is the cadence before the 5%% budget)")
    parser.add_argument("--vote-window", action="store_true",
                        help="the gradient vote compares every step since the previous vote (window=True) in the "
                             "detection trials and the clean run")
    parser.add_argument("--audit", action="store_true",
                        help="turn the conservation audit on in the detection trials and the clean run (opt-in, "
                             "not a default)")
    parser.add_argument("--batch", type=int, default=None,
                        help="samples per rank per step (default: the task's experiment: 32 digits-mlp, 16 pydoc-gpt)")
    parser.add_argument("--hook-timeout", type=float, default=1.0, help="seconds: DDP group timeout with --audit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench_monitors.json"), help="JSON result file")
    args = parser.parse_args(argv)
    if args.batch is None:
        args.batch = TASK_DEFAULTS[args.task][0]
    if args.batch < 1 or args.timed_steps < BLOCK_STEPS or args.warm_steps < 0:
        parser.error(f"--batch must be >= 1, --timed-steps >= {BLOCK_STEPS}, --warm-steps >= 0")
    if args.vote_every is not None and args.vote_every < 1:
        parser.error("--vote-every must be >= 1 (steps)")
    if args.overhead_only and args.detection_only:
        parser.error("--overhead-only and --detection-only exclude each other")
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
                                    "cpu": describe_cpu(), "summary": summary, "clean": result["clean"],
                                    "trials": result["trials"], "overhead_step_seconds": result["overhead"],
                                    "wall_seconds": wall}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
