"""``exchange="auto"``: the exchange of each bucket, picked by the alpha-beta cost model.

For the bucket's size, density, codecs and the world size, the wire of every exchange the
settings allow (:mod:`sparsecomm.hooks.wires`) models its seconds on the state's ``link``
(rate and per-message latency) with the formulas of :mod:`sparsecomm.comm.link_model`:

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
from sparsecomm.hooks import wires
from sparsecomm.hooks.pipeline import steps  # (steps imports this module too: used at call time only)
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
    """Modelled seconds of every allowed exchange (and dense) for one bucket: each candidate
    wire's own :meth:`~sparsecomm.hooks.wires.Wire.modelled_seconds`."""
    link = parse_link(config.link or DEFAULT_LINK)
    costs = {exchange: steps.build(config, exchange, numel, density, k, value_dtype, world_size)
             .modelled_seconds(numel, buffer_dtype, link) for exchange in candidates(config)}
    if config.allow_dense_fallback:
        costs["dense"] = wires.DenseWire(config, world_size, warmup=False).modelled_seconds(numel, buffer_dtype, link)
    return costs


def choose(state, numel: int, density: float, buffer_dtype, value_dtype, world_size: int, k: int) -> str:
    """The cheapest exchange for this bucket ("dense" included); cached per bucket shape."""
    key = (numel, density, buffer_dtype, value_dtype, world_size)
    choices = state.wires.auto_choices
    choice = choices.get(key)
    if choice is None:
        costs = modelled_seconds(state.config, numel, density, buffer_dtype, value_dtype, world_size, k)
        choice = choices[key] = min(costs, key=costs.get)  # ties: the first, in candidate order
    return choice
