"""``sparsecomm scale``: how each arm holds quality and traffic as the number of workers p grows.

Runs the paired experiment (dense + the other arms, same seeds and data order) once per
world size, each as its own experiment ``<experiment>-p<p>`` under --out, and reports per
(p, arm): the verdict against dense at that p (the equivalence test of ``sparsecomm
check``), the final metric's mean over seeds and its gap to dense, the bytes each rank sends
and receives per step, steps- and time-to-target (the ledger's, against a target derived at
each p from that p's dense runs), and per arm the growth of the bytes received per rank from
the smallest p to the largest. Then the bytes per rank per step the alpha-beta cost model
gives at p = 16, 32, ..., 1024 (modelled, never measured). Writes ``scaling.json``,
``scaling.md`` and ``scaling.png`` to ``<plots>/<experiment>-scaling/``::

    sparsecomm scale --experiment digits-quick --world-sizes 2 4 --arms dense topk-dgc sparseloco
    sparsecomm scale --experiment digits-quick --world-sizes 2 4 8 --seeds 0 1 2 --steps 200
    sparsecomm scale --experiment digits-quick --world-sizes 2 4 8 --batch global   # global batch fixed

What is fixed as p grows: by default the per-rank batch (``batch_size`` is per rank, so the
global batch is p x batch_size: weak scaling); ``--batch global`` fixes the global batch at
the smallest p's instead (batch_size x p_min / p per rank, refused when that does not divide;
its experiments are named ``<experiment>-p<p>-b<per-rank batch>`` where the batch differs).
The optimizer's settings (learning rate included) are the same at every p.

Bytes per rank per step (rank 0's): sent is the run's measured mean over the steps after
warm-up (the meter around every arm's hook, as in the ledger); received comes from the
hook's own counters: the top-k hook's last completed step, or a sparse-delta averager's
total over its steps. Torch's hooks (dense, fp16/bf16, PowerSGD) count no received bytes,
so theirs is derived as a ring allreduce of what they send, 2 (p-1)/p x sent (how the top-k
hook counts its own dense calls), and labelled derived.

Re-running with the same arguments reuses the finished runs. Runs that did not finish are
counted per (p, arm); a p whose dense runs all failed has the verdict ``unavailable``.
Exit codes: 0 the study was printed; 2 a bad argument or an unreadable result file; 130 /
143 stopped by Ctrl-C / SIGTERM (what was kept is printed).
"""
import argparse
import math
import os
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from sparsecomm.lab.experiment.compare import (
    LOCAL_RANKS_PER_CORE,
    add_experiment_source,
    add_job_arguments,
    add_link_argument, add_parallelism_argument,
    check_has_compared_arm,
    check_launcher_possible,
    check_link_possible,
    check_local_world_size,
    check_writable_directory,
    experiment_from_source,
    local_world_size_limit,
    parse_arguments,
    parse_arms,
    with_job_overrides,
)
from sparsecomm.lab.experiment.config import hsdp_shape_of
from sparsecomm.lab.ledger import exposed_fraction
from sparsecomm.lab.quantity import format_value
from sparsecomm.lab.sweep import UNAVAILABLE, VERDICT_MARKERS, aligned, fmt, markdown_table, run_and_read, run_point
from sparsecomm.lab.target import DENSE_ARM
from sparsecomm.lab.text import fold_lines

BATCH_MODES = ("per-rank", "global")
BASELINE = "baseline"  # dense's verdict cell: the arm the others are judged against
MODELLED_WORLD_SIZES = tuple(2**i for i in range(4, 11))  # 16, 32, ..., 1024
MODEL_MAX_WORLD_SIZE = MODELLED_WORLD_SIZES[-1]
SHARED_EXCHANGES = ("shared-index", "shared-mask")
"""Exchanges whose values are allreduced at indices every rank shares: modelled by :func:`ring_scaled`."""
RECEIVED_HOOK = "the top-k hook's counters (last completed step)"
RECEIVED_AVERAGER = "the averager's counters (total / steps: its syncs amortised)"
RECEIVED_RING = "derived: torch's hook counts none; ring allreduce of the bytes sent, 2(p-1)/p x sent"
RECEIVED_NOTHING = "nothing sent"


