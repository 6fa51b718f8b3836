"""The bytes per rank per step the alpha-beta cost model gives at more workers than were run
(16 to 1024), from the bytes measured at one world size: modelled, never measured."""
from dataclasses import dataclass

from sparsecomm.lab.results.quantity import format_value
from sparsecomm.lab.scaling.points import median_known, received_per_step

MODELLED_WORLD_SIZES = tuple(2**i for i in range(4, 11))  # 16, 32, ..., 1024

MODEL_MAX_WORLD_SIZE = MODELLED_WORLD_SIZES[-1]

SHARED_EXCHANGES = ("shared-index", "shared-mask")
"""Exchanges whose values are allreduced at indices every rank shares: modelled by :func:`ring_scaled`."""


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


def arm_spec_of(runs) -> dict:
    """The arm's resolved spec as its finished ``runs`` recorded it ({} where none did)."""
    return next((r.extra["arm_spec"] for r in runs if isinstance(r.extra.get("arm_spec"), dict)), {})


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
        spec = arm_spec_of(mine)
        exchange = (spec.get("options") or {}).get("exchange", "allgather")
        measured = inputs.arm(arm)
        if exchange in SHARED_EXCHANGES and mine:
            received = median_known(received_per_step(r, measured_p)[0] for r in mine)
            broadcast = ", and the leader's index broadcast" if exchange == "shared-index" else ""
            how = (f"{exchange}: the values summed around a ring (an allreduce, or the owners' all-to-all and "
                   f"replies for quantized values){broadcast}, scaled from the {format_bytes(received)} received per "
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
            payload = median_known(r.bytes_sent_per_step for r in mine)
            traffic.append(ModelledTraffic(
                arm, {p: exchange_bytes_received(exchange, payload, 0.0, p) for p in world_sizes},
                f"{exchange} of its {format_value(payload, 'B')} per step (syncs amortised; no dense fallback)"))
        elif spec.get("reducer") == "local":
            traffic.append(ModelledTraffic(arm, dict.fromkeys(world_sizes, 0.0), "sends nothing"))
        else:
            traffic.append(ModelledTraffic(arm, dict.fromkeys(world_sizes), "not modelled (no finished run)"))
    return traffic


def format_bytes(value) -> str:
    """A byte count as printed ("1.54 kB"), "n/a" when not known."""
    return "n/a" if value is None else format_value(value, "B")
