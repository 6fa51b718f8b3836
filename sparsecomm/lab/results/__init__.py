"""An experiment's results and the terms every report of them uses. Needs no torch.

- :mod:`.layout`: every name of an experiment's directory and its run directories;
- :mod:`.reading`: reading them back, checked (runs, steps, the config snapshot);
- :mod:`.policy`: the three numbers a leader signs before a run;
- :mod:`.target`: the quality target a run must reach;
- :mod:`.quantity`: a printed number with what it means (measured or modelled);
- :mod:`.text`: the width of every printed line.

The lowest layer of the lab: the runner writes what these modules read, and every command
reads through them; none of them imports another part of the lab. ``sparsecomm.lab.results``
itself offers the reading functions (and the names of :mod:`.layout` they check).
"""
from sparsecomm.lab.results.layout import NAME_ACCEPTED, NAME_PATTERN, RUN_NAME_PATTERN, is_safe_name
from sparsecomm.lab.results.reading import (INVALID, Eval, ResultFileError, ResultFileWarning, RunSummary,
                                            arms_configured_first, describe_counts, experiment_link, load_experiment,
                                            load_runs, load_steps, load_summary, status_counts, warnings_to_stderr)

__all__ = [
    "NAME_ACCEPTED", "NAME_PATTERN", "RUN_NAME_PATTERN", "is_safe_name",
    "INVALID", "Eval", "ResultFileError", "ResultFileWarning", "RunSummary", "arms_configured_first",
    "describe_counts", "experiment_link", "load_experiment", "load_runs", "load_steps", "load_summary",
    "status_counts", "warnings_to_stderr",
]