@dataclass(frozen=True)
class ScalePoint:
    world_size: int
    arm: str
    batch_size: int  # per rank
    verdict: str  # against dense at this world size; "baseline" for dense; "unavailable": no dense finished
    metric_gap: float | None  # mean paired difference to dense, > 0 worse (the verdict's mean_diff)
    final_metric_mean: float | None  # mean over the arm's finished seeds
    seeds_finished: int
    bytes_sent_per_step: float | None  # per rank, median over seeds
    bytes_received_per_step: float | None  # per rank, median over seeds
    received_source: str
    steps_to_target: float | None  # median over seeds; None if not reached in some seed
    time_to_target_s: float | None
    run_dir: str
    failed: int = 0  # this arm's runs that did not finish (any status but "ok", or missing)
    dense_failed: int = 0
    not_ok: str = ""
    exposed_comm_fraction: float | None = None  # median wait for communication after backward / median step


@dataclass(frozen=True)
class Study:
    """The base experiment and what varies: the world sizes, and how the batch follows them."""

    config: object  # ExperimentConfig: arms, seeds, steps, link, ...; world size set per point
    world_sizes: tuple[int, ...]  # sorted, distinct
    batch: str = "per-rank"

    def batch_size(self, p: int) -> int:
        """Samples per rank at world size ``p``."""
        if self.batch == "per-rank":
            return self.config.batch_size
        return self.config.batch_size * self.world_sizes[0] // p

    def point_config(self, p: int):
        """The experiment at world size ``p``: ``<name>-p<p>``, ``-b<batch>`` where the per-rank batch differs."""
        batch = self.batch_size(p)
        name = f"{self.config.name}-p{p}" + ("" if batch == self.config.batch_size else f"-b{batch}")
        return self.config.with_overrides(world_size=p, batch_size=batch, name=name)

    @property
    def stem(self) -> str:
        """Name of the study's plots folder: ``<experiment>-scaling`` (``-global<N>-scaling`` with --batch global)."""
        if self.batch == "global":
            return f"{self.config.name}-global{self.config.batch_size * self.world_sizes[0]}-scaling"
        return f"{self.config.name}-scaling"

    def describe_batch(self) -> str:
        sizes = ", ".join(f"{self.batch_size(p) * p} at p={p}" if self.batch == "per-rank" else
                          f"{self.batch_size(p)} at p={p}" for p in self.world_sizes)
        if self.batch == "per-rank":
            return (f"fixed: the per-rank batch, {self.config.batch_size} samples (--batch per-rank, weak scaling; "
                    f"the global batch grows with p: {sizes})")
        return (f"fixed: the global batch, {self.config.batch_size * self.world_sizes[0]} samples, the smallest p's "
                f"(--batch global; per rank: {sizes})")


def check_world_sizes(sizes: list[int]) -> tuple[int, ...]:
    """--world-sizes: at least two distinct integers in [2, the local limit]; returned sorted."""
    limit = local_world_size_limit()
    accepted = (f"an integer in [2, {limit}] (at most {LOCAL_RANKS_PER_CORE} ranks per CPU core x "
                f"{os.cpu_count() or 1} cores: every rank is started on this machine)")
    if len(sizes) < 2:
        raise ValueError(f"argument --world-sizes: give at least two world sizes to scale across, each {accepted}; "
                         f"got {sizes}")
    bad = [p for p in sizes if not 2 <= p <= limit]
    if bad:
        raise ValueError(f"argument --world-sizes: each must be {accepted}; got {bad[0]}")
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"argument --world-sizes: must be distinct, got {sizes}")
    return tuple(sorted(sizes))


def check_no_fixed_shape(parallelism: str, given_as: str, world_sizes: tuple[int, ...]) -> None:
    """Refuse ``hsdp:RxS``, which runs on R x S ranks exactly, so no study across world sizes
    can use it (said here, before the shape meets a world size it does not fit)."""
    shape = hsdp_shape_of(parallelism)
    if shape is not None:
        replicas, shards = shape
        raise ValueError(f"{given_as}: {parallelism} runs on exactly {replicas} x {shards} = {replicas * shards} "
                         f"ranks, but a scaling study runs every arm at each of --world-sizes "
                         f"{' '.join(map(str, world_sizes))}: it needs parallelism \"ddp\" (the default). To measure "
                         "HSDP at several sizes, run `sparsecomm compare --parallelism hsdp:RxS --world-size N` once "
                         "per shape (R x S = N)")


