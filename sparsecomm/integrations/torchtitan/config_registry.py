"""Config functions for torchtitan's launcher (``--module sparsecomm.integrations.torchtitan
--config <name>``), and :func:`to_sparsecomm`, which turns any torchtitan config into one whose
job can switch the hook on.

A job of your own: in your config registry, return ``to_sparsecomm(your_config())`` and pass
``--sparsecomm.enable`` (and ``--sparsecomm.density`` ...) on the command line.
"""
import dataclasses

from sparsecomm.integrations.torchtitan.cpu import has_accelerator, runnable_on_cpu
from sparsecomm.integrations.torchtitan.offline_data import use_offline_data
from sparsecomm.integrations.torchtitan.options import SparseCommOptions
from sparsecomm.integrations.torchtitan.trainer import SparseCommTrainer


def to_sparsecomm(config, **options) -> SparseCommTrainer.Config:
    """``config`` (a torchtitan ``Trainer.Config``) as a :class:`SparseCommTrainer` config: every
    field kept but two the hook needs: the classic FSDP path (``spmd_backend="partial_dtensor"``),
    and the loss without ``ChunkedLossWrapper`` (its inner loss kept: the wrapper reduces the
    output layer's FSDP group in two parts per step, which the hook cannot key), and ``options``
    (:class:`~sparsecomm.integrations.torchtitan.options.SparseCommOptions`
    fields, e.g. ``enable=True, density=0.035``) in its ``sparsecomm`` section."""
    from torchtitan.components.loss import ChunkedLossWrapper
    from torchtitan.trainer import Trainer

    if not isinstance(config, Trainer.Config):
        raise TypeError(f"config must be a torchtitan Trainer.Config, got {type(config).__name__}")
    kept = {f.name: getattr(config, f.name) for f in dataclasses.fields(Trainer.Config) if f.init}
    kept["parallelism"] = dataclasses.replace(config.parallelism, spmd_backend="partial_dtensor")
    if isinstance(config.loss, ChunkedLossWrapper.Config):
        kept["loss"] = config.loss.loss_fn
    return SparseCommTrainer.Config(**kept, sparsecomm=SparseCommOptions(**options))


def llama3_debugmodel_offline() -> SparseCommTrainer.Config:
    """torchtitan's ``llama3_debugmodel`` (6 layers, 256 wide; AdamW lr 8e-4, linear warm-up
    and decay) on data that needs no download: Python's help text, byte tokens
    (:mod:`~sparsecomm.integrations.torchtitan.offline_data`); sequences of 256, 4 per rank,
    validation off (its data set is a download), float32 parameters. On a machine without an
    accelerator also :func:`~sparsecomm.integrations.torchtitan.cpu.runnable_on_cpu`. The hook
    is off: ``--sparsecomm.enable`` switches it on."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = use_offline_data(llama3_debugmodel())
    config.training.seq_len = 256
    config.training.local_batch_size = 4
    config.training.mixed_precision_param = "float32"
    config.activation_checkpoint = None  # (nothing to save memory for at this size; and faster on CPU)
    if not has_accelerator():
        runnable_on_cpu(config)
    return to_sparsecomm(config)


def llama3_debugmodel_sparse() -> SparseCommTrainer.Config:
    """:func:`llama3_debugmodel_offline` with the hook on at its defaults (20% of each module's
    shard per step, Rice-coded indices, 2-bit values) and 2 replicas (run it on 4 processes for
    2x2)."""
    config = llama3_debugmodel_offline()
    config.parallelism.data_parallel_replicate_degree = 2
    config.sparsecomm = dataclasses.replace(config.sparsecomm, enable=True)
    return config
