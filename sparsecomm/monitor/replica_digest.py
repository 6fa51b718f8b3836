"""Cross-replica parameter digest: are the DDP replicas still bitwise identical?

DDP keeps one full copy of the weights on every rank and relies on every rank applying
the same reduced gradient; nothing in DDP ever compares the copies again. A bit flip in
one rank's weights (bad memory, a mercurial core in the optimizer step) therefore
persists and spreads silently: that replica computes different gradients from then on.
Comparing an exact digest of the weights across ranks every few steps catches it
(Megatron's ``check_param_hashes_across_dp_replicas``; DeepSpeed compares a hash with
MIN/MAX all-reduces). Cost: one pass over the parameters and one all-reduce of three
int64 per check; only on a mismatch, one more small all-gather to name the ranks.

The digest
----------
Each tensor's storage is read as integers, so it sees bit patterns, not values (``-0.0``
and ``0.0`` differ, every NaN payload counts): float32 as int32 words, fp16 and bf16 as
int16, wider types (float64) as pairs of int32 words. The words of all tensors, in
``module.parameters()`` order, form one stream, cut into chunks of 65536 words; each word
is sign-extended to int64 and ``digest = sum_c C_c * sum_i W_i * word[c, i]`` modulo 2**64
(int64 arithmetic wraps on every torch backend), plus a term per tensor for its size (or
for a missing ``.grad``). All multipliers are odd.

Why every single-bit flip changes it: flipping bit ``b < 32`` of a word changes its
sign-extended value by ``+-2**b`` (the sign bit by ``2**31``), so the digest changes by
``C_c * W_i * 2**b`` modulo 2**64: an odd number times ``2**b``, never a multiple of
2**64. Hence **every single-bit flip in any parameter changes the digest**, and so does
any change confined to one word (tested for sign, exponent and mantissa bits of every
float dtype). Two changed words cancel only if ``C_c W_i d_i + C_e W_j d_j`` is a multiple
of 2**64, about 2**-32 even for two flips of the same bit (the 64-bit accumulator is what
buys this: modulo 2**32, two sign-bit flips in one chunk would always cancel). Not a
cryptographic hash: it guards against faults, not adversaries. Integer sums are exact
modulo 2**64 and associative, so the digest does not depend on thread count, reduction
order or device, and equal weights give equal digests on every rank.

Cost: the words joined in their own width, one widening copy and one int64 GEMV over the
parameters: 0.6 ms for the default task's 0.25M parameters on one core of the 2-core
development VM when they are in cache, up to 4x that right after a training step has
evicted them (both measured while other jobs shared the cores); temporaries are bounded
by 32 MiB whatever the model size.
"""
import torch

from sparsecomm.hooks.state.settings import check_int
from sparsecomm.monitor.consensus import compare_across_ranks

DEFAULT_EVERY = 10  # steps between checks
_CHUNK = 1 << 16  # words per chunk: bounds the cached weight vector to 512 KiB
_BLOCK = 64 * _CHUNK  # words converted to int64 at a time: bounds temporaries to 32 MiB
# Odd 64-bit multipliers (golden-ratio and splitmix constants) as signed int64.
_MUL_ENTRY = 0x9E3779B97F4A7C15 - (1 << 64)
_MUL_CHUNK = 0xBF58476D1CE4E5B9 - (1 << 64)
_MUL_TENSOR = 0x94D049BB133111EB - (1 << 64)
_NONE_MARK = -1  # the "size" of a missing tensor (a parameter without .grad)
_entry_weights: dict[torch.device, torch.Tensor] = {}
_chunk_cache: dict[torch.device, torch.Tensor] = {}