def check_global_batch(config, world_sizes: tuple[int, ...]) -> None:
    """--batch global: the smallest p's global batch must split evenly over every p."""
    total = config.batch_size * world_sizes[0]
    uneven = [p for p in world_sizes if total % p]
    if uneven:
        raise ValueError(f"argument --batch global: the global batch of the smallest world size, {total} samples "
                         f"(batch_size {config.batch_size} x {world_sizes[0]} ranks), does not split evenly over "
                         f"{', '.join(map(str, uneven))} ranks (--world-sizes {' '.join(map(str, world_sizes))}); "
                         f"choose world sizes that divide {total}, or --batch per-rank")


def make_study(args: argparse.Namespace) -> Study:
    """Every argument checked (ValueError naming it), every point's config built: nothing runs."""
    world_sizes = check_world_sizes(args.world_sizes)
    base = experiment_from_source(args)
    check_no_fixed_shape(args.parallelism or base.parallelism, "argument --parallelism" if args.parallelism else
                         f"experiment {base.name}: parallelism", world_sizes)
    arms, definitions = parse_arms(args.arms) if args.arms else (None, None)
    if arms is not None and DENSE_ARM not in arms:
        arms = (DENSE_ARM, *arms)  # the baseline every arm is judged against, at every p
    config = with_job_overrides(base, args, arms=arms, definitions=definitions)
    check_has_compared_arm(config, args)
    if config.link != "loopback":  # its own experiments and study beside the loopback ones
        config = config.with_overrides(name=f"{config.name}-{config.link}")
    if args.batch == "global":
        check_global_batch(config, world_sizes)
    study = Study(config, world_sizes, args.batch)
    for p in world_sizes:
        try:
            check_local_world_size(study.point_config(p))
        except ValueError as error:
            raise ValueError(f"argument --world-sizes: at world size {p} ({study.batch_size(p)} samples per rank): "
                             f"{error}") from None
    check_link_possible(config)
    check_launcher_possible(config)
    return study


# ---------------------------------------------------------------------------------------------
# What the runs recorded


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def received_per_step(run, world_size: int) -> tuple[float | None, str]:
    """Bytes rank 0 of ``run`` took in per step, and where the figure comes from."""
    from sparsecomm.comm.link_model import ring_allreduce_bytes

    stats = run.extra.get("hook_stats")
    reducer = (run.extra.get("arm_spec") or {}).get("reducer")
    if isinstance(stats, dict):
        last = stats.get("last_step")
        if isinstance(last, dict) and last.get("bytes_received") is not None:
            return float(last["bytes_received"]), RECEIVED_HOOK
        if stats.get("steps") and stats.get("bytes_received") is not None:
            return stats["bytes_received"] / stats["steps"], RECEIVED_AVERAGER
    if reducer == "local":
        return 0.0, RECEIVED_NOTHING
    if reducer in (None, "allreduce", "fp16", "bf16", "powersgd") and run.bytes_sent_per_step is not None:
        return float(ring_allreduce_bytes(run.bytes_sent_per_step, world_size)), RECEIVED_RING
    return None, "not recorded"


