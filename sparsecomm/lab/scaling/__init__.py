"""The scaling study (``sparsecomm scale``): how each arm holds quality and traffic as the
number of workers p grows.

What runs: :mod:`.study`; what the runs recorded: :mod:`.points`; the cost model's bytes at
more workers: :mod:`.modelled`; the report (printed, markdown, JSON, plot): :mod:`.format`;
the command: :mod:`.cli`.
"""
from sparsecomm.lab.scaling.cli import build_parser, main
from sparsecomm.lab.scaling.format import format_study, markdown_study, plot_study, study_json
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
    points_at,
    received_per_step,
    run_study,
)
from sparsecomm.lab.scaling.study import (
    BATCH_MODES,
    Study,
    check_global_batch,
    check_no_fixed_shape,
    check_world_sizes,
    make_study,
)

__all__ = ["BASELINE", "BATCH_MODES", "MODELLED_WORLD_SIZES", "MODEL_MAX_WORLD_SIZE", "RECEIVED_AVERAGER",
           "RECEIVED_HOOK", "RECEIVED_NOTHING", "RECEIVED_RING", "SHARED_EXCHANGES", "ModelledTraffic", "ScalePoint",
           "Study", "build_parser", "check_global_batch", "check_no_fixed_shape", "check_world_sizes",
           "format_study", "growth", "main", "make_study", "markdown_study", "modelled_traffic", "plot_study",
           "points_at", "received_per_step", "ring_scaled", "run_study", "study_json", "topk_received"]
