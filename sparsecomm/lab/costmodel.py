"""Projecting a measured run to more workers and another link: an alpha-beta cost model.

Every figure this module prints is MODELLED, labelled ``[modelled, boundary: ...]``; the
measured inputs it starts from are printed beside it, labelled ``[measured]``. A
modelled figure is a :class:`Modelled`, never a :class:`sparsecomm.lab.ledger.Figure`, so
the two cannot be added by accident.

The model (p workers, link rate B bytes/s per rank each way, alpha seconds per message):

- dense ring allreduce of D bytes: ``2 (p-1) alpha + 2 (p-1)/p * D / B``;
- sparse ring allgather of s bytes per rank: ``(p-1) alpha + (p-1) * s / B``;
- owner exchange (``exchange="owner"``) of the same payload: an all-to-all of its p
  shares and an all-gather of the owners' replies, ``2 (p-1) alpha + 2 (p-1)/p * s / B``
  (:func:`owner_exchange_seconds`): flat in p, as a ring allreduce of the payload;
- dense fallback (the hook's own rule): when ``p * s >= D`` the sparse payloads all
  together would not be smaller than the dense buffer, so the hook allreduces densely
  (for fp32 values + int32 indices: density >= D / (8 p n) = 1 / (2p)). The projection
  applies the rule to the step's totals (equal to the per-bucket rule when the buckets
  share one density) and says so in the arm's mode;
- alpha terms: one per collective; collectives per step = buckets per step x collectives
  per bucket (1 for allreduce and allgather; 3 for torch's PowerSGD: uncompressed
  tensors, P, Q). Buckets per step come from the top-k hook's own counters in
  ``hook_stats`` (calls / steps: DDP's real bucket layout), else are estimated as
  ceil(D / bucket_cap_mb) from the config (DDP never splits a parameter, so the true
  count can be higher);
- unpack (scatter-add of the p gathered payloads): ``p * k / r`` for k selected entries
  per rank per step, at r scattered adds per second measured from the run's
  ``hook_stats`` (seconds_unpack against elements_sent x world size; includes per-call
  overhead, so it overstates unpack at large p) or given with ``--unpack-rate``;
- projected step = compute + compress + exposed(comm + unpack). By default
  communication is assumed exposed (not overlapped with backward): an upper bound.
  ``--overlap`` is the optimistic bound: everything but the last bucket's share hides
  behind compute, exposed = max(net / buckets, net - compute); with one bucket per step
  the two are the same, since the only bucket is ready when backward ends;
- projected time to target = measured steps-to-target x projected step (evaluation
  excluded; boundary ``time_to_target``, modelled).

Inputs measured per arm (medians over the arm's finished seeds): compute seconds
(step - hook - comm wait: forward, backward, optimizer), compress seconds (host time
inside the hook), bytes sent and dense bytes per step, steps-to-target (first evaluation
reaching the target of :mod:`sparsecomm.lab.target`), the run's world size. The run's own
comm wait is never used: it is the communication of the link the run was measured on
(on ``loopback`` its rate is unknown), and for the top-k hook it also holds the unpack,
which is modelled separately. Assumptions: per-worker compute and compress do not change
with p (weak scaling, one worker per machine, same per-rank batch); compress does not
change with density; a ring is the collective's algorithm; PowerSGD's callback compute
(inside its comm wait) is not modelled, so its projection is a lower bound.

    sparsecomm project RUN_DIR --workers 32 --link 100gbit
    sparsecomm project RUN_DIR --against OTHER_RUN_DIR     (predicted vs measured step)
    sparsecomm project RUN_DIR --against OTHER_RUN_DIR --alpha-from-run   (alpha measured in RUN_DIR)

Needs no torch.
"""
import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from sparsecomm.lab.ledger import arm_ledger, format_value
from sparsecomm.links.spec import RATE_RANGE_BITS, Link, parse_link
from sparsecomm.lab.results import RunSummary, arms_configured_first, experiment_link, load_experiment, load_runs
from sparsecomm.lab.target import DENSE_ARM, Target, resolve_target

# One TCP message over ethernet through the kernel and gloo: ~25 us is a typical one-way
# cost when the link names no latency of its own. An assumption, printed as such.
DEFAULT_ALPHA_S = 25e-6
PAYLOAD_ELEMENT_BYTES = 8  # fp32 value + int32 index, when the run recorded no hook_stats
GRAD_ELEMENT_BYTES = 4  # fp32 gradients, likewise
DEFAULT_BUCKET_CAP_MB = 25.0  # DDP's default
MAX_WORKERS = 1_000_000
MAX_ALPHA_US = 1_000_000.0
MODEL_BOUNDARIES = ("step", "time_to_target")
# Bisection stops when the bracket is this narrow (relative): the projected times at the
# returned break-even then agree to ~1e-12 relative.
_BISECT_RTOL = 1e-13