def points_at(outcome, study: Study, p: int) -> list[ScalePoint]:
    """One point per arm of the experiment at world size ``p``."""
    config = study.point_config(p)
    equivalence = {r.arm: r.equivalence for r in outcome.report.arms} if outcome.available else {}
    points = []
    for arm in config.arms:
        finished = [r for r in outcome.runs if r.arm == arm and r.finished]
        received = [received_per_step(r, p) for r in finished]
        entry = outcome.ledger.arm(arm) if outcome.available else None
        if not outcome.available:
            verdict, gap = UNAVAILABLE, None
        elif arm == DENSE_ARM:
            verdict, gap = BASELINE, None
        else:
            verdict, gap = equivalence[arm].verdict, equivalence[arm].mean_diff
        finals = [r.final_val_loss for r in finished]
        points.append(ScalePoint(
            world_size=p,
            arm=arm,
            batch_size=config.batch_size,
            verdict=verdict,
            metric_gap=gap,
            final_metric_mean=statistics.fmean(finals) if finals else None,
            seeds_finished=len(finished),
            bytes_sent_per_step=(entry.bytes_per_step.value if entry is not None
                                 else _median(r.bytes_sent_per_step for r in finished)),
            bytes_received_per_step=_median(value for value, _ in received),
            received_source="; ".join(dict.fromkeys(source for _, source in received)),
            steps_to_target=entry.steps_to_target.value if entry is not None else None,
            time_to_target_s=entry.time_to_target.value if entry is not None else None,
            exposed_comm_fraction=exposed_fraction(entry) if entry is not None else None,
            run_dir=str(outcome.run_dir),
            **outcome.failures(arm),
        ))
    return points


def run_study(study: Study, out_root: Path) -> list[ScalePoint]:
    """One paired experiment per world size, smallest first; a point per (p, arm)."""
    points = []
    for p in study.world_sizes:
        config = study.point_config(p)
        print(f"scale: world size {p}: {len(config.arms)} arms x {len(config.seeds)} seeds, {config.batch_size} "
              f"samples per rank (global {p * config.batch_size}) -> {out_root / config.name}", flush=True)
        points += points_at(run_point(config, out_root), study, p)
    return points


def growth(points: list[ScalePoint], arm: str, low: int, high: int) -> float | None:
    """Bytes received per rank at world size ``high`` over those at ``low`` (None: not both known)."""
    at = {p.world_size: p.bytes_received_per_step for p in points if p.arm == arm}
    if not at.get(low) or at.get(high) is None:
        return None
    return at[high] / at[low]


# ---------------------------------------------------------------------------------------------
# The cost model's bytes per rank at more workers (modelled)


@dataclass(frozen=True)
class ModelledTraffic:
    arm: str
    bytes_received: dict  # world size -> modelled bytes received per rank per step (None: not modelled)
    how: str
    dense_fallback_from: int | None = None  # top-k arms: the smallest p at which the hook would allreduce densely


def topk_received(payload: float, dense: float, exchange: str, p: int) -> tuple[float, bool]:
    """Modelled bytes a top-k arm's rank takes in per step at ``p`` workers, and whether the
    hook's dense-fallback rule makes it allreduce densely there (as ``sparsecomm project``
    applies the rule: to the step's totals; an owner's reply is 1/p of a payload)."""
    from sparsecomm.lab.costmodel import exchange_bytes_received, falls_back_to_dense

    dense_instead = falls_back_to_dense(payload / p if exchange == "owner" else payload, dense, p)
    return exchange_bytes_received("dense" if dense_instead else exchange, payload, dense, p), dense_instead


def ring_scaled(measured: float, measured_p: int, world_sizes) -> dict:
    """Bytes one rank takes in at each p, from ``measured`` at ``measured_p``, for an exchange
    that is a ring allreduce of a fixed buffer plus, where there is one, a rotating leader's
    broadcast: per rank 2 (p-1)/p x values + (p-1)/p x index bytes on average over the
    leaders, both (p-1)/p times a constant, so the scaling is exact for the rank mean."""
    return {p: measured * ((p - 1) / p) / ((measured_p - 1) / measured_p) for p in world_sizes}


