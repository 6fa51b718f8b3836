"""The wires: one class per way a sparse bucket travels between the ranks.

=========================  ===========================================================  ==================
wire                       when                                                         received per rank
=========================  ===========================================================  ==================
``AllgatherWire``          ``exchange="allgather"`` (default): exact top-k (int32 +     (p-1) payloads
                           float), the sampled threshold, chunked top-k, or exact
                           top-k on the compact wire (index and value codecs)
``VariableAllgatherWire``  ``transport="mpi"`` + ``selector="sampled"``: each rank      what the others
                           sends its own count of entries (MPI ``Iallgatherv``)          sent
``OwnerWire``              ``exchange="owner"``: owners of ranges sum and re-select      ~2 (p-1)/p payload
``SharedIndexWire``        ``exchange="shared-index"``: a rotating leader's index set,   ~2 k values + the
                           every rank's values there allreduced                          index set
``SharedMaskWire``         ``exchange="shared-mask"``: a mask every rank derives alike   ~2 k values
                           from the synced gradient and ages, values allreduced
``RandomKWire``            ``selector="random"``: indices from a shared seeded stream,   ~2 k values
                           values allreduced
``DenseWire``              warm-up, the dense fallback, or ``exchange="auto"``'s choice  ~2 x the bucket
=========================  ===========================================================  ==================

Each wire owns its layout, its buffers, its byte counts, its encode, exchange and decode
(``base.Wire``), and its modelled seconds on a link, which ``exchange="auto"`` compares.
:func:`build` makes the wire for a bucket from the settings (its layout:
:func:`payload_layout`); the hook's plan keeps one per bucket (``pipeline.steps.PlanCache``)
and reuses it, with its buffers, while the bucket's layout holds. The averager runs the same wires.
"""
import torch

from sparsecomm.compress.chunk_layout import ChunkLayout
from sparsecomm.compress.layout import PayloadLayout
# EXACT_SCALE_GROUP: entries per value scale of exact top-k on the compact wire (consecutive
# in index order): a bf16 scale costs 2 bytes per 64 entries, 0.25 bits each.
from sparsecomm.compress.owner_layout import EXACT_SCALE_GROUP, OwnerLayout
from sparsecomm.compress.value_codecs import FLOAT_CODECS, codec_of_dtype
from sparsecomm.hooks.wires.integrity import trailer_bytes
from sparsecomm.hooks.wires.allgather import AllgatherWire
from sparsecomm.hooks.wires.base import Packed, Wire
from sparsecomm.hooks.wires.dense import DenseWire
from sparsecomm.hooks.wires.owner import OwnerWire
from sparsecomm.hooks.wires.shared_index import RandomKWire, SharedIndexWire
from sparsecomm.hooks.wires.shared_mask import SharedMaskWire
from sparsecomm.hooks.wires.variable_allgather import VariableAllgatherWire


def build(config, exchange: str, numel: int, density: float, k: int, value_dtype: torch.dtype,
          world_size: int) -> Wire:
    """The sparse wire of a bucket of ``numel`` entries sending ``k`` of them (the plan's k;
    the wire's own ``capacity`` may round it to its geometry) over ``exchange``."""
    if config.selector == "random":
        return RandomKWire(config, k, value_dtype, world_size)
    if exchange == "shared-index":
        return SharedIndexWire(config, numel, density, value_dtype, world_size)
    if exchange == "shared-mask":
        return SharedMaskWire(config, k, value_dtype, world_size)
    layout = payload_layout(config, density, numel, k, value_dtype, world_size, exchange)
    if exchange == "owner":
        return OwnerWire(config, layout, world_size)
    if config.transport == "mpi" and config.selector == "sampled" and config.k_scope == "bucket":
        return VariableAllgatherWire(config, layout, world_size)
    return AllgatherWire(config, layout, world_size)


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


__all__ = ["AllgatherWire", "DenseWire", "OwnerWire", "Packed", "RandomKWire", "SharedIndexWire",
           "SharedMaskWire", "VariableAllgatherWire", "Wire", "build", "payload_layout"]
