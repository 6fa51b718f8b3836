"""Does an arm pay at p workers on link L? Its time to target there, MODELLED.

Per world size p and arm: time to target = steps-to-target measured at p (the ledger's,
against the target derived from dense's runs at p) x a modelled step. The step is the cost
model's (:func:`sparsecomm.lab.costmodel.project_arm`, the alpha-beta formulas of
:mod:`sparsecomm.comm.link_model` and the hook's dense-fallback rule): the compute and the
select/pack (compress) seconds per rank measured at the smallest p, plus the communication
the model gives for the bytes per rank per step measured at p, on link L with p workers, plus
the unpack of the received payloads at the scatter-add rate measured at the smallest p.

Why the smallest p: a local study starts every rank on this machine, so at a larger p the
ranks share its cores, and the times measured there are those of a crowded machine, not of p
machines; the bytes per step do not depend on that, the times do. Under ``--batch global``
the per-rank batch at p is smaller than at the smallest p, so its compute is overstated.

What the model has no formula for is said so, not guessed: arms that train apart between
syncs (``sparse-delta``) or send nothing (``local``), and the top-k hook's ``shared-index``
and ``auto`` exchanges. The ``shared-mask`` exchange (SCAPE's) is modelled as ring allreduces
of the bytes a rank sends (values and the next mask's bitmap), two per bucket.
"""
from dataclasses import dataclass, replace

from sparsecomm.lab.results.quantity import Quantity
from sparsecomm.lab.results.target import DENSE_ARM
from sparsecomm.lab.scaling.modelled import arm_spec_of

MODELLED_LABEL = "modelled (alpha-beta cost model: compute measured at the smallest p, communication modelled), " \
                 "not measured"

NOT_MODELLED = "not modelled"


@dataclass(frozen=True)
class LinkPoint:
    world_size: int
    arm: str
    link: str
    steps_to_target: float | None  # measured at this p; None: not reached in some seed
    mode: str  # the model's: "allreduce", "sparse allgather", "sparse owner", "dense fallback"; or NOT_MODELLED
    comm_s: float | None  # modelled communication + unpack, per step
    step: Quantity  # modelled
    time_to_target: Quantity  # modelled
    speedup: float | None  # dense's modelled time to target at this p / the arm's: > 1, the arm pays
    note: str = ""

    def to_json(self) -> dict:
        return {"world_size": self.world_size, "arm": self.arm, "link": self.link,
                "steps_to_target": {"value": self.steps_to_target, "kind": "measured"}, "mode": self.mode,
                "comm_seconds": Quantity.modelled(self.comm_s, "s", "step").to_json(),
                "step": self.step.to_json(), "time_to_target": self.time_to_target.to_json(),
                "speedup_over_dense": {"value": self.speedup, "kind": "modelled"}, "note": self.note}


@dataclass(frozen=True)
class LinkLedger:
    link: str
    low: int  # the world size compute was measured at
    assumptions: tuple[str, ...]
    points: tuple[LinkPoint, ...]


def _not_modelled(p: int, arm: str, link: str, why: str, steps=None) -> LinkPoint:
    return LinkPoint(p, arm, link, steps, NOT_MODELLED, None, Quantity.modelled(None, "s", "step", why, link),
                     Quantity.modelled(None, "s", "time_to_target", why, link), None, why)


def _why_not(arm: str, exchange: str, inputs_p, inputs_low, low: int, p: int) -> str:
    """Why the model cannot give ``arm`` a step at ``p`` ("" where it can)."""
    if arm in inputs_p.not_modelled:
        return "trains apart between syncs (sparse-delta) or sends nothing (local): the cost model has no formula"
    if inputs_p.arm(arm) is not None and inputs_p.arm(arm).sparse and exchange not in ("allgather", "owner",
                                                                                       "shared-mask"):
        return f"exchange {exchange}: the cost model has no time formula for it"
    if inputs_p.arm(arm) is None:
        return f"no finished run with step timings at p={p}"
    if inputs_low is None or inputs_low.arm(arm) is None:
        return f"no finished run with step timings at p={low}, where compute is measured"
    return ""


