"""The density frontier (``sparsecomm frontier``): the sparsest setting that still passes the
declared tolerance, over densities (and value codecs) x sparse techniques.

The points, each a paired experiment: :mod:`.points`; the table and the plot: :mod:`.format`;
the command: :mod:`.cli`.
"""
from sparsecomm.lab.frontier.cli import build_parser, main
from sparsecomm.lab.frontier.format import format_frontier, plot_frontier
from sparsecomm.lab.frontier.points import (
    SPARSE_ARMS,
    FrontierPoint,
    frontier_stem,
    point_config,
    run_frontier,
    sparsest_equivalent,
)

__all__ = ["SPARSE_ARMS", "FrontierPoint", "build_parser", "format_frontier", "frontier_stem", "main",
           "plot_frontier", "point_config", "run_frontier", "sparsest_equivalent"]