# ---------------------------------------------------------------------------------------------
# The formulas


# Defined with the hook (the exchange choice uses them); re-exported here for the model's users.
from sparsecomm.comm.link_model import (  # noqa: E402,F401
    ring_allreduce_seconds,
    ring_allgather_seconds,
    owner_exchange_seconds,
    broadcast_seconds,
    exchange_bytes_received,
    falls_back_to_dense,
    unpack_seconds,
)


# ---------------------------------------------------------------------------------------------
# Modelled figures


@dataclass(frozen=True)
class Modelled:
    """A value computed by the cost model (not measured), with its unit and boundary."""

    value: float | None
    unit: str
    boundary: str
    note: str = ""

    def __post_init__(self):
        if self.boundary not in MODEL_BOUNDARIES:
            raise ValueError(f"boundary must be one of {MODEL_BOUNDARIES}, got {self.boundary!r}")

    def speedup_over(self, baseline: "Modelled") -> float | None:
        """``baseline / self`` for two modelled figures of one boundary (> 1: this is cheaper)."""
        if not isinstance(baseline, Modelled) or (baseline.boundary, baseline.unit) != (self.boundary, self.unit):
            raise TypeError(f"cannot divide modelled {self.unit} [{self.boundary}] by {baseline!r}")
        if self.value is None or baseline.value is None or self.value == 0:
            return None
        return baseline.value / self.value

    @property
    def label(self) -> str:
        return f"[modelled, boundary: {self.boundary}]"

    @property
    def shown(self) -> str:
        """The value with its unit, or ``n/a``; without the label."""
        return "n/a" if self.value is None else format_value(self.value, self.unit)

    def __str__(self) -> str:
        return f"{self.shown} {self.label}"

    def to_json(self) -> dict:
        return {"value": self.value, "unit": self.unit, "boundary": self.boundary, "kind": "modelled",
                "note": self.note}


def _measured_json(value, unit: str, boundary: str | None = None) -> dict:
    return {"value": value, "unit": unit, "boundary": boundary, "kind": "measured"}


def format_rate(bits_per_s: float) -> str:
    for scale, name in ((1e12, "Tbit/s"), (1e9, "Gbit/s"), (1e6, "Mbit/s"), (1e3, "kbit/s")):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:.3g} {name}"
    return f"{bits_per_s:.3g} bit/s"


# ---------------------------------------------------------------------------------------------
# Inputs measured in a run


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


# ---------------------------------------------------------------------------------------------
# Projection


PROJECTED_EXCHANGES = ("allgather", "owner", "auto")


@dataclass(frozen=True)
class Scenario:
    """Where to project to: p workers on a link, and the model's switches."""

    workers: int
    link: Link
    alpha_s: float
    alpha_source: str
    overlap: bool = False
    unpack_adds_per_s: float | None = None  # override of the measured rate
    exchange: str = "allgather"  # how the top-k arms' payloads travel: allgather, owner, or auto (the cheaper)

    def __post_init__(self):
        if self.exchange not in PROJECTED_EXCHANGES:
            raise ValueError(f"exchange must be one of {PROJECTED_EXCHANGES}, got {self.exchange!r}")
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or not 2 <= self.workers <= MAX_WORKERS:
            raise ValueError(f"workers must be an integer in [2, {MAX_WORKERS}], got {self.workers!r}")
        if not self.link.emulated:
            raise ValueError(f"link {self.link.name!r} has no known rate; projecting needs a rate such as '10gbit'")
        if not (math.isfinite(self.alpha_s) and 0 <= self.alpha_s <= MAX_ALPHA_US * 1e-6):
            raise ValueError(f"alpha must be in [0, {MAX_ALPHA_US:.0f}] us, got {self.alpha_s * 1e6:g} us")

    @property
    def rate_bytes_per_s(self) -> float:
        return self.link.bytes_per_s

    def with_rate(self, bits_per_s: float) -> "Scenario":
        return replace(self, link=Link(format_rate(bits_per_s), bits_per_s, self.link.latency_s))


