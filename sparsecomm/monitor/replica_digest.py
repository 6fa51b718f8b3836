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
Each parameter's storage is read as integers, so it sees bit patterns, not values
(``-0.0`` and ``0.0`` differ, every NaN payload counts): float32 as int32, fp16/bf16 as
int16, wider types (float64) as pairs of int32. Words are sign-extended to int64 and
combined as ``sum_j P_j * sum_c C_c * sum_i W_i * word[j, c, i]`` modulo 2**64 (int64
arithmetic wraps on every torch backend), where ``j`` is the tensor's position in
``module.parameters()``, ``c`` a chunk of 65536 words and ``i`` the position inside the
chunk. All multipliers are odd. Flipping bit ``b`` of one word changes its value by
``+-2**b`` (the sign bit of a two's-complement word by ``2**(n-1)``, still a power of
two after sign extension), so the digest changes by ``P_j * C_c * W_i * 2**b`` modulo
2**64; an odd number times ``2**b`` with ``b < 64`` is never a multiple of 2**64, hence
**every single-bit flip in any parameter changes the digest** (tested for sign, exponent
and mantissa bits of every float dtype). Words are at most 32 bits so that even a
flipped top bit moves the digest by one of 2**33 different amounts depending on where it
is; two simultaneous flips cancel only with probability about 2**-32 (64-bit words would
make two sign flips anywhere cancel exactly). Not a cryptographic hash: it guards against
faults, not adversaries. Integer sums are exact and associative, so the digest does not
depend on thread count, reduction order or device, and equal weights give equal digests
on every rank.
"""
import torch

from sparsecomm.monitor._consensus import compare_across_ranks

_CHUNK = 1 << 16  # entries per chunk: bounds the cached weight vector to 512 KiB
_BLOCK_CHUNKS = 64  # chunks converted to int64 at a time: bounds temporaries to 32 MiB
# Odd 64-bit multipliers (golden-ratio and splitmix constants) as signed int64.
_MUL_ENTRY = 0x9E3779B97F4A7C15 - (1 << 64)
_MUL_CHUNK = 0xBF58476D1CE4E5B9 - (1 << 64)
_MUL_TENSOR = 0x94D049BB133111EB - (1 << 64)
_NONE_MARK = 0x5EED  # what a missing tensor (a parameter without .grad) contributes
_WORD_DTYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32}  # wider elements: several int32
_entry_weights: dict[torch.device, torch.Tensor] = {}


def _as_int64(value: int) -> int:
    """``value`` modulo 2**64, as a signed int64 (what torch's wrapping arithmetic gives)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= (1 << 63) else value


def _weights(device: torch.device) -> torch.Tensor:
    weights = _entry_weights.get(device)
    if weights is None:
        positions = torch.arange(1, _CHUNK + 1, dtype=torch.int64, device=device)
        weights = _entry_weights[device] = (positions * _MUL_ENTRY) | 1
    return weights


def _odd_multipliers(first: int, count: int, multiplier: int, device) -> torch.Tensor:
    positions = torch.arange(first + 1, first + count + 1, dtype=torch.int64, device=device)
    return (positions * multiplier) | 1


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns as a flat integer tensor (no copy when contiguous)."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.bool:
        return flat.to(torch.int8)
    size = flat.element_size()
    return flat.view(_WORD_DTYPES[size] if size in _WORD_DTYPES else torch.int32)


def _tensor_digest(tensor: torch.Tensor) -> torch.Tensor:
    """0-d int64 digest of one tensor's bits (see the module docstring)."""
    words = _words(tensor)
    weights = _weights(words.device)
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    numel = words.numel()
    block = _CHUNK * _BLOCK_CHUNKS
    for start in range(0, numel, block):
        piece = words[start : start + block].to(torch.int64)
        full, tail = divmod(piece.numel(), _CHUNK)
        first_chunk = start // _CHUNK
        if full:
            sums = (piece[: full * _CHUNK].view(full, _CHUNK) * weights).sum(dim=1)
            total += (sums * _odd_multipliers(first_chunk, full, _MUL_CHUNK, words.device)).sum()
        if tail:
            partial = (piece[full * _CHUNK :] * weights[:tail]).sum()
            total += partial * _odd_multipliers(first_chunk + full, 1, _MUL_CHUNK, words.device)[0]
    return total


def tensors_digest(tensors) -> torch.Tensor:
    """Exact order-dependent digest of a sequence of tensors (None allowed), as a 0-d int64
    tensor on the first tensor's device (no host synchronisation)."""
    total = None
    for position, tensor in enumerate(tensors):
        if tensor is None:
            contribution = torch.tensor(_NONE_MARK, dtype=torch.int64)
        else:
            contribution = _tensor_digest(tensor)
        multiplier = _as_int64(((position + 1) * _MUL_TENSOR) | 1)
        if total is None:
            total = torch.zeros((), dtype=torch.int64, device=contribution.device)
        total += contribution.to(total.device) * multiplier
    if total is None:
        total = torch.zeros((), dtype=torch.int64)
    return total


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
        every: check when ``step % every == 0``. Detection latency is at most ``every``
            steps; a roll-back loses at most that many steps of work.
        group: process group of the replicas; None means the default group.
        reference_rank: tie-break when no strict majority exists (see above).

    Attributes:
        last_verified_step: last step at which all replicas agreed (None before the first
            check): the newest state a roll-back may restore.
        last_digest: the agreed digest at that step.
    """

    def __init__(self, module: torch.nn.Module, *, every: int = 10, group=None, reference_rank: int | None = None):
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"every must be an integer >= 1 (steps), got {every!r}")
        self.module = module
        self.every = every
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