def link_ledger(run_dirs: dict, arms, link: str, batches: dict | None = None) -> LinkLedger:
    """The modelled time to target of every arm at every world size of ``run_dirs`` (world
    size -> the experiment's directory) on ``link``; ``batches``: world size -> samples per
    rank, where they differ (--batch global), for the assumptions printed."""
    from sparsecomm.lab.costmodel import make_scenario, project_arm, read_run
    from sparsecomm.lab.results import load_runs

    sizes = sorted(run_dirs)
    low = sizes[0]

    def read(p):
        try:
            return read_run(run_dirs[p]), ""
        except (ValueError, FileNotFoundError) as error:  # no finished dense run to derive the target from
            return None, str(error)

    inputs_low, low_error = read(low)
    points, alphas = [], {}
    for p in sizes:
        inputs_p, error = read(p)
        if inputs_p is None:
            points += [_not_modelled(p, arm, link, f"no inputs at p={p}: {error}") for arm in arms]
            continue
        runs_at_p = load_runs(run_dirs[p])
        projected = {}
        for arm in arms:
            exchange = (arm_spec_of([r for r in runs_at_p if r.arm == arm and r.finished]).get("options") or {}).get(
                "exchange", "allgather")
            why = _why_not(arm, exchange, inputs_p, inputs_low, low, p)
            measured_p = inputs_p.arm(arm)
            if why:
                projected[arm] = (None, why, measured_p.steps_to_target if measured_p else None)
                continue
            measured_low = inputs_low.arm(arm)
            # What a rank computes, selects and packs, as at the smallest p; what it sends, as at p.
            inputs = replace(measured_p, compute_s=measured_low.compute_s, compress_s=measured_low.compress_s,
                             unpack_adds_per_s=measured_low.unpack_adds_per_s)
            scenario = make_scenario(p, link, exchange=exchange if exchange in ("owner", "shared-mask") else "allgather")
            alphas[scenario.alpha_s] = scenario.alpha_source
            projected[arm] = (project_arm(inputs, inputs_p, scenario), "", measured_p.steps_to_target)
        dense = projected.get(DENSE_ARM, (None,))[0]
        for arm in arms:
            projection, why, steps = projected[arm]
            if projection is None:
                points.append(_not_modelled(p, arm, link, why, steps))
                continue
            ratio = (projection.time_to_target.speedup_over(dense.time_to_target).ratio
                     if dense is not None else None)
            points.append(LinkPoint(p, arm, link, steps, projection.mode, projection.comm_s + projection.unpack_s,
                                    projection.step, projection.time_to_target, ratio, "; ".join(projection.notes)))
    return LinkLedger(link, low, _assumptions(alphas, low, inputs_low, low_error, batches or {}), tuple(points))


def _assumptions(alphas: dict, low: int, inputs_low, low_error: str, batches: dict) -> tuple[str, ...]:
    lines = [f"alpha {alpha * 1e6:g} us per message ({source})" for alpha, source in alphas.items()]
    smaller = {p: b for p, b in batches.items() if b < batches.get(low, b)}
    overstated = (f"; the per-rank batch is smaller at p={', '.join(map(str, smaller))} "
                  f"({', '.join(map(str, smaller.values()))} samples, {batches[low]} at p={low}), so the step there "
                  "is overstated (an upper bound)") if smaller else ""
    lines += [
        f"compute and select/pack (compress) per rank: medians measured at p={low}, the same at every p"
        + ("" if inputs_low is not None else f" (not available: {low_error})") + overstated,
        "communication: the model's, from the bytes per rank per step measured at each p; exposed, not overlapped "
        "with backward (an upper bound); unpack at the scatter-add rate measured at the smallest p",
        "time to target = steps-to-target measured at p x the modelled step (evaluation excluded); vs dense = "
        "dense's / the arm's: > 1, the arm reaches the target sooner on this link (it pays)",
    ]
    return tuple(lines)
