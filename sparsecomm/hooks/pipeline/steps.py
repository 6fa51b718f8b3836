"""The steps of one bucket's reduction that the top-k hook body runs around its wire.

:func:`sparsecomm.hooks.topk.topk_hook` runs the numbered steps of its docstring; the wire
(:mod:`sparsecomm.hooks.wires`) does steps 3, 5 and 6, and this module the rest:

1. :func:`plan_bucket`: before anything is touched, what one bucket's reduction will be:
   dense (warm-up, or fallback when the sparse wire would not move fewer bytes than a dense
   allreduce) or sparse; how many entries (k, per parameter or per bucket); the wire; the
   dtypes (memories float32 for 16-bit buckets); where acc is formed (the bucket itself, or a
   float32 copy); whether a kernel may form acc itself (:func:`fused`).
2. :func:`compensate`: ``acc = grad / world_size (+ local clipping) (+ momentum) + residual``.
   Divided first, as torch's allreduce hook does, so fp16 sums do not overflow. With the fused
   kernel (no momentum, no clipping, no observer that reads acc) this step is done by the
   kernel itself in the same pass as the selection, and acc is never written.
4. :func:`after_packing`: after encoding, the memories and the records brought up to date:
   momentum factor masking (DGC: the velocity of what went out starts over), no non-finite
   value left in the velocity, the packed event for observers, the conservation audit, what
   was sent (for parameters DDP may drop as unused); and, once the exchange is issued, the
   call's counters from the wire's own byte counts (:func:`count_sparse_call`).
"""

import math

import torch

from sparsecomm import compress
from sparsecomm.hooks import wires
from sparsecomm.compress.chunk_layout import ChunkLayout
from sparsecomm.compress.layout import PayloadLayout
# EXACT_SCALE_GROUP: entries per value scale of exact top-k on the compact wire (consecutive
# in index order): a bf16 scale costs 2 bytes per 64 entries, 0.25 bits each.
from sparsecomm.compress.owner_layout import EXACT_SCALE_GROUP, OwnerLayout
from sparsecomm.compress.value_codecs import FLOAT_CODECS, codec_of_dtype
from sparsecomm.hooks.wires.base import WireCall
from sparsecomm.hooks.wires.integrity import trailer_bytes
from sparsecomm.hooks.pipeline import exchange_choice
from sparsecomm.hooks.state.unused_parameters import SentRecord


MAX_BUCKET_NUMEL = 2**31 - 1  # int32 indices on the wire bound the size of one bucket


class BucketCall(WireCall):
    """One bucket's reduction by the hook: what its wire sees (:class:`WireCall`) and what the
    hook's own steps need besides. ``plain_k`` is k at the plain density (what
    ``budget="model"`` shares out; ``k`` is this bucket's share). ``wire`` is how it travels (a
    ``DenseWire`` on dense paths)."""

    __slots__ = ("state", "bucket", "plain_k", "warmup", "with_residual")

    def __init__(self, state, bucket, names, numels, group, world_size):
        super().__init__(state.wire_context(), bucket.index(), names, numels, group, world_size)
        self.state, self.bucket = state, bucket

    @property
    def dense(self) -> bool:
        return self.wire.dense

    def emit(self, stage, dense, step=None, **tensors) -> None:
        if self.state.observers.callbacks:  # (nothing to build for nobody)
            self.state.observers.emit(self.state, stage, self.bucket, self.names, self.numels, dense, step=step,
                                      layout=None if dense else self.wire.layout, **tensors)


def check_bucket(config, buffer: torch.Tensor) -> torch.dtype:
    """The dtype of the bucket's memories, after refusing buckets the hook cannot reduce."""
    if not buffer.is_floating_point():
        raise TypeError(f"topk_hook: bucket buffer must be floating point, got {buffer.dtype}")
    if buffer.dtype == torch.float16 and config.value_dtype == torch.bfloat16:
        # bf16 rounds fp16 values near 65504 up to 65536, which is Inf back in fp16: the
        # reduced bucket would overflow. Refused on the first call, before any collective.
        raise ValueError("topk_hook: value_dtype=torch.bfloat16 cannot carry float16 gradients losslessly "
                         "(values near 65504 decode to Inf); use value_dtype torch.float16 or torch.float32")
    memory_dtype = config.memory_dtype(buffer.dtype)
    if memory_dtype not in (buffer.dtype, torch.float32):
        raise ValueError(f"topk_hook: residual_dtype={memory_dtype} cannot hold {buffer.dtype} gradients without "
                         f"rounding them (or their range); use residual_dtype None, torch.float32 or {buffer.dtype}")
    return memory_dtype