def _as_int64(value: int) -> int:
    """``value`` modulo 2**64, as a signed int64 (what torch's wrapping arithmetic gives)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= (1 << 63) else value


def _weights(device: torch.device) -> torch.Tensor:
    """Odd int64 weights W_i of the positions in a chunk."""
    weights = _entry_weights.get(device)
    if weights is None:
        positions = torch.arange(1, _CHUNK + 1, dtype=torch.int64, device=device)
        weights = _entry_weights[device] = (positions * _MUL_ENTRY) | 1
    return weights


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns as flat words of at most 32 bits (a view when possible)."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.bool:
        return flat.to(torch.uint8)
    size = flat.element_size()
    if size % 4 == 0:
        return flat.view(torch.int32)
    return flat.view(torch.int16 if size == 2 else torch.uint8)


def _chunk_multipliers(device: torch.device, first: int, count: int) -> torch.Tensor:
    """Odd int64 multipliers C_c of chunks ``first .. first + count - 1`` (cached, grown on demand)."""
    cached = _chunk_cache.get(device)
    if cached is None or cached.numel() < first + count:
        size = max(first + count, 2 * (0 if cached is None else cached.numel()), 64)
        positions = torch.arange(1, size + 1, dtype=torch.int64, device=device)
        cached = _chunk_cache[device] = (positions * _MUL_CHUNK) | 1
    return cached[first : first + count]


def _fold(words: list[torch.Tensor], first_chunk: int, weights: torch.Tensor) -> torch.Tensor:
    """``sum_c C_c * sum_i W_i * word[c, i]`` over the chunks of one block of consecutive words.

    The words are joined in their own width (cat promotes int16 to int32 by sign extension,
    uint8 by zero extension, as the int64 conversion would) and widened once into a block
    padded with zeros to whole chunks: one int64 GEMV and one dot, whatever the tail.
    """
    joined = words[0] if len(words) == 1 else torch.cat(words)
    count = joined.numel()
    rows = -(-count // _CHUNK)
    block = torch.empty(rows * _CHUNK, dtype=torch.int64, device=joined.device)
    block[:count].copy_(joined)
    block[count:].zero_()
    rows_view = block.view(rows, _CHUNK)
    multipliers = _chunk_multipliers(block.device, first_chunk, rows)
    if block.device.type == "cpu":
        return torch.dot(torch.mv(rows_view, weights), multipliers)  # int64: wraps modulo 2**64
    return ((rows_view * weights).sum(dim=1) * multipliers).sum()


def tensors_digest(tensors) -> torch.Tensor:
    """Exact order-dependent digest of a sequence of tensors (None allowed), as a 0-d int64
    tensor on the tensors' device (no host synchronisation)."""
    words = [None if t is None else _words(t) for t in tensors]
    present = [w for w in words if w is not None and w.numel()]
    device = present[0].device if present else torch.device("cpu")
    weights = _weights(device)
    total = torch.zeros((), dtype=torch.int64, device=device)
    # Stream the words through blocks of whole chunks (the last block may end mid-chunk).
    pending, fill, chunks_done = [], 0, 0
    for w in present:
        position = 0
        while position < w.numel():
            take = min(_BLOCK - fill, w.numel() - position)
            pending.append(w if take == w.numel() else w[position : position + take])
            fill += take
            position += take
            if fill == _BLOCK:
                total = total + _fold(pending, chunks_done, weights)
                pending, fill, chunks_done = [], 0, chunks_done + _BLOCK // _CHUNK
    if pending:
        total = total + _fold(pending, chunks_done, weights)
    # Sizes and missing tensors, so that [a, b] and [ab], or [None] and [], differ.
    shape_term = 0
    for position, w in enumerate(words):
        size = _NONE_MARK if w is None else w.numel()
        shape_term += _as_int64(((position + 1) * _MUL_TENSOR) | 1) * (size + 2)
    return total + _as_int64(shape_term)


def parameter_digest(module: torch.nn.Module) -> int:
    """Exact digest of all of ``module``'s parameters' bits, as a Python int.

    Order-dependent (parameters in ``module.parameters()`` order, entries in memory order)
    and sensitive to every single-bit flip in any parameter (see the module docstring).
    A DDP model and the module it wraps give the same digest.
    """
    return int(tensors_digest([p for p in module.parameters()]).item())


def gradient_digest(module: torch.nn.Module) -> int:
    """Exact digest of every parameter's ``.grad`` (a missing grad counts as a marker)."""
    return int(tensors_digest([p.grad for p in module.parameters()]).item())


class ReplicaDigestMonitor:
    """Check every ``every`` steps that all DDP replicas hold bitwise identical weights.

    Call :meth:`check` on every rank after ``optimizer.step()`` (same ``step`` everywhere:
    it decides whether a collective is issued, so a rank-dependent step would hang). When
    the digests differ, every rank raises :class:`CorruptionDetected` with
    ``check="replica_digest"``: the decision comes from one all-reduce whose result all
    ranks share, so no rank is left waiting in a collective the others skipped.

    Naming the suspects: with three or more ranks, a digest held by a strict majority is
    taken as correct and the other ranks are named. Without a strict majority (always the
    case for two ranks) nothing says which copy is right, so all ranks are named, unless
    ``reference_rank`` is given, whose digest is then taken as correct (Megatron compares
    against rank 0). The detail lists every rank's digest either way.

    Args:
        module: the DDP model or the module it wraps.
        every: check when ``step % every == 0``. A flip in the weights is caught at most
            ``every - 1`` steps after the step it happened in (measured at the default 10:
            median 5.5 steps for a low mantissa flip, docs/reliability.md); a roll-back loses
            at most that many steps of work.
        group: process group of the replicas; None means the default group.
        reference_rank: tie-break when no strict majority exists (see above).

    Attributes:
        last_verified_step: last step at which all replicas agreed (None before the first
            check): the newest state a roll-back may restore.
        last_digest: the agreed digest at that step.
    """

    def __init__(self, module: torch.nn.Module, *, every: int = DEFAULT_EVERY, group=None,
                 reference_rank: int | None = None):
        self.module = module
        self.every = check_int("every", every, 1)
        self.group = group
        self.reference_rank = reference_rank
        self.last_verified_step: int | None = None
        self.last_digest: int | None = None
        self.checks = 0

    def check(self, step: int) -> int | None:
        """Compare the replicas at ``step``; the agreed digest, or None when not a check step.

        Raises:
            CorruptionDetected: on every rank, when any two replicas differ.
        """
        if step % self.every:
            return None
        digest = tensors_digest([p for p in self.module.parameters()])
        agreed = compare_across_ranks(
            digest, group=self.group, check="replica_digest", step=step, what="parameter digest",
            reference_rank=self.reference_rank,
        )
        self.checks += 1
        self.last_verified_step = step
        self.last_digest = agreed
        return agreed
