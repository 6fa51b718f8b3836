"""sparsecomm.metrics without a process group: when MetricsLogger writes, what it refuses (errors
naming the argument and what it accepts), and that importing sparsecomm imports neither
TensorBoard nor W&B while a sink without its package names the pip extra."""
import subprocess
import sys

import pytest
import torch

import sparsecomm
from sparsecomm.metrics import CallableSink, CommFigures, MetricsLogger, TensorBoardSink, WandbSink


def _logger(**options):
    written = []
    options.setdefault("sinks", [CallableSink(lambda figures, step: written.append(step))])
    return MetricsLogger(sparsecomm.TopKState(density=0.05), **options), written


def test_writes_at_positive_multiples_of_every_and_once_per_step():
    logger, written = _logger(every=3)
    for step in (0, 1, 2, 3, 3, 4, 5, 6, 7):
        logger.step(step)
    assert written == [3, 6]
    assert logger.last_step == 6
    # What it writes: the prefixed figures of a state that has not stepped (no window figure
    # needs a step; nothing is held back yet).
    logger, _ = _logger(every=1, prefix="comm.")
    assert logger.step(1) == {"comm.steps": 0.0, "comm.density": 0.05, "comm.residual_norm": 0.0,
                              "comm.skipped_steps": 0.0}
    logger.close()
    logger.close()  # idempotent
    with pytest.raises(RuntimeError, match=r"step\(\) after close\(\)"):
        logger.step(2)


@pytest.mark.parametrize("every, error, message", [
    (0, ValueError, "every must be an integer >= 1, got 0"),
    (-5, ValueError, "every must be an integer >= 1, got -5"),
    (2.5, TypeError, "every must be an integer >= 1, got float 2.5"),
    (True, TypeError, "every must be an integer >= 1, got bool True"),
    ("10", TypeError, "every must be an integer >= 1, got str '10'"),
])
def test_every_must_be_a_positive_integer(every, error, message):
    with pytest.raises(error, match=message):
        _logger(every=every)


def test_bad_arguments_are_refused_naming_them():
    state = sparsecomm.TopKState()
    sink = CallableSink(lambda figures, step: None)
    with pytest.raises(TypeError, match="source must be a sparsecomm.TopKState or a sparsecomm.SparseDeltaAverager, "
                                        "got Linear"):
        MetricsLogger(torch.nn.Linear(1, 1), sinks=[sink])
    with pytest.raises(TypeError, match="source must be .* got dict"):
        CommFigures(state.stats())
    with pytest.raises(ValueError, match="sinks must name at least one sink"):
        MetricsLogger(state, sinks=())
    with pytest.raises(TypeError, match=r"sinks\[1\] must be a sparsecomm.metrics.Sink .* got builtin_function_or_method; "
                                        r"wrap a function in CallableSink\(fn\)"):
        MetricsLogger(state, sinks=[sink, print])
    with pytest.raises(TypeError, match="sinks must be a Sink or a sequence of them, got int"):
        MetricsLogger(state, sinks=3)
    with pytest.raises(TypeError, match="prefix must be a str"):
        MetricsLogger(state, sinks=sink, prefix=None)
    with pytest.raises(TypeError, match="rank_zero_only must be True or False, got str 'yes'"):
        MetricsLogger(state, sinks=sink, rank_zero_only="yes")
    logger = MetricsLogger(state, sinks=sink)
    with pytest.raises(ValueError, match="step must be an integer >= 0, got -1"):
        logger.step(-1)
    with pytest.raises(TypeError, match="step must be an integer >= 0, got float 1.0"):
        logger.step(1.0)
    with pytest.raises(TypeError, match="fn must be callable as fn"):
        CallableSink("print")


def test_sinks_refuse_what_they_cannot_write_to():
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    with pytest.raises(TypeError, match="log_dir_or_writer must be a directory .* or a SummaryWriter .* got int"):
        TensorBoardSink(3)
    with pytest.raises(TypeError, match="run must be a wandb run .* got str"):
        WandbSink(run="my-run")
    with pytest.raises(RuntimeError, match=r"no W&B run to log to: call wandb.init\(...\)"):
        WandbSink().write({"sparsecomm/steps": 1.0}, 1)  # no wandb.init() in this process


def test_importing_sparsecomm_imports_no_logger_and_each_sink_names_its_extra():
    code = (
        "import sys\n"
        "import sparsecomm, sparsecomm.metrics, sparsecomm.integrations\n"
        "from sparsecomm.metrics import TensorBoardSink, WandbSink\n"
        "assert 'tensorboard' not in sys.modules and 'wandb' not in sys.modules, 'imported a logger'\n"
        "sys.modules['tensorboard'] = sys.modules['wandb'] = None  # as if not installed\n"
        "for sink, extra in ((lambda: TensorBoardSink('tb'), 'tensorboard'), (WandbSink, 'wandb')):\n"
        "    try:\n"
        "        sink()\n"
        "    except ImportError as error:\n"
        "        assert f\"pip install 'sparsecomm[{extra}]'\" in str(error), error\n"
        "    else:\n"
        "        raise AssertionError(extra + ' sink built without its package')\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
