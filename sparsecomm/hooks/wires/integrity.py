"""Integrity on the wire (``wire_checksum``, ``wire_agreement``): seal what this rank sends,
check what it receives, raise before the optimizer step.

Every payload a rank puts on a sparse wire is sealed right after encoding (a status word and
a CRC-32C: ``compress.payload_seal``), so the checksum covers what the encoder wrote. Every
receiver checks every payload it received, its own copy included, before it decodes any of
them into the bucket; a bucket with a payload that fails is not decoded at all, and the
rank raises :class:`~sparsecomm.errors.WireIntegrityError` naming the step, the bucket and
the sender, from that bucket's future, before DDP hands the gradient to the optimizer; the
step is rolled back in the hook's memories.

Who raises. After an all-gather every rank holds the same bytes, so a payload that changed at
its sender fails on every rank and every rank raises the same error. The owner exchange's
first leg is an all-to-all (each message has one receiver): an owner that receives a bad
message reports it in the status of its reply, which every rank receives. A fault on the
way to some receivers only is seen by those only; the others apply the intact bytes, and a
rank that raised alone would be a step behind them. With ``wire_agreement`` the checks only
record what they found (:class:`StepSeals`), and the hook body of the step's last bucket,
once every sealed bucket has arrived and been checked, agrees with one small allreduce: if
any rank found a fault, every rank raises the same error, in the same step.

Sums cannot be sealed: where the wire is an allreduce (random-k's values, the shared-index
values, dense steps) the receivers get a sum no sender wrote, so no per-payload checksum
survives it; those wires carry none. The shared-index exchange's index broadcast is sealed,
and every rank's verdict on it rides its values allreduce (``shared_index``).
"""
import torch
import torch.distributed as dist

from sparsecomm.compress import payload_seal
from sparsecomm.ops import dispatch
from sparsecomm.errors import WireIntegrityError

TRAILER_BYTES = payload_seal.TRAILER_BYTES

# What a check found: a payload that failed (its sender), an owner's reply that failed (the
# owner), an owner's report of a message that failed (the owner, and the sender), or an
# owner's report that its copy of the leader's index broadcast failed (the owner).
PAYLOAD, REPLY, REPORTED, BROADCAST = range(4)
_KINDS = 4
_MAX_BUCKETS = 1 << 16


def trailer_bytes(config) -> int:
    """Bytes each payload of this config carries after its own (0 with the checksum off)."""
    return TRAILER_BYTES if config.wire_checksum else 0


def seal(sealed: torch.Tensor | None, status: int = payload_seal.STATUS_OK) -> None:
    """Seal one payload (None: the checksum is off, nothing to do)."""
    if sealed is not None:
        payload_seal.seal(sealed, dispatch.crc32c, status)


def check(rows: torch.Tensor) -> tuple[list[bool], list[int]]:
    """(intact, status) of every sealed payload of ``rows`` (uint8 [rows, sealed bytes])."""
    return payload_seal.check(rows, dispatch.crc32c)


def bad_rows(rows: torch.Tensor) -> list[int]:
    """The rows (sealed payloads, uint8 [rows, sealed bytes]) whose CRC-32C does not match."""
    intact, _ = check(rows)
    return [row for row, ok in enumerate(intact) if not ok]


class StepSeals:
    """One step's sealed buckets (``agree``: ``wire_agreement``): the futures of their checks
    and decodes, and the faults the checks found on this rank, as (bucket, kind, rank, sender)."""

    __slots__ = ("agree", "futures", "faults")

    def __init__(self, agree: bool = False):
        self.agree = agree
        self.futures: list[torch.futures.Future] = []
        self.faults: list[tuple[int, int, int, int]] = []


def refused(call, step: int, seals: StepSeals, faults) -> torch.Tensor:
    """What a check's callback returns for a bucket in which it found ``faults`` ((kind, rank,
    sender) each): the bucket, not decoded, when the step's agreement will raise on every rank
    (``wire_agreement``); else this rank raises now, naming the first fault."""
    seals.faults.extend((call.index, *fault) for fault in faults)  # from a callback thread: atomic
    if seals.agree:
        return call.out
    fail(call, step, describe(*min(faults)))


def agree(context, group, step: int, device: torch.device, fut: torch.futures.Future) -> torch.futures.Future:
    """With ``wire_agreement``, in the hook body of the step's last bucket: wait until every
    sealed bucket of the step has been checked, then agree on the verdict with one allreduce
    (MAX of one int64: the first fault this rank found, encoded, or 0). Returns ``fut``, or,
    when some rank found a fault, a future holding the same WireIntegrityError on every rank
    (the step is then rolled back)."""
    seals = context.seals
    if not seals.agree or not seals.futures:
        return fut  # nothing to agree on (the same on every rank: the plans are the same)
    for sealed in seals.futures:
        try:
            sealed.wait()
        except Exception:  # noqa: BLE001  (a failed collective: DDP re-raises it from that bucket's future)
            pass
    world_size = dist.get_world_size(group)
    verdict = torch.tensor([max((_key(fault, world_size) for fault in seals.faults), default=0)],
                           dtype=torch.int64, device=device)
    dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=group)
    key = int(verdict.item())
    if key == 0:
        return fut
    if context.journal is not None:
        context.journal.skip_requested = True  # undone at the next step's start, as TopKState.skip_step()
    failed = torch.futures.Future()
    failed.set_exception(error(context, step, *_fault(key, world_size)))
    return failed


def _key(fault, world_size: int) -> int:
    """A positive int64 for a fault; the largest names the lowest bucket (then kind, ranks)."""
    bucket, kind, rank, sender = fault
    return 1 + (((_MAX_BUCKETS - 1 - bucket) * _KINDS + kind) * world_size + rank) * world_size + sender


def _fault(key: int, world_size: int) -> tuple[int, str]:
    rest, sender = divmod(key - 1, world_size)
    rest, rank = divmod(rest, world_size)
    inverted, kind = divmod(rest, _KINDS)
    return _MAX_BUCKETS - 1 - inverted, describe(kind, rank, sender)


def describe(kind: int, rank: int, sender: int) -> str:
    return {PAYLOAD: f"the payload from rank {rank} does not match its CRC-32C",
            REPLY: f"the reply of owner {rank} does not match its CRC-32C",
            REPORTED: f"owner {rank} received a message from rank {sender} that does not match its CRC-32C",
            BROADCAST: f"owner {rank}'s copy of the leader's index broadcast does not match its CRC-32C"}[kind]


def error(context, step: int, bucket: int, what: str) -> WireIntegrityError:
    """The integrity error of ``bucket`` at ``step`` (the first fault found, by bucket)."""
    if context.caller != "topk_hook":  # the averager: its sync is refused before anything is assigned
        then = "the sync is refused and nothing changed (weights, anchor, error buffer)"
    elif context.journal is not None:
        then = ("do not take the optimizer step; its memories go back to before this step if training goes on")
    else:
        then = ("do not take the optimizer step; its memories keep this step's changes (on_overflow='drop'): "
                "restart from a checkpoint")
    return WireIntegrityError(
        f"{context.caller}: wire integrity, step {step}, bucket {bucket}: {what} (wire_checksum=True). The bytes "
        f"changed after their sender encoded them (in memory or on the way); nothing of that bucket was applied: "
        f"{then}"
    )


def fail(call, step: int, what: str) -> None:
    """Raise the integrity error of ``call``'s bucket at ``step`` now, from this rank's own
    verdict, and roll the step back as :func:`agree` does."""
    if call.context.journal is not None:
        call.context.journal.skip_requested = True
    raise error(call.context, step, call.index, what)