def make_scenario(workers: int, link: str | Link, *, alpha_us: float | None = None, overlap: bool = False,
                  unpack_adds_per_s: float | None = None, exchange: str = "allgather") -> Scenario:
    """A scenario with alpha from ``alpha_us``, else the link's latency, else :data:`DEFAULT_ALPHA_S`."""
    link = parse_link(link) if isinstance(link, str) else link
    if alpha_us is not None:
        alpha, source = alpha_us * 1e-6, "given"
    elif link.latency_s > 0:
        alpha, source = link.latency_s, "the link's latency"
    else:
        alpha, source = DEFAULT_ALPHA_S, "assumed: the link names no latency; a typical TCP ethernet message"
    return Scenario(workers, link, alpha, source, overlap, unpack_adds_per_s, exchange)


@dataclass(frozen=True)
class ArmProjection:
    arm: str
    mode: str  # "allreduce", "sparse allgather", "sparse owner", "dense fallback"
    density: float | None  # allgather arms: the density projected (measured one when not given)
    comm_s: float
    unpack_s: float
    exposed_s: float  # of comm + unpack, after overlap
    step: Modelled
    time_to_target: Modelled
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {"arm": self.arm, "mode": self.mode, "density": self.density,
                "comm_seconds": Modelled(self.comm_s, "s", "step").to_json(),
                "unpack_seconds": Modelled(self.unpack_s, "s", "step").to_json(),
                "step": self.step.to_json(), "time_to_target": self.time_to_target.to_json(),
                "notes": list(self.notes)}


def project_arm(arm: ArmInputs, run: RunInputs, scenario: Scenario, density: float | None = None) -> ArmProjection:
    """Project one arm's step (and time to target) to ``scenario``.

    ``density``: for a top-k (allgather) arm, project at this density instead of the
    measured one (payload = density x entries x payload bytes; compress time as measured).
    """
    p, buckets = scenario.workers, run.buckets_per_step
    rate, alpha = scenario.rate_bytes_per_s, scenario.alpha_s
    notes = []
    if arm.sparse:
        if density is None:
            density = arm.density
            payload = arm.bytes_sent
        else:
            payload = density * arm.elements_per_step * arm.payload_element_bytes
        adds_rate = scenario.unpack_adds_per_s or arm.unpack_adds_per_s
        entries = payload / arm.payload_element_bytes
        # (exchange, comm, unpack adds): the all-gather adds p payloads; an owner adds the p
        # messages of its range (one payload in all) and decodes the p replies (another).
        options = {"allgather": (ring_allgather_seconds(payload, p, rate_bytes_per_s=rate, alpha_s=alpha,
                                                        collectives=buckets), p * entries,
                                 falls_back_to_dense(payload, arm.bytes_dense, p)),
                   "owner": (owner_exchange_seconds(payload, p, rate_bytes_per_s=rate, alpha_s=alpha,
                                                    collectives=buckets), 2 * entries,
                             falls_back_to_dense(payload / p, arm.bytes_dense, p))}
        candidates = ("allgather", "owner") if scenario.exchange == "auto" else (scenario.exchange,)

        def cost(name):
            comm, adds, dense = options[name]
            if dense:
                return ring_allreduce_seconds(arm.bytes_dense, p, rate_bytes_per_s=rate, alpha_s=alpha,
                                              collectives=buckets)
            return comm + (adds / adds_rate if adds_rate else 0.0)

        chosen = min(candidates, key=cost)
        comm, adds, dense = options[chosen]
        if dense:
            mode, unpack = "dense fallback", 0.0
            comm = ring_allreduce_seconds(arm.bytes_dense, p, rate_bytes_per_s=rate, alpha_s=alpha, collectives=buckets)
            notes.append(f"p x {'payload' if chosen == 'allgather' else 'reply'} >= dense bytes: the hook allreduces "
                         f"densely (compress kept at the arm's measured {format_value(arm.compress_s, 's')})")
        else:
            mode = f"sparse {chosen}"
            if adds_rate is None:
                unpack = 0.0
                notes.append("unpack not modelled: the run recorded no unpack time and no --unpack-rate was given")
            else:
                unpack = adds / adds_rate
            if chosen == "owner":
                notes.append("owner exchange: the owner's second select + encode is not in the measured compress "
                             "time; its payload is taken equal to the all-gather's")
    else:
        mode, unpack = "allreduce", 0.0
        comm = ring_allreduce_seconds(arm.bytes_sent, p, rate_bytes_per_s=rate, alpha_s=alpha,
                                      collectives=buckets * arm.collectives_per_bucket)
        if arm.collectives_per_bucket > 1:
            notes.append("PowerSGD: its callback compute is inside the measured comm wait and not modelled "
                         "(a lower bound)")
    net = comm + unpack
    exposed = max(net / buckets, net - arm.compute_s) if scenario.overlap else net
    step = arm.compute_s + arm.compress_s + exposed
    if arm.steps_to_target is None:
        ttt = Modelled(None, "s", "time_to_target", f"steps-to-target not measured: {arm.steps_note or 'no target'}")
    else:
        ttt = Modelled(arm.steps_to_target * step, "s", "time_to_target",
                       "measured steps-to-target x modelled step; evaluation excluded")
    return ArmProjection(arm.arm, mode, density, comm, unpack, exposed, Modelled(step, "s", "step"), ttt, tuple(notes))


