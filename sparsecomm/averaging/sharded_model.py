"""The averager's view of an FSDP2 model (``fully_shard`` over ``mesh[shard_dim]`` of a
(replicate, shard) mesh): each rank averages its local shards with the same shards of the
other replicas, over ``mesh.get_group(replicate_dim)``; between syncs FSDP reduces gradients
inside the shard group only, so nothing crosses replicas."""
import torch
import torch.distributed as dist

from sparsecomm.fsdp.fsdp_modules import sharded_modules


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """The part of ``param`` this rank holds: a DTensor's local shard (sharing its storage), else itself."""
    to_local = getattr(param, "to_local", None)
    return to_local() if to_local is not None else param


def replica_group(model: torch.nn.Module, mesh, replicate_dim: str, shard_dim: str) -> dist.ProcessGroup:
    """The group an FSDP2 model's replicas average over, after the layout checks of the HSDP hook
    (sharded over ``mesh[shard_dim]`` alone, one parameter group per module, no all-reduce hook)."""
    sharded_modules(model, mesh, replicate_dim, shard_dim)
    return mesh.get_group(replicate_dim)


def check_replicas_start_equal(flat: torch.Tensor, group: dist.ProcessGroup) -> None:
    """FSDP does not broadcast initial weights (DDP does): the replicas of a shard must start
    from the same bits, or the first sync averages unrelated models. One small all-gather of
    a fingerprint (the float64 sums of the entries and of their squares); every rank raises alike."""
    wide = flat.double()
    mine = torch.stack([wide.sum(), wide.square().sum()]).to(flat.device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    if not all(torch.equal(everyone[0], other) for other in everyone[1:]):
        raise ValueError(
            "the replicas of this shard start from different weights (FSDP does not broadcast them, DDP does): "
            "build the model after the same torch.manual_seed on every rank, or load the same checkpoint"
        )
