"""Top-k + error feedback across the replicas of an FSDP2 model: hybrid sharding (HSDP)
whose cross-replica all-reduce, the traffic that crosses the slow links between nodes, is
the top-k hook's exchange.

The model is ``fully_shard``-ed over ``mesh[shard_dim]`` of a 2-D mesh (replicate, shard),
so FSDP itself knows only the shard group ("custom HSDP"): after each module's
reduce-scatter it hands the all-reduce hook that module's flat shard buffer (this rank's
padded shards of the module's parameters, concatenated, averaged over the shard group), to
be reduced across replicas in place. Here that buffer goes through
:func:`sparsecomm.topk_hook` as a DDP bucket would, over ``mesh.get_group(replicate_dim)``:
error feedback per module shard (float32 for 16-bit reduce dtypes), every selection, codec
and exchange of the hook, the result written back in place. FSDP then applies its own
post-division and dtype cast as after a native all-reduce.

The result is what native HSDP would hand FSDP at that point: the average over the replicas
when FSDP averages (its default: it divides by the shard group's size itself), the sum when the
module has a gradient divide factor of its own (``set_gradient_divide_factor``, as torchtitan
sets 1.0), which FSDP then applies to the sum over every rank. The hook always averages (its
residuals are in that scale); the sum is the average times the replica count, exact when the
count is a power of two.
"""
import torch
from torch.distributed.device_mesh import DeviceMesh

from sparsecomm.fsdp.fsdp_modules import sets_own_divide_factor, sharded_modules
from sparsecomm.fsdp.shard_bucket import ShardArrivals, ShardBucket
from sparsecomm.hooks.momentum_handover import resolve_for_registration, unwrap
from sparsecomm.hooks.register import say_what_changed
from sparsecomm.hooks.topk import TopKState, topk_hook

OWNER = "register_hsdp_hook"


class ShardReduce:
    """The hook FSDP calls for one module: ``hook(reduce_output) -> None``, in place."""

    __slots__ = ("state", "arrivals", "index", "placeholder", "module", "replicas")

    def __init__(self, state: TopKState, arrivals: ShardArrivals, index: int, placeholder: torch.Tensor,
                 module: torch.nn.Module, replicas: int):
        self.state, self.arrivals, self.index, self.placeholder = state, arrivals, index, placeholder
        self.module, self.replicas = module, replicas

    def __call__(self, reduce_output: torch.Tensor) -> None:
        if reduce_output.numel() != self.placeholder.numel():
            raise RuntimeError(
                f"FSDP handed the HSDP hook {reduce_output.numel()} entries for module "
                f"{self.arrivals.names[self.index] or '<root>'!r}, which holds {self.placeholder.numel()} "
                "per shard: the module was re-sharded after register_hsdp_hook, or it reduces part of its parameters "
                "at a time (FSDP leaves out parameters without a gradient; e.g. torchtitan's ChunkedLossWrapper "
                "backpropagates through the output layer first and through the final norm later)"
            )
        bucket = ShardBucket(reduce_output, self.index, self.placeholder, self.arrivals.arrive(self.index))
        reduced = topk_hook(self.state, bucket).wait()
        if reduced.data_ptr() != reduce_output.data_ptr():
            reduce_output.copy_(reduced)
        # Read at every call: the factor may be set after registration, and it decides what FSDP
        # expects from the all-reduce (module docstring).
        if sets_own_divide_factor(self.module):
            reduce_output.mul_(self.replicas)

    def __repr__(self) -> str:
        return f"sparsecomm HSDP hook of {self.arrivals.names[self.index] or '<root>'!r}"