# ---------------------------------------------------------------------------------------------
# Break-even


@dataclass(frozen=True)
class BreakEven:
    """Where an arm's modelled cost equals dense's. ``kind``: below / above / always / never / n/a."""

    quantity: str  # "density" or "link rate"
    boundary: str
    kind: str
    value: float | None  # the crossing (density fraction, or bits/s)
    text: str

    def to_json(self) -> dict:
        return {"quantity": self.quantity, "boundary": self.boundary, "kind": self.kind, "value": self.value,
                "text": self.text, "modelled": True}


def _bisect(f, lo: float, hi: float) -> float:
    """A root of ``f`` in [lo, hi] (signs differ at the ends), bisecting in log space."""
    flo = f(lo)
    for _ in range(400):
        mid = math.sqrt(lo * hi)
        fmid = f(mid)
        if fmid == 0:
            return mid
        if (fmid < 0) == (flo < 0):
            lo, flo = mid, fmid
        else:
            hi = mid
        if hi / lo - 1 < _BISECT_RTOL:
            break
    return math.sqrt(lo * hi)


def _crossings(f, lo: float, hi: float, num: int = 400) -> tuple[list[float], list[bool]]:
    """Roots of ``f`` on [lo, hi] (log grid + bisection) and whether ``f < 0`` on each grid point."""
    grid = [lo * (hi / lo) ** (i / (num - 1)) for i in range(num)]
    values = [f(x) for x in grid]
    roots = [_bisect(f, a, b) for a, b, fa, fb in zip(grid, grid[1:], values, values[1:]) if (fa < 0) != (fb < 0)]
    return roots, [v < 0 for v in values]


def _weights(arm: ArmInputs, dense: ArmInputs, boundary: str) -> tuple[float, float] | None:
    if boundary == "step":
        return 1.0, 1.0
    if arm.steps_to_target is None or dense.steps_to_target is None:
        return None
    return arm.steps_to_target, dense.steps_to_target


def _describe(quantity: str, boundary: str, roots, wins, lo, hi, fmt, upper_note: str) -> BreakEven:
    if all(wins):
        return BreakEven(quantity, boundary, "always", None,
                         f"always: {quantity} {fmt(lo)}..{fmt(hi)}{upper_note}, cheaper everywhere")
    if not any(wins):
        return BreakEven(quantity, boundary, "never", None,
                         f"never: dense is as cheap or cheaper at every {quantity} {fmt(lo)}..{fmt(hi)}{upper_note}")
    if len(roots) == 1:
        kind = "below" if wins[0] else "above"
        return BreakEven(quantity, boundary, kind, roots[0], f"{kind} {fmt(roots[0])}")
    return BreakEven(quantity, boundary, "intervals", roots[0],
                     f"cheaper on several intervals; crossings at {', '.join(fmt(r) for r in roots)}")


def break_even_density(arm: ArmInputs, dense: ArmInputs, run: RunInputs, scenario: Scenario,
                       boundary: str = "step") -> BreakEven:
    """The density below which ``arm`` (top-k) is cheaper than dense at ``scenario``.

    Searched between one entry per bucket and the dense-fallback density (above it the
    hook allreduces densely, so the arm is dense with its own compute/compress). For
    ``time_to_target`` both arms' measured steps-to-target weight their steps: the steps
    ratio measured at the run's density is assumed to hold at every density.
    """
    if not arm.sparse:
        raise ValueError(f"arm {arm.arm!r} sends no top-k payload: it has no density to solve for")
    weights = _weights(arm, dense, boundary)
    if weights is None:
        return BreakEven("density", boundary, "n/a", None, "n/a: the target was not reached by both arms")
    w_arm, w_dense = weights
    dense_step = project_arm(dense, run, scenario).step.value

    def f(density):
        return w_arm * project_arm(arm, run, scenario, density).step.value - w_dense * dense_step

    fallback = arm.bytes_dense / (scenario.workers * arm.elements_per_step * arm.payload_element_bytes)
    hi = min(1.0, fallback) * (1 - 1e-9)
    lo = min(run.buckets_per_step / arm.elements_per_step, hi / 10)
    roots, wins = _crossings(f, lo, hi)
    note = f" (dense fallback from {fallback:.3g})" if fallback <= 1 else ""
    return _describe("density", boundary, roots, wins, lo, hi, lambda d: f"{d:.3g}", note)


