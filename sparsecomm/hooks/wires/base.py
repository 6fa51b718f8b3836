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

A wire sees its caller only through a :class:`WireCall` (one bucket: its tensors, sizes and
group) and the call's :class:`WireContext` (counters, journal, seals, rank, step, transport,
generator, memories), never a whole hook state: the top-k hook and the averager
(``sparsecomm.averaging``) run the same wire objects. The memories an exchange keeps besides
the residual are its own to read and fold: :meth:`Wire.prepare` before encoding,
:meth:`Wire.follow` after the reduced bucket arrives.
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


class WireContext:
    """What a wire may use of whoever runs it, besides the bucket itself.

    ``count(**increments)`` adds to the caller's counters; ``journal`` (a step journal, or None)
    hears whether a reduced bucket is finite and may ask for the step to be rolled back;
    ``seals`` collects the step's sealed buckets (``integrity.StepSeals``); ``rank`` and
    ``step`` say where the call sits; ``transport`` is the MPI transport (None: c10d);
    ``generator(device)`` gives the seeded stream of the sampled selector; ``memories`` (the
    hook's per-parameter memories, or None) and ``unused`` (the record of what was sent, for
    parameters DDP may drop as unused, or None) are the hook's; ``momentum`` (the job's AdamS as
    the shared mask reads it, ``state.adams_link.AdamSLink``, or None) too."""

    __slots__ = ("caller", "count", "journal", "seals", "rank", "step", "transport", "generator", "memories",
                 "unused", "momentum")

    def __init__(self, *, caller: str, count, seals, rank: int, step: int, journal=None, transport=None,
                 generator=None, memories=None, unused=None, momentum=None):
        self.caller = caller  # who runs the wire, for its errors: "topk_hook", "SparseDeltaAverager"
        self.count, self.journal, self.seals, self.rank, self.step = count, journal, seals, rank, step
        self.transport, self.generator, self.memories, self.unused = transport, generator, memories, unused
        self.momentum = momentum


class WireCall:
    """One bucket as a wire sees it. ``grad`` is where acc is formed (the bucket buffer, a
    float32 copy of it, or the averager's delta); ``out`` receives the reduced result; ``k``
    (and ``ks`` per parameter) the entries to send; ``fusable``: nothing needs acc written, so a
    kernel may form it in the same pass as the selection, as ``grad / divisor + residual`` (the
    hook divides by the world size; the averager, which averages after the sum, by 1).
    ``owner_memory``, ``mask_memory``
    (the shared mask's: mask, AdamS's moment, beta1) and ``audit`` are set by :meth:`Wire.prepare` and ``verify_conservation``."""

    __slots__ = ("context", "index", "names", "numels", "group", "world_size", "divisor", "grad", "out", "ks", "k",
                 "value_dtype", "fusable", "wire", "owner_memory", "mask_memory", "audit")

    def __init__(self, context: WireContext, index: int, names, numels, group, world_size: int):
        self.context, self.index, self.names, self.numels = context, index, names, numels
        self.group, self.world_size = group, world_size
        self.divisor = float(world_size)  # grad / divisor + residual: the hook averages before it sends
        self.owner_memory = self.mask_memory = self.audit = None
        self.fusable = False

    def emit(self, stage, dense, step=None, **tensors) -> None:
        """Tell the caller's observers (none here)."""


def kernel_arguments(divisor: float, residual: torch.Tensor | None, fused: bool) -> tuple[float, bool]:
    """(divisor, add_residual) for a kernel that takes ``grad``: fused, it forms
    ``acc = grad / divisor + residual`` itself in the same pass as the selection;
    otherwise ``grad`` already holds acc (compensated in place), to be taken as it is."""
    return (divisor, residual is not None) if fused else (1.0, False)


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

    def prepare(self, call: WireCall, residual) -> list[torch.Tensor]:
        """Before encoding: read the memories this exchange keeps besides the residual into
        ``call`` and return them (the step journal records them for a rollback). Default: an
        owner memory left from the owner exchange (``exchange="auto"`` may send a bucket
        another way, a dense step owns nothing) moves into the residual, which sends it on."""
        memories = call.context.memories
        if residual is None or memories is None or not len(memories.owner_residuals):
            return []
        call.owner_memory = owner_residual(call, residual, (0, 0))
        return [call.owner_memory]

    def follow(self, call: WireCall, fut: torch.futures.Future, indices) -> torch.futures.Future:
        """After the exchange: what the memories of :meth:`prepare` learn from the reduced bucket
        (``indices``: what was sent; None for a dense bucket). Default: nothing."""
        return fut

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


def owner_residual(call: WireCall, residual: torch.Tensor, owned: tuple[int, int]) -> torch.Tensor:
    """This rank's owner residual of the bucket (flat, bucket-sized; from the hook's
    per-parameter memories), after folding what lies outside ``owned`` (start, length: the range
    this rank owns now) into the worker ``residual``. A bucket whose layout, owned range or world
    size changed since the last fold (DDP's rebuild, a restore) is folded again."""
    memories = call.context.memories
    memory = memories.owner_residuals.bucket_tensor(call.index, call.names, call.numels, residual)
    key = (call.names, call.numels, owned, call.world_size)
    if memories.owner_ranges.get(call.index) != key:
        fold_foreign(memory, residual, owned)
        memories.owner_ranges[call.index] = key
    return memory


def fold_foreign(memory: torch.Tensor, residual: torch.Tensor, owned: tuple[int, int]) -> None:
    """Move the owner residual outside this rank's range ``owned`` into the worker residual."""
    start, length = owned
    for part in (slice(0, start), slice(start + length, memory.numel())):
        if part.stop > part.start:
            residual[part].add_(memory[part])
            memory[part].zero_()