def plan_bucket(call: BucketCall, buffer: torch.Tensor, memory_dtype: torch.dtype) -> BucketCall:
    """Fill in ``call``: k, dtypes, the wire (dense or sparse), the tensor acc is formed in.
    What the settings decide for a bucket's shape is decided once (:class:`PlanCache`)."""
    state, config, numel, cache = call.state, call.state.config, buffer.numel(), call.state.wires
    call.warmup = state.step < config.warmup_steps
    call.value_dtype = config.value_dtype or buffer.dtype
    density = state.current_density()
    sizes = cache.sizes.get((density, call.numels))
    if sizes is None:
        sizes = cache.sizes[(density, call.numels)] = selection_sizes(config, density, call.numels)
    call.ks, call.k = sizes
    call.plain_k = call.k
    if state.model_budget is not None and not call.warmup:  # budget="model": this bucket's share of the model's k
        k = state.model_budget.k_of(call.names, call.numels, call.k)
        if k != call.k:  # (the budget needs k_scope="bucket": no per-parameter sizes)
            density, call.k = k / numel, k  # what the wire's layout is sized by (num_selected gives k back)
    exchange = config.exchange
    if exchange == "auto":
        exchange = exchange_choice.choose(state, numel, density, buffer.dtype, call.value_dtype, call.world_size,
                                          call.k)
    key = (exchange, numel, density, call.k, call.value_dtype, buffer.dtype, call.warmup, call.world_size)
    planned = cache.by_bucket.get(call.index)
    if planned is None or planned[0] != key:
        wire, fallback = plan_wire(state, call, exchange, numel, density, buffer.dtype)
        if planned is not None and planned[1].matches(wire) and not wire.dense:
            wire = planned[1]  # the same layout: keep the wire with its buffers
        planned = cache.by_bucket[call.index] = (key, wire, fallback)
    _, call.wire, fallback = planned
    if fallback is not None:
        state.lifecycle.note_fallback(fallback)  # the warning names the density that would have gone sparse
    if not call.wire.dense:
        call.k = call.wire.capacity
        if numel > MAX_BUCKET_NUMEL:
            raise ValueError(f"bucket {call.index} has {numel} elements; int32 indices allow at most "
                             f"{MAX_BUCKET_NUMEL}: lower bucket_cap_mb")
    # During warm-up no residual exists yet: do not allocate one for a layout DDP discards.
    call.with_residual = config.error_feedback and (not call.warmup or len(state.memories.residuals) > 0)
    wide = (call.with_residual or config.momentum > 0) and memory_dtype != buffer.dtype
    call.grad = state.memories.wide_copy(buffer, memory_dtype) if wide else buffer
    call.out = buffer
    call.fusable = fused(state)
    return call


def plan_wire(state, call: BucketCall, exchange: str, numel: int, density: float, buffer_dtype: torch.dtype):
    """(the bucket's wire, the density that would have gone sparse when it fell back to dense, else None):
    dense in warm-up and where ``exchange="auto"`` modelled the allreduce as fastest; dense too,
    with ``allow_dense_fallback``, where the sparse wire would not move fewer bytes."""
    config = state.config
    if not call.warmup and exchange == "shared-mask":  # sized per tensor, by this step's and the next's density
        return wires.SharedMaskWire(config, call.names, call.numels, density,
                                    config.density_schedule(state.step + 1), call.value_dtype, call.world_size,
                                    state.names.of_norms), None
    if not call.warmup and exchange != "dense":
        wire = build(config, exchange, numel, density, call.k, call.value_dtype, call.world_size)
        if not (config.allow_dense_fallback and not wire.smaller_than_dense(numel, buffer_dtype)):
            return wire, None
        return wires.DenseWire(config, call.world_size, False), wire.density_bound(buffer_dtype)
    return wires.DenseWire(config, call.world_size, call.warmup), None