def break_even_rate(arm: ArmInputs, dense: ArmInputs, run: RunInputs, scenario: Scenario,
                    boundary: str = "step") -> BreakEven:
    """The link rate (bits/s) below which ``arm`` at its measured density is cheaper than dense."""
    weights = _weights(arm, dense, boundary)
    if weights is None:
        return BreakEven("link rate", boundary, "n/a", None, "n/a: the target was not reached by both arms")
    if arm.sparse and falls_back_to_dense(arm.bytes_sent, arm.bytes_dense, scenario.workers):
        return BreakEven("link rate", boundary, "n/a", None,
                         f"n/a: at {scenario.workers} workers density {arm.density:.3g} falls back to dense")
    w_arm, w_dense = weights

    def f(bits):
        at = scenario.with_rate(bits)
        return w_arm * project_arm(arm, run, at).step.value - w_dense * project_arm(dense, run, at).step.value

    lo, hi = RATE_RANGE_BITS
    roots, wins = _crossings(f, lo, hi)
    return _describe("link rate", boundary, roots, wins, lo, hi, format_rate, "")


# ---------------------------------------------------------------------------------------------
# The whole projection


@dataclass(frozen=True)
class Projection:
    run: RunInputs
    scenario: Scenario
    arms: tuple[ArmProjection, ...]
    tables: dict = field(default_factory=dict)  # arm -> tuple of ArmProjection at the requested densities
    break_even: dict = field(default_factory=dict)  # arm -> list of BreakEven


def assumptions(run: RunInputs, scenario: Scenario) -> list[str]:
    lines = [
        f"alpha {scenario.alpha_s * 1e6:g} us per message ({scenario.alpha_source})",
        f"{run.buckets_per_step} bucket(s) per step, {run.buckets_source}",
        "communication exposed (not overlapped with backward): an upper bound" if not scenario.overlap else
        "overlap: all but the last bucket's communication hides behind compute (optimistic bound)",
        "compute and compress per worker as measured at the run's world size (weak scaling)",
        f"run's own comm wait (link {run.link}) not used: communication is modelled",
    ]
    if run.not_modelled:
        lines.append(f"not projected: {', '.join(run.not_modelled)} (local steps with an outer sync, or nothing "
                     "sent: one collective per period, which this model does not cover)")
    if scenario.exchange != "allgather":
        how = ("through range owners" if scenario.exchange == "owner"
               else "by the cheaper of all-gather and owner, per arm")
        lines.append(f"top-k arms exchanged {how} (--exchange), whatever exchange the run used")
    if scenario.unpack_adds_per_s:
        lines.append(f"unpack rate {scenario.unpack_adds_per_s:.3g} adds/s (assumed, --unpack-rate)")
    else:
        lines.append("unpack rate measured from hook_stats (includes per-call overhead)")
    return lines


def project(run: RunInputs, scenario: Scenario, densities: tuple[float, ...] = ()) -> Projection:
    arms = tuple(project_arm(a, run, scenario) for a in run.arms)
    dense = run.arm(DENSE_ARM)
    tables, breaks = {}, {}
    for a in run.arms:
        if a.sparse and densities:
            tables[a.arm] = tuple(project_arm(a, run, scenario, d) for d in densities)
        if dense is None or a.arm == DENSE_ARM:
            continue
        found = []
        if a.sparse:
            found += [break_even_density(a, dense, run, scenario, b) for b in MODEL_BOUNDARIES]
        found += [break_even_rate(a, dense, run, scenario, b) for b in MODEL_BOUNDARIES]
        breaks[a.arm] = found
    return Projection(run, scenario, arms, tables, breaks)


def _adds(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.3g}/s"


def _speedup(arm: Modelled, dense: Modelled | None) -> str:
    ratio = arm.speedup_over(dense) if dense is not None else None
    return "n/a" if ratio is None else f"{ratio:.2f}x"


