"""The time-to-quality ledger: what a run costs until it reaches the target, item by item.

Line items per arm (median over seeds): setup, step cost x steps actually needed,
checkpoint, expected recovery. Every figure carries the boundary it was measured against:

- ``step``: one training step (compute + compression + communication);
- ``steps_to_target``: steps until the validated target is first reached (resolution:
  the evaluation cadence);
- ``time_to_target``: wall clock from first data touch to the target, evaluation included;
- ``end_to_end``: setup + step x steps + checkpoint + expected recovery.

Checkpoint = blocking time spent saving verified checkpoints; recovery = measured cost of
one injected fault (recovery time + recomputed steps) x the declared fault rate x run
hours. Every figure is a measured :class:`sparsecomm.lab.results.quantity.Quantity`: adding or dividing
figures of different boundaries (or links) raises :class:`BoundaryError`; the only
cross-boundary operation is :func:`step_cost_to_target` (step x steps), which is how
the ledger defines that line item. An item not measured yet is ``not measured`` ("n/m" in
the table), never zero, and a total that includes it is ``not measured`` too (the table
shows ">= " its measured part, a lower bound). An arm that did not reach the target in some
seed has no steps-to-target figure: its row says "not reached in N steps".

The printed ledger fits in 100 columns: one row per arm with the values alone, one legend
naming each column's boundary and the link once, and one speedup line per arm with a ratio
per boundary ("step 1.90x ... total 1.20x": a step speedup and an end_to_end speedup are
different claims).

Runs that did not finish (any status other than "ok", e.g. failed, interrupted, or a
summary excluded as invalid; see :mod:`sparsecomm.lab.results`) are not in any figure, but
each is counted in its arm's "runs" column (finished/not) and listed with its status and
error below the table; so are configured runs that have no summary at all (missing).

Needs no torch. The figures: :mod:`.items`; the text: :mod:`.format`; the command: :mod:`.cli`.

    sparsecomm ledger RUN_DIR      # exit 0; 2 for an unreadable run directory, or no finished dense run
"""
from sparsecomm.lab.ledger.cli import main
from sparsecomm.lab.ledger.format import NOT_MEASURED_CELL, format_ledger, format_not_ok
from sparsecomm.lab.ledger.items import (
    NOT_MEASURED,
    ArmLedger,
    Ledger,
    arm_ledger,
    build_ledger,
    exposed_fraction,
    ledger_items_for_plot,
    missing_runs,
    no_finished_dense,
    step_cost_to_target,
)

__all__ = ["NOT_MEASURED", "NOT_MEASURED_CELL", "ArmLedger", "Ledger", "arm_ledger", "build_ledger",
           "exposed_fraction", "format_ledger", "format_not_ok", "ledger_items_for_plot", "main", "missing_runs",
           "no_finished_dense", "step_cost_to_target"]