def modelled_traffic(run_dir, arms, world_sizes, measured_p: int) -> list[ModelledTraffic]:
    """Per arm, bytes received per rank per step at each of ``world_sizes``, by the cost
    model's formulas (:func:`sparsecomm.comm.link_model.exchange_bytes_received` and the hook's
    dense-fallback rule, as ``sparsecomm project`` applies them) from the bytes per step
    measured in ``run_dir`` (at ``measured_p`` ranks). The shared exchanges (``shared-index``,
    ``shared-mask``: a hook's or the averager's) scale their measured bytes received as a ring
    allreduce does (:func:`ring_scaled`); they never fall back to dense."""
    from sparsecomm.lab.costmodel import exchange_bytes_received, read_run
    from sparsecomm.lab.results import load_runs

    inputs = read_run(run_dir)
    runs = load_runs(run_dir)
    traffic = []
    for arm in arms:
        mine = [r for r in runs if r.arm == arm and r.finished]
        spec = next((r.extra["arm_spec"] for r in mine if isinstance(r.extra.get("arm_spec"), dict)), {})
        exchange = (spec.get("options") or {}).get("exchange", "allgather")
        measured = inputs.arm(arm)
        if exchange in SHARED_EXCHANGES and mine:
            received = _median(received_per_step(r, measured_p)[0] for r in mine)
            broadcast = ", and the leader's index broadcast" if exchange == "shared-index" else ""
            how = (f"{exchange}: the values summed around a ring (an allreduce, or the owners' all-to-all and "
                   f"replies for quantized values){broadcast}, scaled from the {_bytes(received)} received per "
                   f"rank per step at p = {measured_p}; no dense fallback")
            traffic.append(ModelledTraffic(arm, dict.fromkeys(world_sizes) if received is None else ring_scaled(
                received, measured_p, world_sizes), how))
        elif exchange not in ("allgather", "owner"):
            traffic.append(ModelledTraffic(arm, dict.fromkeys(world_sizes), f"exchange {exchange}: not modelled"))
        elif measured is not None and measured.sparse:
            payload, dense = measured.bytes_sent, measured.bytes_dense
            fallback = next((p for p in range(2, MODEL_MAX_WORLD_SIZE + 1)
                             if topk_received(payload, dense, exchange, p)[1]), None)
            how = (f"{exchange} of its {format_value(payload, 'B')} per rank per step"
                   + (f"; the hook's dense fallback (allreduce of {format_value(dense, 'B')}) from p = {fallback}"
                      if fallback is not None else f"; no dense fallback up to p = {MODEL_MAX_WORLD_SIZE}"))
            # Either side of the fallback too, so that the plotted line turns where the model does.
            sizes = sorted({*world_sizes, *((fallback - 1, fallback) if fallback is not None else ())} - {1})
            traffic.append(ModelledTraffic(arm, {p: topk_received(payload, dense, exchange, p)[0] for p in sizes}, how,
                                           fallback))
        elif measured is not None:
            traffic.append(ModelledTraffic(
                arm, {p: exchange_bytes_received("dense", 0.0, measured.bytes_sent, p) for p in world_sizes},
                f"ring allreduce of its {format_value(measured.bytes_sent, 'B')} per step"))
        elif spec.get("reducer") == "sparse-delta" and mine:
            payload = _median(r.bytes_sent_per_step for r in mine)
            traffic.append(ModelledTraffic(
                arm, {p: exchange_bytes_received(exchange, payload, 0.0, p) for p in world_sizes},
                f"{exchange} of its {format_value(payload, 'B')} per step (syncs amortised; no dense fallback)"))
        elif spec.get("reducer") == "local":
            traffic.append(ModelledTraffic(arm, dict.fromkeys(world_sizes, 0.0), "sends nothing"))
        else:
            traffic.append(ModelledTraffic(arm, dict.fromkeys(world_sizes), "not modelled (no finished run)"))
    return traffic


# ---------------------------------------------------------------------------------------------
# The report: printed, scaling.md, scaling.json, scaling.png


def _bytes(value) -> str:
    return "n/a" if value is None else format_value(value, "B")


def _ratio(value) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def _header(study: Study, metric: str) -> list[str]:
    config = study.config
    return [
        f"scaling study {config.name}: world sizes {', '.join(map(str, study.world_sizes))}; arms "
        f"{', '.join(config.arms)}; seeds {list(config.seeds)}; {config.steps} steps; link {config.link}",
        study.describe_batch() + "; optimizer settings the same at every p",
        f"verdict: equivalence (TOST) of the final {metric} against dense at the same p over paired seeds, "
        f"tolerance {config.policy.quality_tolerance:g} (fewer than 3 seeds: inconclusive); gap = mean(arm - dense), "
        "> 0 worse",
    ]