def format_projection(projection: Projection) -> str:
    run, scen = projection.run, projection.scenario
    dense = next((p for p in projection.arms if p.arm == DENSE_ARM), None)
    lines = [
        "sparsecomm project: MODELLED figures (alpha-beta cost model), not measurements",
        f"from run {run.run_dir}: {run.name}, measured on link {run.link} with {run.world_size} ranks",
        f"projected to {scen.workers} workers on link {scen.link.name} "
        f"({format_rate(scen.link.rate_bits_per_s)} per rank each way)",
        run.target.describe(),
        "assumptions:",
        *[f"  - {line}" for line in assumptions(run, scen)],
        "",
        "measured inputs [measured, medians over seeds]",
        f"  {'arm':<11} {'seeds':>5} {'compute':>9} {'compress':>9} {'sent/step':>10} {'dense/step':>10} "
        f"{'density':>8} {'unpack rate':>12} {'steps-to-target':>16}",
    ]
    for a in run.arms:
        steps = f"{a.steps_to_target:g}" if a.steps_to_target is not None else (a.steps_note or "n/a")
        lines.append(
            f"  {a.arm:<11} {a.num_seeds:>5} {format_value(a.compute_s, 's'):>9} {format_value(a.compress_s, 's'):>9} "
            f"{format_value(a.bytes_sent, 'B'):>10} {format_value(a.bytes_dense, 'B'):>10} "
            f"{(f'{a.density:.3g}' if a.sparse else '-'):>8} {_adds(a.unpack_adds_per_s):>12} {steps:>16}"
        )
    lines += [
        "",
        f"projected per arm at {scen.workers} workers, {scen.link.name} [modelled]",
        f"  {'arm':<11} {'mode':<16} {'comm':>9} {'unpack':>9} {'step':>9} {'vs dense':>8} "
        f"{'time-to-target':>14} {'vs dense':>8}",
    ]
    for p in projection.arms:
        lines.append(
            f"  {p.arm:<11} {p.mode:<16} {format_value(p.comm_s, 's'):>9} {format_value(p.unpack_s, 's'):>9} "
            f"{format_value(p.step.value, 's'):>9} {_speedup(p.step, dense and dense.step):>8} "
            f"{p.time_to_target.shown:>14} "
            f"{_speedup(p.time_to_target, dense and dense.time_to_target):>8}"
        )
        lines += [f"    note: {n}" for n in p.notes]
    lines.append("  step: [modelled, boundary: step]; time-to-target: [modelled, boundary: time_to_target] "
                 "= measured steps x modelled step")
    for arm, rows in projection.tables.items():
        lines += ["", f"{arm} at other densities [modelled; compress and steps-to-target as measured]",
                  f"  {'density':>8} {'mode':<16} {'step':>9} {'vs dense':>8} {'time-to-target':>14}"]
        for p in rows:
            lines.append(f"  {p.density:>8.3g} {p.mode:<16} {format_value(p.step.value, 's'):>9} "
                         f"{_speedup(p.step, dense and dense.step):>8} "
                         f"{p.time_to_target.shown:>14}")
    if projection.break_even:
        lines += ["", f"break-even against dense at {scen.workers} workers [modelled]: where each arm is cheaper",
                  f"  (density: on {scen.link.name}; link rate: at the arm's measured density)"]
        for arm, found in projection.break_even.items():
            lines.append(f"  {arm}:")
            lines += [f"    {b.quantity:<9} {'[' + b.boundary + ']':<16} {b.text}" for b in found]
        lines.append("  [time_to_target] weights each arm's step by its measured steps-to-target, "
                     "assumed to hold at every density and rate")
    elif dense is None:
        lines += ["", f"no {DENSE_ARM!r} arm in the run: no break-even"]
    return "\n".join(lines)


def projection_json(projection: Projection) -> dict:
    run, scen = projection.run, projection.scenario
    return {
        "kind": "projection",
        "modelled": True,
        "run_dir": run.run_dir,
        "run_link": run.link,
        "run_world_size": run.world_size,
        "workers": scen.workers,
        "link": scen.link.name,
        "rate_bits_per_s": scen.link.rate_bits_per_s,
        "alpha_s": scen.alpha_s,
        "overlap": scen.overlap,
        "buckets_per_step": run.buckets_per_step,
        "target_val_loss": run.target.val_loss,
        "assumptions": assumptions(run, scen),
        "measured": {a.arm: {
            "compute_seconds": _measured_json(a.compute_s, "s", "step"),
            "compress_seconds": _measured_json(a.compress_s, "s", "step"),
            "bytes_sent_per_step": _measured_json(a.bytes_sent, "B", "step"),
            "bytes_dense_per_step": _measured_json(a.bytes_dense, "B", "step"),
            "steps_to_target": _measured_json(a.steps_to_target, "steps", "steps_to_target"),
            "density": a.density, "collective": a.collective, "num_seeds": a.num_seeds,
        } for a in run.arms},
        "projected": [p.to_json() for p in projection.arms],
        "densities": {arm: [p.to_json() for p in rows] for arm, rows in projection.tables.items()},
        "break_even": {arm: [b.to_json() for b in found] for arm, found in projection.break_even.items()},
    }


