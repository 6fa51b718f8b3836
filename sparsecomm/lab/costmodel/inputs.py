"""What the cost model starts from: one run directory's measured figures, per arm.

Medians over each arm's finished seeds: compute seconds (step - hook - comm wait: forward,
backward, optimizer), compress seconds (host time inside the hook), bytes sent and dense
bytes per step, the top-k hook's unpack rate and bucket count (from its ``hook_stats``),
steps-to-target (first evaluation reaching the target of :mod:`sparsecomm.lab.results.target`), and
the run's world size. The run's own comm wait is read but never projected: it is the
communication of the link the run was measured on (on ``loopback`` its rate is unknown).
"""
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from sparsecomm.comm.link_model import unpack_seconds
from sparsecomm.lab.ledger.items import arm_ledger
from sparsecomm.lab.results import RunSummary, arms_configured_first, experiment_link, load_experiment, load_runs
from sparsecomm.lab.results.target import Target, resolve_target

PAYLOAD_ELEMENT_BYTES = 8  # fp32 value + int32 index, when the run recorded no hook_stats
GRAD_ELEMENT_BYTES = 4  # fp32 gradients, likewise
DEFAULT_BUCKET_CAP_MB = 25.0  # DDP's default


@dataclass(frozen=True)
class ArmInputs:
    """One arm's measured figures: medians over its finished seeds."""

    arm: str
    hook: str
    collective: str  # "allreduce" or "allgather" (the top-k hook's sparse path)
    collectives_per_bucket: int
    num_seeds: int
    compute_s: float
    compress_s: float
    comm_wait_s: float
    step_s: float
    bytes_sent: float  # per rank per step (allgather: the payload s)
    bytes_dense: float  # the dense buffer D per step
    grad_element_bytes: float
    payload_element_bytes: float  # allgather arms: value + index bytes per selected entry
    unpack_adds_per_s: float | None  # allgather arms: measured scatter-add rate
    steps_to_target: float | None
    steps_note: str = ""

    @property
    def sparse(self) -> bool:
        return self.collective == "allgather"

    @property
    def elements_per_step(self) -> float:
        return self.bytes_dense / self.grad_element_bytes

    @property
    def density(self) -> float | None:
        """Measured fraction of entries sent per step (allgather arms)."""
        return self.bytes_sent / self.payload_element_bytes / self.elements_per_step if self.sparse else None


@dataclass(frozen=True)
class RunInputs:
    run_dir: str
    name: str
    link: str
    world_size: int
    buckets_per_step: int
    buckets_source: str
    target: Target
    arms: tuple[ArmInputs, ...]
    not_modelled: tuple[str, ...] = ()
    """Arms the formulas do not cover (local steps with an outer sync, or nothing sent)."""

    def arm(self, name: str) -> ArmInputs | None:
        return next((a for a in self.arms if a.arm == name), None)


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _hook_stats(run: RunSummary) -> dict | None:
    stats = run.extra.get("hook_stats")
    return stats if isinstance(stats, dict) and stats.get("steps") else None


def _buckets_per_step(runs: list[RunSummary], config: dict, dense_bytes: float) -> tuple[int, str]:
    ratios = []
    for run in runs:
        stats = _hook_stats(run)
        if stats is not None:
            calls = sum(stats.get(key) or 0 for key in ("sparse_calls", "warmup_calls", "fallback_calls"))
            ratios.append(calls / stats["steps"])
    if ratios:
        return max(1, round(statistics.median(ratios))), "from the top-k hook's calls per step (hook_stats)"
    cap_mb = config.get("bucket_cap_mb") or DEFAULT_BUCKET_CAP_MB
    estimate = max(1, math.ceil(dense_bytes / (cap_mb * 2**20)))
    return estimate, f"estimated as ceil(dense bytes / bucket_cap_mb {cap_mb:g} MiB); can be higher"


