"""Which payload layout a sparse bucket sends, from the settings, the exchange and its size.

Shared by the plan (the layout it writes) and ``exchange="auto"`` (the bytes it models), so
both read the same sizes.
"""
import torch

from sparsecomm.compress.chunk_layout import ChunkLayout
from sparsecomm.compress.layout import PayloadLayout
# EXACT_SCALE_GROUP: entries per value scale of exact top-k on the compact wire (consecutive
# in index order): a bf16 scale costs 2 bytes per 64 entries, 0.25 bits each.
from sparsecomm.compress.owner_layout import EXACT_SCALE_GROUP, OwnerLayout
from sparsecomm.compress.value_codecs import FLOAT_CODECS, codec_of_dtype
from sparsecomm.hooks.pipeline.integrity import trailer_bytes


def payload_layout(config, density: float, numel: int, k: int, value_dtype: torch.dtype, world_size: int = 1,
                   exchange: str = "allgather"):
    """The layout of a bucket's sparse payload: None for random-k and the shared-index
    exchange (bare values); an OwnerLayout (the messages for every range owner) for the
    owner exchange; else int32 + float entries, or a chunked / compact ChunkLayout."""
    if config.selector == "random" or exchange == "shared-index":
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