# ---------------------------------------------------------------------------------------------
# Validation: predict a run measured on an emulated link from a run measured elsewhere


@dataclass(frozen=True)
class ValidationRow:
    arm: str
    predicted: Modelled
    measured_step_s: float
    measured_comm_wait_s: float

    @property
    def relative_error(self) -> float:
        return (self.predicted.value - self.measured_step_s) / self.measured_step_s


@dataclass(frozen=True)
class Validation:
    source: RunInputs
    other: RunInputs
    scenario: Scenario
    rows: tuple[ValidationRow, ...]


def validate(source_dir: str | Path, other_dir: str | Path, *, alpha_us: float | None = None,
             overlap: bool = False, unpack_adds_per_s: float | None = None,
             alpha_from_run: bool = False) -> Validation:
    """Predict ``other_dir``'s per-arm step from ``source_dir``'s compute/compress + the model.

    The model is evaluated at the other run's link (its config ``link``) and world size.
    The source's own comm wait is dropped (on loopback it is the whole communication time
    at an unknown rate), as in every projection.
    """
    source, other = read_run(source_dir), read_run(other_dir)
    link = parse_link(other.link)
    if not link.emulated:
        raise ValueError(f"{other_dir}: measured on link {other.link!r}, whose rate is unknown: nothing to predict "
                         "(validate against a run with an emulated link, e.g. --link 1gbit)")
    scenario = make_scenario(other.world_size, link, alpha_us=alpha_us, overlap=overlap,
                             unpack_adds_per_s=unpack_adds_per_s)
    if alpha_from_run:
        alpha = measured_alpha_s(source)
        if alpha is None:
            raise ValueError(f"{source_dir}: --alpha-from-run needs a top-k arm to measure the per-message cost from")
        scenario = replace(scenario, alpha_s=alpha,
                           alpha_source="measured in the source run: its smallest sparse arm's comm wait less "
                                        "unpack, per message (this machine's fixed cost per collective)")
    rows = []
    for arm in source.arms:
        measured = other.arm(arm.arm)
        if measured is None:
            continue
        rows.append(ValidationRow(arm.arm, project_arm(arm, source, scenario).step, measured.step_s,
                                  measured.comm_wait_s))
    if not rows:
        raise ValueError(f"{source_dir} and {other_dir} share no arm")
    return Validation(source, other, scenario, tuple(rows))


def format_validation(v: Validation) -> str:
    lines = [
        "sparsecomm project --against: MODELLED step of each arm vs the step MEASURED in the other run",
        f"model inputs from {v.source.run_dir} (link {v.source.link}, {v.source.world_size} ranks); "
        f"measured in {v.other.run_dir} (link {v.other.link}, {v.other.world_size} ranks)",
        "assumptions:",
        *[f"  - {line}" for line in assumptions(v.source, v.scenario)],
        "",
        f"  {'arm':<11} {'predicted step':>15} {'measured step':>14} {'rel. error':>10} {'measured comm wait':>19}",
    ]
    for r in v.rows:
        lines.append(f"  {r.arm:<11} {format_value(r.predicted.value, 's'):>15} {format_value(r.measured_step_s, 's'):>14} "
                     f"{r.relative_error:>+10.1%} {format_value(r.measured_comm_wait_s, 's'):>19}")
    lines.append("  predicted: [modelled, boundary: step]; measured: [measured, boundary: step, median over seeds]")
    return "\n".join(lines)


def validation_json(v: Validation) -> dict:
    return {
        "kind": "validation",
        "source_run": v.source.run_dir, "source_link": v.source.link,
        "other_run": v.other.run_dir, "other_link": v.other.link, "workers": v.scenario.workers,
        "alpha_s": v.scenario.alpha_s,
        "assumptions": assumptions(v.source, v.scenario),
        "arms": [{"arm": r.arm, "predicted_step": r.predicted.to_json(),
                  "measured_step": _measured_json(r.measured_step_s, "s", "step"),
                  "relative_error": r.relative_error} for r in v.rows],
    }


