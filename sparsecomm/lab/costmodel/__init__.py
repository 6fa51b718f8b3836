"""Projecting a measured run to more workers and another link: an alpha-beta cost model.

Every figure this package prints is MODELLED, labelled ``[modelled, boundary: ...]``; the
measured inputs it starts from are printed beside it, labelled ``[measured]``. A modelled
figure is a :class:`sparsecomm.lab.results.quantity.Quantity` of kind ``modelled`` (:data:`Modelled`
makes one); the ledger's figures are of kind ``measured``, and the class refuses to add or
divide the two kinds.

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
reaching the target of :mod:`sparsecomm.lab.results.target`), the run's world size. The run's own
comm wait is never used: it is the communication of the link the run was measured on
(on ``loopback`` its rate is unknown), and for the top-k hook it also holds the unpack,
which is modelled separately. Assumptions: per-worker compute and compress do not change
with p (weak scaling, one worker per machine, same per-rank batch); compress does not
change with density; a ring is the collective's algorithm; PowerSGD's callback compute
(inside its comm wait) is not modelled, so its projection is a lower bound.

    sparsecomm project RUN_DIR --workers 32 --link 100gbit
    sparsecomm project RUN_DIR --against OTHER_RUN_DIR     (predicted vs measured step)
    sparsecomm project RUN_DIR --against OTHER_RUN_DIR --alpha-from-run   (alpha measured in RUN_DIR)

The package, one concept per module:

- :mod:`.inputs`: a run directory's measured figures per arm (:func:`read_run`);
- :mod:`.scenario`: where to project to (:func:`make_scenario`);
- :mod:`.projection`: one arm's projected step and time to target (:func:`project_arm`);
- :mod:`.breakeven`: the density and link rate where an arm and dense cost the same;
- :mod:`.breakeven_report`: the section that ends ``sparsecomm compare``'s report: each
  equivalent arm's break-even link rate at the run's own world size (:func:`break_even_lines`);
- :mod:`.run_projection`: a whole run projected, with its assumptions (:func:`project`);
- :mod:`.validation`: predicted vs measured step on an emulated link (:func:`validate`);
- :mod:`.format`: tables and JSON; :mod:`.cli`: ``sparsecomm project``.

Reads result files; it imports torch only through :mod:`sparsecomm.comm`, where the formulas
live with the hook.
"""
# The formulas are defined with the hook (its exchange="auto" choice uses them); they are
# re-exported here, with the model's public names, for the model's users.
from sparsecomm.comm.link_model import (
    broadcast_seconds,
    exchange_bytes_received,
    falls_back_to_dense,
    owner_exchange_seconds,
    ring_allgather_seconds,
    ring_allreduce_seconds,
    unpack_seconds,
)
from sparsecomm.lab.costmodel.breakeven import BreakEven, break_even_density, break_even_rate
from sparsecomm.lab.costmodel.cli import build_parser, main
from sparsecomm.lab.costmodel.format import format_projection, format_validation, projection_json, validation_json
from sparsecomm.lab.costmodel.inputs import (
    DEFAULT_BUCKET_CAP_MB,
    GRAD_ELEMENT_BYTES,
    PAYLOAD_ELEMENT_BYTES,
    ArmInputs,
    RunInputs,
    measured_alpha_s,
    read_run,
)
from sparsecomm.lab.costmodel.projection import ArmProjection, project_arm
from sparsecomm.lab.costmodel.run_projection import Projection, assumptions, project
from sparsecomm.lab.costmodel.scenario import (
    DEFAULT_ALPHA_S,
    MAX_ALPHA_US,
    MAX_WORKERS,
    PROJECTED_EXCHANGES,
    Scenario,
    format_rate,
    make_scenario,
)
from sparsecomm.lab.costmodel.validation import Validation, ValidationRow, validate
from sparsecomm.lab.results.quantity import MODEL_BOUNDARIES, Quantity

Modelled = Quantity.modelled  # a modelled figure: Modelled(0.04, "s", "step")

__all__ = [
    # the formulas
    "broadcast_seconds", "exchange_bytes_received", "falls_back_to_dense", "owner_exchange_seconds",
    "ring_allgather_seconds", "ring_allreduce_seconds", "unpack_seconds",
    # figures
    "MODEL_BOUNDARIES", "Modelled", "Quantity", "format_rate",
    # inputs and scenario
    "DEFAULT_BUCKET_CAP_MB", "GRAD_ELEMENT_BYTES", "PAYLOAD_ELEMENT_BYTES", "ArmInputs", "RunInputs",
    "measured_alpha_s", "read_run",
    "DEFAULT_ALPHA_S", "MAX_ALPHA_US", "MAX_WORKERS", "PROJECTED_EXCHANGES", "Scenario", "make_scenario",
    # projection, break-even, validation
    "ArmProjection", "project_arm", "BreakEven", "break_even_density", "break_even_rate",
    "Projection", "assumptions", "project", "Validation", "ValidationRow", "validate",
    # output
    "format_projection", "format_validation", "projection_json", "validation_json", "build_parser", "main",
]
