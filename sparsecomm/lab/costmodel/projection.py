"""One arm's step (and time to target) projected to a scenario: the alpha-beta formulas of
:mod:`sparsecomm.comm.link_model`, the hook's dense-fallback rule, and the measured compute
and compress. Every figure out of here is a modelled :class:`~sparsecomm.lab.results.quantity.Quantity`."""
from dataclasses import dataclass

from sparsecomm.comm.link_model import (
    falls_back_to_dense,
    owner_exchange_seconds,
    ring_allgather_seconds,
    ring_allreduce_seconds,
)
from sparsecomm.lab.costmodel.inputs import ArmInputs, RunInputs
from sparsecomm.lab.costmodel.scenario import Scenario
from sparsecomm.lab.results.quantity import Quantity, format_value


@dataclass(frozen=True)
class ArmProjection:
    arm: str
    mode: str  # "allreduce", "sparse allgather", "sparse owner", "dense fallback"
    density: float | None  # allgather arms: the density projected (measured one when not given)
    comm_s: float
    unpack_s: float
    exposed_s: float  # of comm + unpack, after overlap
    step: Quantity  # modelled
    time_to_target: Quantity  # modelled
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {"arm": self.arm, "mode": self.mode, "density": self.density,
                "comm_seconds": Quantity.modelled(self.comm_s, "s", "step").to_json(),
                "unpack_seconds": Quantity.modelled(self.unpack_s, "s", "step").to_json(),
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
                             falls_back_to_dense(payload / p, arm.bytes_dense, p)),
                   # The shared mask (SCAPE's): every byte a rank sends (the values and the next mask's
                   # bitmap) is summed by a ring allreduce, two per bucket, and it never falls back;
                   # where its bitmap goes by all-gather instead, that moves fewer bytes (the hook's choice).
                   "shared-mask": (ring_allreduce_seconds(payload, p, rate_bytes_per_s=rate, alpha_s=alpha,
                                                          collectives=2 * buckets), entries, False)}
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
    link = scenario.link.name  # figures projected onto different links never combine
    if arm.steps_to_target is None:
        ttt = Quantity.modelled(None, "s", "time_to_target",
                                f"steps-to-target not measured: {arm.steps_note or 'no target'}", link)
    else:
        ttt = Quantity.modelled(arm.steps_to_target * step, "s", "time_to_target",
                                "measured steps-to-target x modelled step; evaluation excluded", link)
    return ArmProjection(arm.arm, mode, density, comm, unpack, exposed, Quantity.modelled(step, "s", "step", link=link),
                         ttt, tuple(notes))