# ---------------------------------------------------------------------------------------------
# CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sparsecomm project",
        description="Project a run's per-arm step and time-to-target to more workers and another link "
                    "(alpha-beta cost model; every output figure is modelled).",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by `sparsecomm compare`")
    p.add_argument("--workers", type=int, default=None, help=f"number of workers p, in [2, {MAX_WORKERS}]")
    p.add_argument("--link", default=None, help="link per worker, e.g. 1gbit, 100gbit, 10gbit@50us (not loopback)")
    p.add_argument("--alpha-us", type=float, default=None,
                   help=f"latency per message in us, in [0, {MAX_ALPHA_US:.0f}] (default: the link's latency, "
                        f"else {DEFAULT_ALPHA_S * 1e6:g} us, a typical TCP ethernet message)")
    p.add_argument("--density", type=float, nargs="+", default=(),
                   help="densities in (0, 1] at which to tabulate the top-k arms")
    p.add_argument("--overlap", action="store_true",
                   help="let all but the last bucket's communication hide behind compute (default: exposed)")
    p.add_argument("--unpack-rate", type=float, default=None,
                   help="scatter-adds per second for the unpack, > 0 (default: measured from hook_stats)")
    p.add_argument("--exchange", choices=PROJECTED_EXCHANGES, default="allgather",
                   help="how the top-k arms' payloads travel in the projection: allgather (default), owner "
                        "(exchange='owner': flat in the number of workers), auto (the cheaper of the two)")
    p.add_argument("--against", metavar="OTHER_RUN_DIR", default=None,
                   help="validate: predict OTHER_RUN_DIR's per-arm step (its link and world size) from RUN_DIR")
    p.add_argument("--alpha-from-run", action="store_true",
                   help="with --against: take alpha from RUN_DIR (its smallest top-k arm's comm wait per message: "
                        "this machine's fixed cost per collective) instead of --alpha-us or the default")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.alpha_us is not None and not (math.isfinite(args.alpha_us) and 0 <= args.alpha_us <= MAX_ALPHA_US):
        parser.error(f"--alpha-us must be a number in [0, {MAX_ALPHA_US:.0f}] (microseconds), got {args.alpha_us}")
    if args.unpack_rate is not None and not (math.isfinite(args.unpack_rate) and args.unpack_rate > 0):
        parser.error(f"--unpack-rate must be a finite number > 0 (adds per second), got {args.unpack_rate}")
    bad = [d for d in args.density if not (math.isfinite(d) and 0 < d <= 1)]
    if bad:
        parser.error(f"--density values must be in (0, 1], got {bad[0]}")
    if args.alpha_from_run and (args.against is None or args.alpha_us is not None):
        parser.error("--alpha-from-run is for --against OTHER_RUN_DIR, and replaces --alpha-us (give one of them)")
    if args.against is not None:
        if args.workers is not None or args.link is not None or args.density:
            parser.error("--against takes the world size and link from OTHER_RUN_DIR; "
                         "do not give --workers, --link or --density with it")
    else:
        if args.workers is None or args.link is None:
            parser.error("--workers and --link are required (or give --against OTHER_RUN_DIR)")
        if not 2 <= args.workers <= MAX_WORKERS:
            parser.error(f"--workers must be an integer in [2, {MAX_WORKERS}], got {args.workers}")
        try:
            link = parse_link(args.link)
        except ValueError as error:
            parser.error(f"--link: {error}")
        if not link.emulated:
            parser.error("--link loopback has no known rate, so nothing can be projected onto it; "
                         "give a rate such as 1gbit, 10gbit, 100gbit or 10gbit@50us")
    for path in (args.run_dir, args.against):
        if path is not None and not Path(path).is_dir():
            print(f"sparsecomm project: error: {path} is not a directory", file=sys.stderr)
            return 2
    try:
        if args.against is not None:
            v = validate(args.run_dir, args.against, alpha_us=args.alpha_us, overlap=args.overlap,
                         unpack_adds_per_s=args.unpack_rate, alpha_from_run=args.alpha_from_run)
            print(json.dumps(validation_json(v), indent=1) if args.json else format_validation(v))
        else:
            scenario = make_scenario(args.workers, link, alpha_us=args.alpha_us, overlap=args.overlap,
                                     unpack_adds_per_s=args.unpack_rate, exchange=args.exchange)
            projection = project(read_run(args.run_dir), scenario, tuple(args.density))
            print(json.dumps(projection_json(projection), indent=1) if args.json else format_projection(projection))
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as exc:
        detail = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc)
        print(f"sparsecomm project: error: {detail}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