def selection_sizes(config, density: float, numels: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """(entries per parameter, payload capacity k) of a bucket.

    Per parameter when the scope is "parameter" or the selector is random-k (which always
    draws per parameter); otherwise k is taken over the whole bucket.
    """
    ks = tuple(compress.num_selected(n, density) for n in numels)
    if config.k_scope == "parameter" or config.selector == "random":
        return ks, sum(ks)
    return ks, compress.num_selected(sum(numels), density)


def build(config, exchange: str, numel: int, density: float, k: int, value_dtype: torch.dtype,
          world_size: int) -> wires.Wire:
    """The sparse wire of a bucket of ``numel`` entries sending ``k`` of them (the plan's k;
    the wire's own ``capacity`` may round it to its geometry) over ``exchange`` (not the shared
    mask, sized per tensor by :func:`plan_wire`)."""
    if config.selector == "random":
        return wires.RandomKWire(config, k, value_dtype, world_size)
    if exchange == "shared-index":
        return wires.SharedIndexWire(config, numel, density, value_dtype, world_size)
    layout = payload_layout(config, density, numel, k, value_dtype, world_size, exchange)
    if exchange == "owner":
        return wires.OwnerWire(config, layout, world_size)
    if config.transport == "mpi" and config.selector == "sampled" and config.k_scope == "bucket":
        return wires.VariableAllgatherWire(config, layout, world_size)
    return wires.AllgatherWire(config, layout, world_size)


def payload_layout(config, density: float, numel: int, k: int, value_dtype: torch.dtype, world_size: int = 1,
                   exchange: str = "allgather"):
    """The layout of a bucket's sparse payload: None for random-k and the shared-index
    and shared-mask exchanges (bare values); an OwnerLayout (the messages for every range owner) for the
    owner exchange; else int32 + float entries, or a chunked / compact ChunkLayout."""
    if config.selector == "random" or exchange in ("shared-index", "shared-mask"):
        return None
    if exchange != "owner" and config.selector != "chunk" and not config.compact_wire:
        return PayloadLayout(k, value_dtype)
    if config.value_codec is None and value_dtype not in FLOAT_CODECS.values():
        raise ValueError(f"a chunked or compact payload writes values with a value codec; a {value_dtype} bucket needs "
                         f"one: pass value_codec (e.g. 'fp32') or value_dtype=torch.float32")
    value_codec = config.value_codec or codec_of_dtype(value_dtype)
    if exchange == "owner":  # chunk_size 0: exact top-k inside each owner's range
        return OwnerLayout(numel, config.chunk_size if config.selector == "chunk" else 0, density,
                           config.index_codec, value_codec, world_size, trailer_bytes(config))
    if config.selector == "chunk":
        return ChunkLayout(numel, config.chunk_size, density, config.index_codec, value_codec)
    # Exact top-k on the compact wire: the whole bucket is one chunk; scales per EXACT_SCALE_GROUP entries.
    return ChunkLayout(numel, numel, density, config.index_codec, value_codec, scale_group=EXACT_SCALE_GROUP)


class PlanCache:
    """What the plan decided per bucket, kept from step to step: the bucket's wire with its
    buffers (and, for a dense fallback, the density that would have gone sparse), under the key
    of everything that decided it; the payload sizes per density and bucket shape; the choices of
    ``exchange="auto"`` per bucket shape (the same numbers give the same choice)."""

    __slots__ = ("by_bucket", "sizes", "auto_choices")

    def __init__(self):
        self.by_bucket: dict[int, tuple[tuple, wires.Wire, float | None]] = {}
        self.sizes: dict[tuple, tuple] = {}
        self.auto_choices: dict[tuple, str] = {}


def memories(call, with_residual: bool):
    """(velocity, residual) flat tensors of the bucket, in the memory dtype (None if unused)."""
    state, config = call.state, call.state.config
    velocity = residual = None
    if config.momentum > 0:
        velocity = state.memories.velocities.bucket_tensor(call.index, call.names, call.numels, call.grad)
    if with_residual:
        residual = state.memories.residuals.bucket_tensor(call.index, call.names, call.numels, call.grad)
    return velocity, residual


def fused(state) -> bool:
    """Can the kernel form acc itself (reading grad and residual once, never writing acc)?

    Momentum, local clipping and the model budget while it counts (steps of several buckets)
    need acc in the bucket, and so do observers that read it (see TopKState.add_observer);
    everything else takes the fast path.
    """
    config, budget = state.config, state.model_budget
    return config.momentum == 0 and config.local_clip_norm is None and not (budget is not None and budget.counting) \
        and not (state.observers.callbacks and state.observers.need_acc())


def compensate(call, velocity, residual) -> None:
    """``call.grad`` turned in place into ``grad/ws (+ clipping) (+ velocity) + residual``."""
    config, grad = call.state.config, call.grad
    compress.compensate(grad, None, call.world_size)
    if config.local_clip_norm is not None:
        clip_locally(grad, call.numels, config.local_clip_norm, call.world_size)
    if velocity is not None:
        if config.nesterov:  # DGC's Nesterov: u = m (u + g); accumulate u + g
            velocity.add_(grad).mul_(config.momentum)
            grad.add_(velocity)
        else:  # u = m u + g; accumulate u
            velocity.mul_(config.momentum).add_(grad)
            grad.copy_(velocity)
    if residual is not None:
        grad.add_(residual)


def clip_locally(buffer: torch.Tensor, numels, clip_norm: float, world_size: int) -> None:
    """DGC's local clipping of ``buffer = grad / world_size``, per parameter slice, in place.

    The local gradient's norm limit is ``clip_norm / sqrt(world_size)``; on the divided
    buffer that is ``clip_norm / sqrt(world_size) / world_size``.
    """
    limit = clip_norm / math.sqrt(world_size) / world_size
    offset = 0
    for numel in numels:
        part = buffer[offset : offset + numel]
        norm = float(torch.linalg.vector_norm(part.float()))
        if norm > limit:
            part.mul_(limit / norm)
        offset += numel


def after_packing(call, packed, velocity, residual) -> None:
    state = call.state
    if velocity is not None:
        # Momentum factor masking (DGC): the velocity of what was sent starts over. Only where a
        # value went out: a quantizing codec decodes the small entries of a selection to 0
        # (int2: those under a quarter of their group's largest), which sends nothing of them
        # (their whole acc stays in the residual), so their velocity carries on.
        velocity[packed.indices.long()[packed.values != 0]] = 0
        # Masking zeroed the sent entries, which include every non-finite one unless there
        # were more of them than the payload holds (random-k: unless the draw missed them).
        if packed.nonfinite if packed.nonfinite is not None else not bool(torch.isfinite(packed.values).all()):
            velocity.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    call.emit("packed", False, acc=None if packed.fused else call.grad, residual=residual, indices=packed.indices,
              payload=packed.send, values=packed.values)
    if call.audit is not None:
        call.audit.check(call.wire.sent_dense(packed, residual), residual, call.index, state.step)
    if state.unused is not None and residual is not None:
        state.unused.record(call.index, SentRecord(call.names, call.numels, packed.indices, packed.values))


def count_sparse_call(call, packed, seconds_select_pack: float) -> None:
    """Count one sparse call: its elements, and the bytes its wire sent and received."""
    numel, wire = call.out.numel(), call.wire
    calls = {f"{wire.name}_calls": 1} if wire.name else {}
    call.state.count(
        sparse_calls=1,
        fused_calls=int(packed.fused),
        elements_total=numel,
        elements_sparse=numel,
        elements_sent=packed.count,
        bytes_dense=numel * call.out.element_size(),
        bytes_sent=wire.bytes_sent(call, packed),
        bytes_received=wire.bytes_received(call, packed),
        seconds_select_pack=seconds_select_pack,
        **calls,
    )
