"""Stage 1: what one bucket's reduction will be, decided before anything is touched.

Dense (warm-up, or fallback when the sparse payload would not be smaller than the dense
buffer) or sparse; how many entries (k, per parameter or per bucket); the dtypes (memories
float32 for 16-bit buckets); where acc is formed (the bucket itself, or a float32 copy).
"""
import torch

from sparsecomm import compress
from sparsecomm.compress.chunk_layout import ChunkLayout
from sparsecomm.compress.layout import PayloadLayout
from sparsecomm.compress.owner_layout import OwnerLayout
from sparsecomm.hooks.pipeline import exchange_choice, shared_index
from sparsecomm.hooks.pipeline.integrity import trailer_bytes
from sparsecomm.hooks.pipeline.layouts import payload_layout

MAX_BUCKET_NUMEL = 2**31 - 1  # int32 indices on the wire bound the size of one bucket


class BucketCall:
    """One bucket's reduction: what every stage needs to know about it.

    ``grad`` is where acc is formed: the bucket buffer itself, or a float32 copy of it when
    the memories are wider than the bucket (16-bit models). ``out`` is the bucket buffer,
    which receives the reduced result. ``layout`` is the payload's (None on dense paths
    and for random-k, which sends bare values).
    """

    __slots__ = ("state", "bucket", "index", "names", "numels", "group", "world_size", "grad", "out", "ks", "k",
                 "value_dtype", "warmup", "dense", "with_residual", "layout", "exchange")

    def __init__(self, state, bucket, names, numels, group, world_size):
        self.state, self.bucket, self.index = state, bucket, bucket.index()
        self.names, self.numels, self.group, self.world_size = names, numels, group, world_size

    def emit(self, stage, dense, step=None, **tensors) -> None:
        self.state._emit(stage, self.bucket, self.names, self.numels, dense, step=step,
                         layout=None if dense else self.layout, **tensors)


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
    """Fill in ``call``: dense or sparse, k, dtypes, the tensor acc is formed in, the layout."""
    state, config = call.state, call.state.config
    call.warmup = state.step < config.warmup_steps
    call.value_dtype = config.value_dtype or buffer.dtype
    density = state.current_density()
    call.ks, call.k = selection_sizes(config, density, call.numels)
    call.exchange = config.exchange
    if config.exchange == "auto":
        call.exchange = exchange_choice.choose(state, buffer.numel(), density, buffer.dtype, call.value_dtype,
                                               call.world_size, call.k)
    if call.exchange == "dense":  # auto modelled the allreduce as the fastest: a choice, not a byte fallback
        call.layout, call.dense = None, True
    else:
        call.layout = payload_layout(config, density, buffer.numel(), call.k, call.value_dtype, call.world_size,
                                     call.exchange)
        if call.layout is not None:
            call.k = call.layout.capacity
        elif call.exchange == "shared-index":
            call.k = shared_index.geometry(config, buffer.numel(), density).selected
        smaller = sparse_is_smaller(config, buffer.numel(), call.k, buffer.dtype, call.value_dtype, call.world_size,
                                    call.layout, density, call.exchange)
        call.dense = call.warmup or (config.allow_dense_fallback and not smaller)
        if call.dense and not call.warmup:  # the warning names the density that would have gone sparse
            bound = sparse_density_bound(config, buffer.dtype, call.value_dtype, call.world_size, call.layout,
                                         call.exchange)
            state._fallback_bound = max(bound, state._fallback_bound or 0.0)
    if not call.dense and buffer.numel() > MAX_BUCKET_NUMEL:
        raise ValueError(f"bucket {call.index} has {buffer.numel()} elements; int32 indices allow at most "
                         f"{MAX_BUCKET_NUMEL}: lower bucket_cap_mb")
    # During warm-up no residual exists yet: do not allocate one for a layout DDP discards.
    call.with_residual = config.error_feedback and (not call.warmup or len(state._residuals) > 0)
    wide = (call.with_residual or config.momentum > 0) and memory_dtype != buffer.dtype
    call.grad = state._wide_copy(buffer, memory_dtype) if wide else buffer
    call.out = buffer
    if call.dense:
        call.layout = None
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


def sparse_is_smaller(config, numel: int, k: int, buffer_dtype, value_dtype, world_size: int, layout=None,
                      density: float | None = None, exchange: str = "allgather") -> bool:
    dense_bytes = numel * buffer_dtype.itemsize
    if config.selector == "random":
        return k * value_dtype.itemsize < dense_bytes
    if exchange == "shared-index":  # an allreduce of k values, plus the leader's indices once
        values = shared_index.allreduced_values(config, k) * value_dtype.itemsize
        return values + shared_index.index_nbytes(config, numel, density) < dense_bytes
    if isinstance(layout, OwnerLayout):
        # Received per rank: (p-1) x (own message + reply slot) ~ 2 (p-1) slot, against a
        # ring allreduce's 2 (p-1)/p x dense.
        return world_size * layout.slot_nbytes < dense_bytes
    nbytes = (layout or PayloadLayout(k, value_dtype)).nbytes + trailer_bytes(config)  # sealed (wire_checksum)
    return world_size * nbytes < dense_bytes


def sparse_density_bound(config, buffer_dtype, value_dtype, world_size: int, layout=None,
                         exchange: str = "allgather") -> float:
    """The density below which a bucket's sparse reduction sends fewer bytes than dense
    (for chunked payloads, at the bytes per entry of this bucket's layout)."""
    if config.selector == "random":
        return buffer_dtype.itemsize / value_dtype.itemsize
    if exchange == "shared-index":
        index_bytes = 4 if config.index_codec == "int32" else 1.5  # at most 12-bit chunk indices, ~1 byte rice
        return buffer_dtype.itemsize / (value_dtype.itemsize + index_bytes)
    if isinstance(layout, OwnerLayout):  # p x slot ~ the whole selection, whatever p is
        return buffer_dtype.itemsize / layout.bytes_per_entry
    entry_bytes = layout.bytes_per_entry if isinstance(layout, ChunkLayout) else 4 + value_dtype.itemsize
    return buffer_dtype.itemsize / (world_size * entry_bytes)
