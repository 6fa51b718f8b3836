"""Step 1: what one bucket's reduction will be, decided before anything is touched.

Dense (warm-up, or fallback when the sparse wire would not move fewer bytes than a dense
allreduce) or sparse; how many entries (k, per parameter or per bucket); the wire
(:mod:`sparsecomm.hooks.wires`); the dtypes (memories float32 for 16-bit buckets); where acc
is formed (the bucket itself, or a float32 copy).
"""
import torch

from sparsecomm import compress
from sparsecomm.hooks import wires
from sparsecomm.hooks.pipeline import exchange_choice

MAX_BUCKET_NUMEL = 2**31 - 1  # int32 indices on the wire bound the size of one bucket


class BucketCall:
    """One bucket's reduction: what every step needs to know about it. ``plain_k`` is k at
    the plain density (what ``budget="model"`` shares out; ``k`` is this bucket's share).

    ``grad`` is where acc is formed: the bucket buffer itself, or a float32 copy of it when
    the memories are wider than the bucket (16-bit models). ``out`` is the bucket buffer,
    which receives the reduced result. ``wire`` is how it travels (a ``DenseWire`` on dense
    paths). ``owner_memory``, ``mask_memory`` (rate, age) and ``audit`` are set by the hook body for the
    owner exchange, the shared-mask exchange and ``verify_conservation``.
    """

    __slots__ = ("state", "bucket", "index", "names", "numels", "group", "world_size", "grad", "out", "ks", "k",
                 "plain_k", "value_dtype", "warmup", "wire", "with_residual", "owner_memory", "mask_memory", "audit")

    def __init__(self, state, bucket, names, numels, group, world_size):
        self.state, self.bucket, self.index = state, bucket, bucket.index()
        self.names, self.numels, self.group, self.world_size = names, numels, group, world_size
        self.owner_memory = self.mask_memory = self.audit = None

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
    """Fill in ``call``: k, dtypes, the wire (dense or sparse), the tensor acc is formed in."""
    state, config, numel = call.state, call.state.config, buffer.numel()
    call.warmup = state.step < config.warmup_steps
    call.value_dtype = config.value_dtype or buffer.dtype
    density = state.current_density()
    call.ks, call.k = selection_sizes(config, density, call.numels)
    call.plain_k = call.k
    if state.model_budget is not None and not call.warmup:  # budget="model": this bucket's share of the model's k
        k = state.model_budget.k_of(call.names, call.numels, call.k)
        if k != call.k:
            density = k / numel  # what the wire's layout is sized by (num_selected gives k back)
            call.ks, call.k = selection_sizes(config, density, call.numels)
    exchange = config.exchange
    if exchange == "auto":
        exchange = exchange_choice.choose(state, numel, density, buffer.dtype, call.value_dtype, call.world_size,
                                          call.k)
    dense = call.warmup or exchange == "dense"  # "dense": auto modelled the allreduce as fastest, not a fallback
    if exchange != "dense":
        wire = wires.build(config, exchange, numel, density, call.k, call.value_dtype, call.world_size)
        call.k = wire.capacity
        if not call.warmup and config.allow_dense_fallback and not wire.smaller_than_dense(numel, buffer.dtype):
            dense = True
            # The warning names the density that would have gone sparse.
            state.lifecycle.note_fallback(wire.density_bound(buffer.dtype))
    if dense:
        wire = wires.DenseWire(config, call.world_size, call.warmup)
    call.wire = state.wires.reuse(call.index, wire)
    if not dense and numel > MAX_BUCKET_NUMEL:
        raise ValueError(f"bucket {call.index} has {numel} elements; int32 indices allow at most "
                         f"{MAX_BUCKET_NUMEL}: lower bucket_cap_mb")
    # During warm-up no residual exists yet: do not allocate one for a layout DDP discards.
    call.with_residual = config.error_feedback and (not call.warmup or len(state.memories.residuals) > 0)
    wide = (call.with_residual or config.momentum > 0) and memory_dtype != buffer.dtype
    call.grad = state.memories.wide_copy(buffer, memory_dtype) if wide else buffer
    call.out = buffer
    return call


def selection_sizes(config, density: float, numels: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """(entries per parameter, payload capacity k) of a bucket.

    Per parameter when the scope is "parameter" or the selector is random-k (which always
    draws per parameter); otherwise k is taken over the whole bucket.
    """
    ks = tuple(compress.num_selected(n, density) for n in numels)
    if config.k_scope == "parameter" or config.selector == "random":
        return ks, sum(ks)
    return ks, compress.num_selected(sum(numels), density)