def _tables(study: Study, points: list[ScalePoint], modelled: list[ModelledTraffic], metric: str) -> dict:
    low, high = study.world_sizes[0], study.world_sizes[-1]
    main = [["p", "arm", "batch/rank", "verdict", "gap", f"final {metric}", "sent/step", "recv/step", "steps [s2t]",
             "time [t2t]", "failed arm/dense", "exposed comm"]]
    main += [[str(p.world_size), p.arm, str(p.batch_size), p.verdict, fmt(p.metric_gap), fmt(p.final_metric_mean),
              _bytes(p.bytes_sent_per_step), _bytes(p.bytes_received_per_step), fmt(p.steps_to_target),
              fmt(p.time_to_target_s, " s"),
              f"{p.failed}/{p.dense_failed}" + (f" ({p.not_ok})" if p.not_ok else ""),
              "n/a" if p.exposed_comm_fraction is None else f"{p.exposed_comm_fraction:.0%}"] for p in points]
    model = {m.arm: m for m in modelled}
    grow = [["arm", f"recv/step p={low}", f"recv/step p={high}", "growth (measured)", "growth (modelled)"]]
    for arm in study.config.arms:
        at = {p.world_size: p.bytes_received_per_step for p in points if p.arm == arm}
        m = model.get(arm)
        modelled_growth = (m.bytes_received[high] / m.bytes_received[low]
                           if m is not None and m.bytes_received.get(low) and m.bytes_received.get(high) is not None
                           else None)
        grow.append([arm, _bytes(at.get(low)), _bytes(at.get(high)), _ratio(growth(points, arm, low, high)),
                     _ratio(modelled_growth)])
    projected = [["arm (modelled)", *(f"p={p}" for p in MODELLED_WORLD_SIZES)]]
    projected += [[m.arm, *(_bytes(m.bytes_received.get(p)) for p in MODELLED_WORLD_SIZES)] for m in modelled]
    return {"main": main, "growth": grow, "modelled": projected}


def _notes(study: Study, points: list[ScalePoint], modelled: list[ModelledTraffic], model_p: int | None) -> list[str]:
    lines = ["bytes per rank per step (rank 0): sent = mean over the steps after warm-up (every arm's hook "
             "metered); received:"]
    sources = {}
    for p in points:
        if p.received_source:
            sources.setdefault(p.arm, p.received_source)
    lines += [f"  {arm}: {source}" for arm, source in sources.items()]
    lines.append("steps/time to target: median over seeds (n/a: not reached in some seed), against a target derived "
                 "at each p from that p's dense runs (median final + tolerance)")
    failed = sum(p.failed for p in points if p.arm != DENSE_ARM) + sum(
        {p.run_dir: p.dense_failed for p in points}.values())
    lines.append(f"failed runs (any status but ok, or missing; not compared): {failed}"
                 + ("; unavailable: no dense run finished at that p" if any(p.verdict == UNAVAILABLE for p in points)
                    else ""))
    if model_p is None:
        lines.append("modelled: not available (no world size with a finished dense run to start from)")
    else:
        lines.append(f"modelled (alpha-beta cost model, sparsecomm.lab.costmodel; never measured): bytes received per "
                     f"rank per step from the bytes per step measured at p={model_p}, per-rank traffic as at that p:")
        lines += [f"  {m.arm}: {m.how}" for m in modelled]
    return lines


def format_study(study: Study, points, modelled, model_p, metric: str) -> str:
    tables = _tables(study, points, modelled, metric)
    low, high = study.world_sizes[0], study.world_sizes[-1]
    lines = [*fold_lines(_header(study, metric)), "", *aligned(tables["main"]), "",
             f"bytes received per rank per step, p={low} -> p={high}:", *aligned(tables["growth"]), "",
             "modelled bytes received per rank per step:", *aligned(tables["modelled"]), "",
             *fold_lines(_notes(study, points, modelled, model_p))]
    return "\n".join(lines)


def markdown_study(study: Study, points, modelled, model_p, metric: str) -> str:
    tables = _tables(study, points, modelled, metric)
    low, high = study.world_sizes[0], study.world_sizes[-1]
    lines = [f"# Scaling study: {study.config.name}", "", *(f"- {line}" for line in _header(study, metric)), "",
             "## Per world size and arm (measured)", "", *markdown_table(tables["main"]), "",
             f"## Bytes received per rank per step, p={low} to p={high}", "", *markdown_table(tables["growth"]), "",
             "## Bytes received per rank per step at more workers (modelled)", "",
             *markdown_table(tables["modelled"]), "", "## Notes", "",
             *(line.replace("  ", "  - ", 1) if line.startswith("  ") else f"- {line}"
               for line in _notes(study, points, modelled, model_p)), "", "![scaling](scaling.png)", ""]
    return "\n".join(lines)