def _arm_inputs(arm: str, runs: list[RunSummary], target: Target, world_size: int) -> ArmInputs | None:
    ok = [r for r in runs if r.arm == arm and r.status == "ok" and r.median_compute_seconds is not None]
    if not ok:
        return None
    hook = str(ok[0].extra.get("hook") or "")
    with_stats = [(r, s) for r in ok if (s := _hook_stats(r)) is not None]
    stats = [s for _, s in with_stats]
    sparse = "topk_hook" in hook or (not hook and bool(stats))
    grad_bytes = _median([s["bytes_dense"] / s["elements_total"] for s in stats if s.get("elements_total")])
    grad_bytes = grad_bytes or GRAD_ELEMENT_BYTES
    payload_bytes = unpack_rate = None
    if sparse:
        # bytes_sent counts the dense warm-up/fallback calls too; take them out.
        payload_bytes = _median([
            (s["bytes_sent"] - (s["elements_total"] - s["elements_sparse"]) * grad_bytes) / s["elements_sent"]
            for s in stats if s.get("elements_sent")
        ])
        unpack_rate = _median([
            s["elements_sent"] * r.extra.get("world_size", world_size) / s["seconds_unpack"]
            for r, s in with_stats if s.get("elements_sent") and s.get("seconds_unpack")
        ])
    ledger = arm_ledger(arm, runs, target)
    return ArmInputs(
        arm=arm,
        hook=hook,
        collective="allgather" if sparse else "allreduce",
        collectives_per_bucket=3 if "powersgd" in hook.lower() else 1,
        num_seeds=len(ok),
        compute_s=_median(r.median_compute_seconds for r in ok),
        compress_s=_median(r.median_compress_seconds for r in ok),
        comm_wait_s=_median(r.median_comm_wait_seconds for r in ok),
        step_s=_median(r.median_step_seconds for r in ok),
        bytes_sent=_median(r.bytes_sent_per_step for r in ok),
        bytes_dense=_median(r.bytes_dense_per_step for r in ok),
        grad_element_bytes=grad_bytes,
        payload_element_bytes=payload_bytes or PAYLOAD_ELEMENT_BYTES,
        unpack_adds_per_s=unpack_rate,
        steps_to_target=ledger.steps_to_target.value,
        steps_note=ledger.steps_to_target.note,
    )


def read_run(run_dir: str | Path) -> RunInputs:
    """The measured inputs of a ``sparsecomm compare`` run directory."""
    experiment = load_experiment(run_dir)
    config = experiment["config"]
    runs = load_runs(run_dir)
    target = resolve_target(experiment, runs)
    order = arms_configured_first(config.get("arms") or [], runs)
    sizes = {r.extra.get("world_size") for r in runs if r.status == "ok"} - {None}
    world_size = int(sizes.pop()) if len(sizes) == 1 else int(config["world_size"])
    not_modelled = tuple(name for name in order if _trains_locally(name, runs))
    arms = tuple(a for a in (_arm_inputs(name, runs, target, world_size) for name in order
                             if name not in not_modelled) if a is not None)
    if not arms:
        raise ValueError(f"{run_dir}: no finished run with step timings")
    buckets, source = _buckets_per_step(runs, config, max(a.bytes_dense for a in arms))
    return RunInputs(str(run_dir), str(config.get("name", Path(run_dir).name)), experiment_link(experiment),
                     world_size, buckets, source, target, arms, not_modelled)


def _trains_locally(arm: str, runs: list[RunSummary]) -> bool:
    """An arm whose ranks train apart between syncs (sparse-delta) or never meet (local):
    one collective per period, not per bucket, which these formulas do not model."""
    stored = next((r.extra.get("arm_spec") for r in runs if r.arm == arm and isinstance(r.extra.get("arm_spec"), dict)),
                  None)
    return stored is not None and stored.get("reducer") in ("sparse-delta", "local")


def measured_alpha_s(run: RunInputs) -> float | None:
    """Per-message cost seen in ``run``: the sparse arm with the fewest bytes, its comm wait
    less its modelled unpack, per message ((p-1) x buckets); None without a sparse arm.

    On a run whose link carries its payload in microseconds (a few kB on loopback), what
    remains of the wait is the fixed cost of one collective on that machine: gloo's
    threads, the kernel, and ranks sharing cores. It is a property of the machine the run
    was measured on, not of a network: use it to validate the model on that machine
    (``--alpha-from-run``), not to project onto a cluster.
    """
    sparse = [a for a in run.arms if a.sparse and a.comm_wait_s is not None and a.bytes_sent]
    if not sparse:
        return None
    arm = min(sparse, key=lambda a: a.bytes_sent)
    unpack = (unpack_seconds(arm.bytes_sent / arm.payload_element_bytes, run.world_size, arm.unpack_adds_per_s)
              if arm.unpack_adds_per_s else 0.0)
    return max(0.0, arm.comm_wait_s - unpack) / ((run.world_size - 1) * run.buckets_per_step)

