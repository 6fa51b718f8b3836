"""torchtitan jobs the torchtitan tests run on gloo ranks (tests/rank_processes.py): its own
Trainer (native HSDP) and sparsecomm's, on torchtitan's debug model, at a size that takes a
few seconds a job on CPU."""
import os

import torch

SEQ_LEN, LOCAL_BATCH = 64, 2


def job_config(steps: int, dump_folder: str, *, seed: int = 0, replicas: int = 2, **sparsecomm):
    """The offline debug-model config at the tests' size; ``sparsecomm``: its options (the hook
    is on when any is given)."""
    import dataclasses

    from sparsecomm.integrations.torchtitan.config_registry import llama3_debugmodel_offline

    config = llama3_debugmodel_offline()
    config.training.steps = steps
    config.training.seq_len, config.training.local_batch_size = SEQ_LEN, LOCAL_BATCH
    config.parallelism.data_parallel_replicate_degree = replicas
    config.dump_folder = dump_folder
    config.debug.seed = seed
    config.metrics.log_freq = 1
    config.comm.trace_buf_size = 0
    if sparsecomm:
        config.sparsecomm = dataclasses.replace(config.sparsecomm, enable=True, **sparsecomm)
    return config


def run_trainer(rank: int, world_size: int, config, trainer_class: str = "sparsecomm"):
    """Train ``config`` with torchtitan's own Trainer ("torchtitan") or sparsecomm's; returns
    (the losses it logged by step, every parameter's full tensor, the trainer's hook state
    dict or None)."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size))
    from torchtitan.trainer import Trainer

    from sparsecomm.integrations.torchtitan import SparseCommTrainer

    trainer = (Trainer if trainer_class == "torchtitan" else SparseCommTrainer)(config)
    losses = {}
    logged = trainer.metrics_processor.log

    def record(step, global_avg_loss, *args, **kwargs):
        losses[step] = global_avg_loss
        return logged(step, global_avg_loss, *args, **kwargs)

    trainer.metrics_processor.log = record
    try:
        trainer.train()
        params = {name: p.full_tensor().detach().clone() for name, p in trainer.model_parts[0].named_parameters()}
        state = getattr(trainer, "sparsecomm_state", None)
        replicas_agree = _replicas_agree(trainer) if state is not None else None
        hook = None if state is None else {"stats": state.stats(), "step": state.step}
    finally:
        trainer.close()
    return losses, params, hook, replicas_agree


def _replicas_agree(trainer) -> bool:
    """Whether every replica of this rank's shards holds the same parameters, bit for bit."""
    import torch.distributed as dist

    group = trainer.parallel_dims.get_mesh("dp_replicate").get_group()
    agree = True
    for p in trainer.model_parts[0].parameters():
        local = p.to_local().detach().contiguous()
        copies = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(copies, local, group=group)
        agree &= all(torch.equal(copies[0], c) for c in copies[1:])
    return agree
