"""What the HSDP hook reads of FSDP2 (``torch.distributed.fsdp.fully_shard``), in one place.

FSDP2's public API installs an all-reduce hook (``FSDPModule.set_all_reduce_hook``) but does
not say which mesh a module is sharded over, whether it already has a hook, or how large the
buffer handed to the hook is. Those come from its per-module state (its parameter groups, read
as torch 2.11 to 2.13 keep them; a torch that moved them fails with a message naming them, not
with an AttributeError deep in a step). Everything is checked before any collective.
"""
import sys
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh


def is_fsdp_module(obj) -> bool:
    """Whether ``obj`` is ``fully_shard``-ed, without importing FSDP (over a second of every rank's
    start-up in a DDP job): an FSDPModule exists only if something already imported FSDP."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(obj, getattr(fsdp, "FSDPModule", ()))


@dataclass(frozen=True)
class ShardedModule:
    """One FSDP module whose gradients the hook reduces across replicas."""

    name: str  # its name in the model ("" for the root)
    module: torch.nn.Module
    numel: int  # entries of the buffer FSDP hands to the hook: this rank's padded shards, concatenated
    dtype: torch.dtype  # the reduce dtype (MixedPrecisionPolicy.reduce_dtype, else the parameters')


def _param_groups(module: torch.nn.Module) -> list:
    """The FSDP parameter groups of ``module``: torch 2.12 and later keep a list
    (``_fsdp_param_groups``: several when a shard_placement_fn uses several meshes), torch 2.11
    one group or None (``_fsdp_param_group``)."""
    try:
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is not None:
            return list(groups)
        group = state._fsdp_param_group
    except AttributeError as error:
        raise RuntimeError(
            f"sparsecomm.register_hsdp_hook reads FSDP2's per-module state (_fsdp_param_groups, or "
            f"_fsdp_param_group before torch 2.12), which this torch {torch.__version__} does not have ({error}); "
            "the HSDP hook reads it as torch 2.11 to 2.13 keep it"
        ) from error
    return [] if group is None else [group]


def sets_own_divide_factor(module: torch.nn.Module) -> bool:
    """Whether FSDP divides ``module``'s reduced gradients by a factor set with
    ``set_gradient_divide_factor`` (as torchtitan does, with 1.0: its loss is already divided by
    the global token count) rather than averaging them over the ranks it knows. Native HSDP then
    sums over every rank, replicas included, before that one division; so must the HSDP hook."""
    return _param_groups(module)[0].gradient_divide_factor is not None


def _ranks(mesh: DeviceMesh) -> list[int]:
    return mesh.mesh.flatten().tolist()


def sharded_modules(model: torch.nn.Module, mesh: DeviceMesh, replicate_dim: str, shard_dim: str) -> list[ShardedModule]:
    """Every FSDP module of ``model`` (in ``named_modules`` order, alike on every rank) that
    holds parameters, after checking that it can take the hook: sharded over
    ``mesh[shard_dim]`` alone (a module sharded over the 2-D mesh runs FSDP's own all-reduce
    before any hook), one parameter group, no all-reduce hook yet."""
    if not is_fsdp_module(model):
        raise TypeError(
            f"model must be fully_shard-ed (an FSDPModule), got {type(model).__name__}: call "
            f"fully_shard(block, mesh=mesh[{shard_dim!r}]) on each block and on the model first"
        )
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim != 2 or replicate_dim not in names or shard_dim not in names or replicate_dim == shard_dim:
        raise ValueError(
            f"mesh must be 2-D with dims named replicate_dim={replicate_dim!r} and shard_dim={shard_dim!r} "
            f"(e.g. init_device_mesh(device, (replicas, shards), mesh_dim_names=({replicate_dim!r}, {shard_dim!r}))), "
            f"got a {mesh.ndim}-D mesh with dims {names}"
        )
    shard_ranks = _ranks(mesh[shard_dim])
    found = []
    # fully_shard([a, b]) makes a and b one FSDP unit: both are FSDPModules with one state and one
    # parameter group, reduced (and hooked) once. They are found once, named "a+b".
    units = {}
    for name, module in model.named_modules():
        if is_fsdp_module(module):
            units.setdefault(id(module._get_fsdp_state()), []).append((name, module))
    for members in units.values():
        name = "+".join(member_name for member_name, _ in members)
        module = members[0][1]
        groups = _param_groups(module)
        where = f"FSDP module {name or '<root>'!r}"
        if not groups:
            continue  # no parameters of its own: FSDP reduces nothing for it
        if len(groups) > 1:
            raise ValueError(f"{where} has {len(groups)} parameter groups (shard_placement_fn with several meshes); "
                             "the all-reduce hook needs one per module")
        group = groups[0]
        if group._is_hsdp:
            raise ValueError(
                f"{where} is sharded over the 2-D mesh (native HSDP): FSDP would all-reduce its gradients across "
                f"replicas itself before any hook; shard it over mesh[{shard_dim!r}] instead "
                f"(fully_shard(module, mesh=mesh[{shard_dim!r}]))"
            )
        module_ranks = _ranks(group.mesh_info.mesh)
        if module_ranks != shard_ranks:
            raise ValueError(
                f"{where} is sharded over ranks {module_ranks}, not over this rank's mesh[{shard_dim!r}] "
                f"{shard_ranks}: shard every module over mesh[{shard_dim!r}]"
            )
        if group._all_reduce_hook is not None:
            raise ValueError(f"{where} already has an all-reduce hook ({group._all_reduce_hook!r}); FSDP keeps one "
                             "per module: build the model again to change it")
        params = group.fsdp_params
        numel = sum(p.padded_sharded_param_size.numel() for p in params)
        # Gradients come in param_dtype (else the parameters'), and are reduced in reduce_dtype if set.
        policy = group.mp_policy
        dtype = policy.reduce_dtype or policy.param_dtype or params[0].sharded_param.dtype
        found.append(ShardedModule(name, module, numel, dtype))
    if not found:
        raise ValueError("model has no FSDP module with parameters: nothing for the hook to reduce")
    return found
