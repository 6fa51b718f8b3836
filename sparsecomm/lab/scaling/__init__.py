"""The scaling study (``sparsecomm scale``): how each arm holds quality and traffic as the
number of workers p grows, and whether it pays at p workers on a link.

What runs: :mod:`.study`; what the runs recorded: :mod:`.points`; the share of dense's gain
each arm keeps: :mod:`.capture`; the time to target at p on a link with the step modelled:
:mod:`.link_ledger`; the cost model's bytes at more workers: :mod:`.modelled`; the report
(printed, markdown, JSON, plot): :mod:`.format`; the command: :mod:`.cli`.
"""
from sparsecomm.lab.scaling.capture import Capture, capture, captures
from sparsecomm.lab.scaling.cli import build_parser, main
from sparsecomm.lab.scaling.format import format_study, markdown_study, plot_study, study_json
from sparsecomm.lab.scaling.link_ledger import MODELLED_LABEL, NOT_MODELLED, LinkLedger, LinkPoint, link_ledger
from sparsecomm.lab.scaling.modelled import (
    MODEL_MAX_WORLD_SIZE,
    MODELLED_WORLD_SIZES,
    SHARED_EXCHANGES,
    ModelledTraffic,
    modelled_traffic,
    ring_scaled,
    topk_received,
)
from sparsecomm.lab.scaling.points import (
    BASELINE,
    RECEIVED_AVERAGER,
    RECEIVED_HOOK,
    RECEIVED_NOTHING,
    RECEIVED_RING,
    ScalePoint,
    growth,
    metric_at_step,
    points_at,
    received_per_step,
    ring_growth,
    run_study,
)
from sparsecomm.lab.scaling.study import (
    BATCH_MODES,
    BOTH_BATCH_MODES,
    Study,
    check_global_batch,
    check_model_links,
    check_no_fixed_shape,
    check_step_budget,
    check_world_sizes,
    make_studies,
    make_study,
)

__all__ = ["BASELINE", "BATCH_MODES", "BOTH_BATCH_MODES", "MODELLED_LABEL", "MODELLED_WORLD_SIZES",
           "MODEL_MAX_WORLD_SIZE", "NOT_MODELLED", "RECEIVED_AVERAGER", "RECEIVED_HOOK", "RECEIVED_NOTHING",
           "RECEIVED_RING", "SHARED_EXCHANGES", "Capture", "LinkLedger", "LinkPoint", "ModelledTraffic", "ScalePoint",
           "Study", "build_parser", "capture", "captures", "check_global_batch", "check_model_links",
           "check_no_fixed_shape", "check_step_budget", "check_world_sizes", "format_study", "growth", "link_ledger",
           "main", "make_studies", "make_study", "markdown_study", "metric_at_step", "modelled_traffic", "plot_study",
           "points_at", "received_per_step", "ring_growth", "ring_scaled", "run_study", "study_json", "topk_received"]