def study_json(study: Study, points, modelled, model_p, metric: str) -> dict:
    config = study.config
    low, high = study.world_sizes[0], study.world_sizes[-1]
    return {
        "study": {"experiment": config.name, "world_sizes": list(study.world_sizes), "batch": study.batch,
                  "batch_per_rank": {str(p): study.batch_size(p) for p in study.world_sizes},
                  "global_batch": {str(p): study.batch_size(p) * p for p in study.world_sizes},
                  "experiments": {str(p): study.point_config(p).name for p in study.world_sizes},
                  "arms": list(config.arms), "seeds": list(config.seeds), "steps": config.steps, "link": config.link,
                  "metric": metric, "mode": config.mode, "tolerance": config.policy.quality_tolerance},
        "points": [asdict(p) for p in points],
        "growth_of_bytes_received": {arm: {"from": low, "to": high, "measured": growth(points, arm, low, high)}
                                     for arm in config.arms},
        "modelled": {"label": "modelled (alpha-beta cost model), not measured", "from_world_size": model_p,
                     "bytes_received_per_rank_per_step": {m.arm: {str(p): v for p, v in m.bytes_received.items()}
                                                          for m in modelled},
                     "how": {m.arm: m.how for m in modelled},
                     "dense_fallback_from": {m.arm: m.dense_fallback_from for m in modelled}},
    }