def register_hsdp_hook(model: torch.nn.Module, mesh: DeviceMesh, state: TopKState | None = None, *,
                       replicate_dim: str = "replicate", shard_dim: str = "shard", optimizer=None, wrap=None,
                       **state_kwargs) -> TopKState:
    """Reduce ``model``'s gradients across the replicas of ``mesh`` with :func:`sparsecomm.topk_hook`.

    ``model`` must be ``fully_shard``-ed over ``mesh[shard_dim]`` (every block and the root;
    not over the 2-D mesh, whose native all-reduce would run first). Pass either a ready
    ``state`` without a process group or the keyword arguments of :class:`TopKState`
    (``density=...``, ``exchange=...``, codecs, ``warmup_steps``...); the state reduces over
    ``mesh.get_group(replicate_dim)``, and its counters (``stats()``: ``bytes_sent``,
    ``bytes_received``) are bytes on the replica dimension. Residuals are keyed
    ``<module name>.flat_shard<s>`` (s: this rank's place in its shard group), so
    ``state.state_dict()`` of every rank is its own, and loading it on another mesh is refused
    naming the shard that differs.

    Pass the training loop's ``optimizer``: as with :func:`sparsecomm.register_topk_hook`,
    the hook then takes over its momentum (momentum correction, AdamW with ``betas[0]=0``)
    unless ``momentum`` is given; without it (and without ``momentum``) the hook runs plain
    error feedback and says so on rank 0. The default ``budget="model"`` shares one top-k
    budget among the FSDP modules (each module's k from the last step's model-wide top-k).

    ``wrap`` (for measurements, e.g. the lab's): each module's hook passes through
    ``wrap(hook, module_name)`` before FSDP gets it; the wrapper must call the hook.

    A module with a gradient divide factor of its own (``set_gradient_divide_factor``) gets the
    sum over replicas, as native HSDP gives FSDP before that division; otherwise the average.

    Every FSDP module must reduce once per step (FSDP calls the hook per module; the step
    closes when all have). Gradient accumulation: ``model.set_requires_gradient_sync(False)``
    on the micro-steps before the last, as without the hook.

    Raises (on every rank, before any collective):
        TypeError: ``model`` is not an FSDP module, ``mesh`` not a DeviceMesh, ``state``
            not a TopKState.
        ValueError: ``exchange="shared-mask"`` (DDP only); the mesh is not 2-D with the named dims; a module is sharded over the
            2-D mesh or over other ranks, has several parameter groups, or already has an
            all-reduce hook; ``state`` already has a process group or was bound; both
            ``state`` and keyword arguments given.
    """
    exchange = state_kwargs.get("exchange") if state is None else getattr(state, "config", None) and state.exchange
    if exchange == "shared-mask":
        raise ValueError(f"{OWNER}: exchange='shared-mask' (SCAPE's reducer) reads AdamS's first moment per "
                         "parameter, which FSDP2 holds as shards of flat buffers the hook does not map yet: use it "
                         "with DDP (register_topk_hook), or another exchange here")
    modules = sharded_modules(model, mesh, replicate_dim, shard_dim)
    replicas = mesh.get_group(replicate_dim)
    handover, built = None, state is None
    if built:
        options, handover = resolve_for_registration(OWNER, optimizer, state_kwargs)
        state = TopKState(replicas, **options)
    elif state_kwargs:
        raise ValueError(f"pass either state or TopKState keyword arguments, not both (got {sorted(state_kwargs)})")
    elif not isinstance(state, TopKState):
        raise TypeError(f"state must be a sparsecomm.TopKState, got {type(state).__name__}")
    elif state.process_group is not None and state.process_group is not replicas:
        raise ValueError("state has a process group of its own; the HSDP hook reduces over "
                         f"mesh.get_group({replicate_dim!r}): build the TopKState without one")
    else:
        state.process_group = replicas
    shard = mesh.get_local_rank(shard_dim)
    placeholders = {}
    for found in modules:
        name = f"{found.name}.flat_shard{shard}" if found.name else f"flat_shard{shard}"
        # The meta device holds no memory: the placeholder only carries the buffer's size.
        placeholders[name] = (torch.empty(found.numel, device="meta"), found.dtype)
    state.names.bind_placeholders(model, placeholders)
    arrivals = ShardArrivals([found.name for found in modules])
    # On CUDA the exchange gets a stream of its own, so it can overlap backward (FSDP allows
    # a stream only for custom HSDP, which this is).
    stream = torch.cuda.Stream() if mesh.device_type == "cuda" else None
    for index, (found, (placeholder, _)) in enumerate(zip(modules, placeholders.values())):
        hook = ShardReduce(state, arrivals, index, placeholder, found.module,
                           mesh.get_group(replicate_dim).size())
        found.module.set_all_reduce_hook(hook if wrap is None else wrap(hook, found.name), stream=stream)
    if built:
        say_what_changed(OWNER, state, optimizer, state_kwargs, handover)
    elif optimizer is not None:
        state.check_optimizer(unwrap(optimizer))
    return state
