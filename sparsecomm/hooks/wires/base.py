"""What every wire shares: the packed entries of one bucket, and the interface of a wire.

A wire is one way a sparse bucket travels between the ranks (``sparsecomm.hooks.wires``).
It owns its layout (the bytes one rank puts on the wire), the buffers it reuses every step,
and the four things the hook body does with it, in the order of ``topk_hook``'s steps:

3. :meth:`Wire.encode`: select entries of acc and encode them (and write the residual);
4. :meth:`Wire.bytes_sent` / :meth:`Wire.bytes_received`: what the counters record;
5. :meth:`Wire.exchange`: the collective(s), issued from the hook body, in bucket order;
6. :meth:`Wire.accumulate`: the Future's callback that decodes what arrived into the bucket.

Plus what the plan and ``exchange="auto"`` ask before anything is touched:
:meth:`Wire.smaller_than_dense` (the dense-fallback rule), :meth:`Wire.density_bound` (the
density that would go sparse, for the warning) and :meth:`Wire.modelled_seconds` (its time
on a link, by the alpha-beta model). Observers and the conservation audit read what was
sent from :meth:`Wire.sent_dense`.
"""
import torch


class Packed:
    """What this rank is about to send for one bucket."""

    __slots__ = ("send", "layout", "indices", "values", "fused", "nonfinite", "sealed", "extra")

    def __init__(self, send, layout, indices, values, fused, nonfinite=None):
        self.send = send  # the payload: what the receivers decode
        self.layout = layout  # the layout of ``send`` (None: bare values, summed by an allreduce)
        self.indices = indices  # the selected bucket-relative indices
        self.values = values  # the sent values, in the wire dtype
        self.fused = fused  # acc was formed by the kernel and never written
        self.nonfinite = nonfinite  # allreduced values: acc held an Inf/NaN (None: not checked here)
        self.sealed = None  # ``send`` and its checksum's trailer (wire_checksum), set by seal()
        self.extra = None  # what a wire learns while exchanging (entries per rank, the led index set)

    @property
    def count(self) -> int:
        return self.indices.numel()

    @property
    def wire(self) -> torch.Tensor:
        """What goes on the wire: the sealed payload, or the bare one."""
        return self.send if self.sealed is None else self.sealed


class Wire:
    """One way a bucket travels. Subclasses set ``name`` (the ``stats()`` call counter it
    increments, or None) and ``sealed`` (its payloads carry checksums that the step's last
    bucket agrees on), and implement the methods below."""

    name: str | None = None  # "<name>_calls" counts the buckets it carried
    sealed = False
    dense = False

    def __init__(self, config, layout, world_size: int):
        self.config = config
        self.layout = layout
        self.world_size = world_size

    @property
    def capacity(self) -> int:
        """Entries one rank's payload holds (the plan's k, rounded to the wire's geometry)."""
        return self.layout.capacity

    def matches(self, other: "Wire") -> bool:
        """Can this wire (and its buffers) carry the bucket ``other`` describes?"""
        return type(self) is type(other) and self.layout == other.layout and self.world_size == other.world_size

    # ----- before anything is touched: the plan and exchange="auto" ------------------------

    def smaller_than_dense(self, numel: int, buffer_dtype: torch.dtype) -> bool:
        """The dense-fallback rule: does this wire move fewer bytes per rank than a ring
        allreduce of the bucket (``2 (p-1)/p x dense``), compared as the hook always has?"""
        raise NotImplementedError

    def density_bound(self, buffer_dtype: torch.dtype) -> float:
        """The density below which this wire sends fewer bytes than dense (for the warning)."""
        raise NotImplementedError

    def modelled_seconds(self, numel: int, buffer_dtype: torch.dtype, link) -> float:
        """Seconds one bucket takes on ``link`` (``links.spec.LinkSpec``) by the alpha-beta model."""
        raise NotImplementedError

    # ----- the hook body's steps --------------------------------------------------------------

    def fuses_compensation(self, call) -> bool:
        """Does :meth:`encode` form acc itself (the fused kernel), so step 2 is skipped?"""
        return False

    def encode(self, call, residual, fused: bool) -> Packed:
        raise NotImplementedError

    def bytes_sent(self, call, packed: Packed) -> int:
        return packed.wire.numel() * packed.wire.element_size()

    def bytes_received(self, call, packed: Packed) -> int:
        raise NotImplementedError

    def exchange(self, call, packed: Packed) -> torch.futures.Future:
        raise NotImplementedError

    def accumulate(self, call, packed: Packed):
        """The Future's callback: decode what arrived into ``call.out`` (returns it)."""
        raise NotImplementedError

    def sent_dense(self, packed: Packed, like: torch.Tensor) -> torch.Tensor:
        """The dense tensor this rank's packed entries decode to (the conservation audit)."""
        raise NotImplementedError