def plot_study(study: Study, points: list[ScalePoint], modelled: list[ModelledTraffic], path: Path,
               metric: str) -> Path:
    """Two panels: the gap to dense vs p (verdict as the marker), and bytes received per rank vs
    p, log-log (measured points; the cost model's line)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from sparsecomm.lab import plots

    fig = Figure(figsize=(13.0, 5.0), layout="constrained")
    FigureCanvasAgg(fig)
    quality, traffic = fig.subplots(1, 2)
    arms = list(study.config.arms)
    styles = plots.arm_styles(arms)
    tolerance = study.config.policy.quality_tolerance
    quality.axhspan(-tolerance, tolerance, color="0.92", zorder=0)
    quality.axhline(0.0, color=styles[DENSE_ARM]["color"], linewidth=1.0, label=f"{DENSE_ARM} (baseline)")
    for arm in plots.arm_order(a for a in arms if a != DENSE_ARM):
        mine = [p for p in points if p.arm == arm and p.metric_gap is not None and math.isfinite(p.metric_gap)]
        quality.plot([p.world_size for p in mine], [p.metric_gap for p in mine], label=arm, **styles[arm])
        for p in mine:
            quality.plot(p.world_size, p.metric_gap, marker=VERDICT_MARKERS.get(p.verdict, "s"), linestyle="none",
                         color=styles[arm]["color"], markersize=8,
                         fillstyle="none" if p.verdict == "inconclusive" else "full")
    quality.set_xscale("log", base=2)
    quality.set_xticks(list(study.world_sizes), [str(p) for p in study.world_sizes])
    quality.set_xlabel("workers p")
    quality.set_ylabel(f"final {metric}: arm - dense (> 0 worse), mean over seeds")
    quality.set_title(f"quality: o equivalent, hollow s inconclusive, x worse\nshaded: tolerance +-{tolerance:g}")
    quality.legend()

    model = {m.arm: m for m in modelled}
    for arm in plots.arm_order(arms):
        mine = [p for p in points if p.arm == arm and p.bytes_received_per_step]
        derived = any(p.received_source == RECEIVED_RING for p in mine)
        traffic.plot([p.world_size for p in mine], [p.bytes_received_per_step for p in mine], marker="o",
                     linestyle="none", color=styles[arm]["color"], markersize=7,
                     fillstyle="none" if derived else "full", label=f"{arm} measured" + (" (derived)" * derived))
        line = sorted((p, v) for p, v in (model[arm].bytes_received.items() if arm in model else ()) if v)
        if line:
            traffic.plot([p for p, _ in line], [v for _, v in line], label=f"{arm} modelled", **styles[arm])
    traffic.set_xscale("log", base=2)
    traffic.set_yscale("log")
    shown = sorted({*study.world_sizes, *MODELLED_WORLD_SIZES})
    traffic.set_xticks(shown, [str(p) for p in shown])
    traffic.set_xlabel("workers p")
    traffic.set_ylabel("bytes received per rank per step")
    traffic.set_title("traffic: points measured (hollow: derived from bytes sent), lines modelled")
    traffic.legend(fontsize=8)
    fig.suptitle(f"{study.config.name}: {study.describe_batch().split(' (')[0]}")
    return plots._save(fig, path, None)


# ---------------------------------------------------------------------------------------------
# The command


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparsecomm scale", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:5]))
    add_experiment_source(p)
    add_job_arguments(p, world_size=False)  # --world-sizes instead
    p.add_argument("--world-sizes", nargs="+", type=int, required=True, metavar="P",
                   help=f"numbers of workers to run at: at least two distinct integers in [2, "
                        f"{local_world_size_limit()}] on this machine (sorted for you)")
    p.add_argument("--batch", choices=BATCH_MODES, default="per-rank",
                   help="what stays fixed as p grows: per-rank (default; the config's batch_size is per rank, the "
                        "global batch is p x batch_size) or global (the smallest p's global batch, split over p)")
    p.add_argument("--arms", nargs="+", metavar="ARM",
                   help="arms to compare (default: the experiment's): presets, arms the --config defines, or "
                        "NAME=REDUCER[:key=value,...]; dense is always run, as the baseline")
    p.add_argument("--seeds", nargs="+", type=int, help="override the seeds (integers in [0, 2**32 - 1])")
    p.add_argument("--steps", type=int, help="override the steps per run (>= 1)")
    add_link_argument(p)
    add_parallelism_argument(p)
    p.add_argument("--out", type=Path, default=Path("runs"), help="root of run directories (default: ./runs)")
    p.add_argument("--plots", type=Path, default=Path("plots"),
                   help="root of plot folders (default: ./plots); the study goes to <plots>/<experiment>-scaling/")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_arguments(parser, argv)
    try:  # every argument and every point's config, before the first launch
        study = make_study(args)
        check_writable_directory(args.out, "--out")
        check_writable_directory(args.plots / study.stem, "--plots")
        from sparsecomm.lab.experiment.runner import check_run_directories

        for p in study.world_sizes:
            check_run_directories(study.point_config(p), args.out)
    except (ValueError, TypeError, RuntimeError, OSError) as error:
        parser.error(str(error))
    from sparsecomm.lab.target import Target

    metric = Target(0.0, "", study.config.metric).metric_label

    def run_and_model():
        points = run_study(study, args.out)
        # The model starts from the largest p with a finished dense run (the cost model reads the target).
        model_p = next((p for p in reversed(study.world_sizes) if any(
            q.world_size == p and q.verdict != UNAVAILABLE for q in points)), None)
        modelled = [] if model_p is None else modelled_traffic(
            args.out / study.point_config(model_p).name, study.config.arms,
            sorted({*study.world_sizes, *MODELLED_WORLD_SIZES}), model_p)
        return points, model_p, modelled

    done, code = run_and_read("sparsecomm scale", run_and_model)
    if code is not None:
        return code
    points, model_p, modelled = done
    print()
    print(format_study(study, points, modelled, model_p, metric))
    folder = args.plots / study.stem
    folder.mkdir(parents=True, exist_ok=True)
    from sparsecomm.lab.experiment.files import write_bytes_atomically, write_json_atomically

    summary = folder / "scaling.json"
    write_json_atomically(summary, study_json(study, points, modelled, model_p, metric))
    write_bytes_atomically(folder / "scaling.md", markdown_study(study, points, modelled, model_p, metric).encode())
    figure = plot_study(study, points, modelled, folder / "scaling.png", metric)
    print(f"\nwrote {summary}, {folder / 'scaling.md'}\nplot: {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
