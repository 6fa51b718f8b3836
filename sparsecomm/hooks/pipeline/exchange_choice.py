"""``exchange="auto"``: the exchange of each bucket, picked by the alpha-beta cost model.

For the bucket's size, density, codecs and the world size, every exchange the settings
allow is costed on the state's ``link`` (rate and per-message latency) with the formulas
of :mod:`sparsecomm.comm.link_model`, from the bytes the layouts give:

* ``allgather``: ring all-gather of one payload per rank, ``(p-1) alpha + (p-1) s / B``;
* ``owner`` (``selector="exact"`` or ``"chunk"``): all-to-all + all-gather of the replies,
  ``2 (p-1) alpha + 2 (p-1)/p s / B``;
* ``shared-index`` (exact or chunked selection, float values): the leader's index
  broadcast (a tree: ``ceil(log2 p) (alpha + I / B)``) + a ring allreduce of k values;
* ``dense`` (when ``allow_dense_fallback``): ring allreduce of the bucket.

The cheapest wins (ties: the order above). Every rank computes the same choice from the
same numbers, so no collective is needed. Only time is modelled: the exchanges do not
train alike (owner adds a second compression, shared-index sends the leader's
selection), so compare them on quality with the runner before trusting ``auto``.
"""
from sparsecomm.comm import link_model
from sparsecomm.hooks.pipeline import shared_index
from sparsecomm.hooks.pipeline.integrity import trailer_bytes
from sparsecomm.hooks.pipeline.layouts import payload_layout
from sparsecomm.links.spec import parse_link

DEFAULT_LINK = "10gbit@50us"  # what "auto" assumes when no link is given


def candidates(config) -> tuple[str, ...]:
    """The exchanges these settings allow, in tie-break order."""
    allowed = ["allgather"]
    if config.selector in ("exact", "chunk"):
        allowed.append("owner")
    if (config.selector in ("exact", "chunk") and config.value_codec is None and config.transport == "c10d"
            and config.k_scope == "bucket"):
        allowed.append("shared-index")
    return tuple(allowed)


def modelled_seconds(config, numel: int, density: float, buffer_dtype, value_dtype, world_size: int, k: int) -> dict:
    """Modelled seconds of every allowed exchange (and dense) for one bucket."""
    link = parse_link(config.link or DEFAULT_LINK)
    rate, alpha, p = link.bytes_per_s, link.latency_s, world_size
    costs = {}
    for exchange in candidates(config):
        if exchange == "allgather":
            payload = payload_layout(config, density, numel, k, value_dtype, p, exchange).nbytes + trailer_bytes(config)
            costs[exchange] = link_model.ring_allgather_seconds(payload, p, rate_bytes_per_s=rate, alpha_s=alpha)
        elif exchange == "owner":
            layout = payload_layout(config, density, numel, k, value_dtype, p, exchange)
            costs[exchange] = link_model.owner_exchange_seconds(p * layout.slot_nbytes, p, rate_bytes_per_s=rate,
                                                               alpha_s=alpha)
        else:
            selected = shared_index.geometry(config, numel, density).selected
            index_bytes = shared_index.index_nbytes(config, numel, density)
            costs[exchange] = (link_model.broadcast_seconds(index_bytes, p, rate_bytes_per_s=rate, alpha_s=alpha)
                               + link_model.ring_allreduce_seconds(
                                   shared_index.allreduced_values(config, selected) * value_dtype.itemsize, p,
                                   rate_bytes_per_s=rate, alpha_s=alpha))
    if config.allow_dense_fallback:
        costs["dense"] = link_model.ring_allreduce_seconds(numel * buffer_dtype.itemsize, p, rate_bytes_per_s=rate,
                                                          alpha_s=alpha)
    return costs


def choose(state, numel: int, density: float, buffer_dtype, value_dtype, world_size: int, k: int) -> str:
    """The cheapest exchange for this bucket ("dense" included); cached per bucket shape."""
    key = (numel, density, buffer_dtype, value_dtype, world_size)
    choice = state._exchange_choices.get(key)
    if choice is None:
        costs = modelled_seconds(state.config, numel, density, buffer_dtype, value_dtype, world_size, k)
        choice = state._exchange_choices[key] = min(costs, key=costs.get)  # ties: the first, in candidate order
    return choice
