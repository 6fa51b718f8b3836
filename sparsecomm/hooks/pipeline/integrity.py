"""Integrity on the wire (``wire_checksum``): seal what this rank sends, check what it receives.

Every payload a rank puts on a sparse wire is sealed right after encoding (a status word and
a CRC-32C: ``compress.payload_seal``), so the checksum covers what the encoder wrote. Every
receiver checks every payload it received, its own copy included, before it decodes any of
them into the bucket; a mismatch raises :class:`~sparsecomm.errors.WireIntegrityError`
naming the step, the bucket and the sender, before DDP hands the gradient to the optimizer.

Who raises. After an all-gather (or the leader's broadcast) every rank holds the same bytes,
so a payload that changed at its sender, after encoding, fails on every rank, and every
rank raises the same error from the data it has, with no extra collective. The owner
exchange's first leg is an all-to-all (each message has one receiver): an owner that
receives a bad message does not raise alone, it reports it in the status of its reply, which
every rank receives in the second leg's all-gather. The shared-index exchange reports a bad
index broadcast in one extra element of its values allreduce, so every rank learns how many
ranks saw it. A corruption that only some receivers of an all-gather see (on the way to
them) makes those ranks raise; the others received intact bytes and go on to their next
collective, which fails once the raising ranks stop (docs/wire.md, "Integrity").

Sums cannot be sealed: where the wire is an allreduce (random-k's values, the shared-index
values, dense steps) the receivers get a sum no sender wrote, so no per-payload checksum
survives it; those wires carry none.
"""
import torch

from sparsecomm.compress import payload_seal
from sparsecomm.errors import WireIntegrityError

TRAILER_BYTES = payload_seal.TRAILER_BYTES


def trailer_bytes(config) -> int:
    """Bytes each payload of this config carries after its own (0 with the checksum off)."""
    return TRAILER_BYTES if config.wire_checksum else 0


def seal(sealed: torch.Tensor | None, status: int = payload_seal.STATUS_OK) -> None:
    """Seal one payload (None: the checksum is off, nothing to do)."""
    if sealed is not None:
        payload_seal.seal(sealed, status)


def bad_rows(rows: torch.Tensor) -> list[int]:
    """The rows (sealed payloads, uint8 [rows, sealed bytes]) whose CRC-32C does not match."""
    intact, _ = payload_seal.check(rows)
    return [row for row, ok in enumerate(intact) if not ok]


def check_received(call, rows: torch.Tensor, step: int) -> None:
    """Raise WireIntegrityError if a sealed payload of ``rows`` (one per sender, in rank order)
    does not match its checksum."""
    bad = bad_rows(rows)
    if bad:
        fail_payloads(call, step, bad)


def fail_payloads(call, step: int, senders: list[int]) -> None:
    """Raise the integrity error for the payloads of ``senders`` (ranks) that failed their check."""
    several = len(senders) > 1
    fail(call, step, f"the payload{'s' * several} from {ranks(senders)} {'do' if several else 'does'} not match "
                     f"{'their' if several else 'its'} CRC-32C")


def fail(call, step: int, what: str) -> None:
    """Raise the integrity error of ``call``'s bucket at ``step``; the hook's memories of the
    step are put back at the next step (when the state keeps copies), as for a skipped step."""
    state = call.state
    journal = state._journal
    if journal is not None:
        journal.skip_requested = True  # undone at the next step's start, as TopKState.skip_step()
    undo = ("its memories go back to before this step if training goes on" if journal is not None else
            "its memories keep this step's changes (on_overflow='drop'): restart from a checkpoint")
    raise WireIntegrityError(
        f"topk_hook: wire integrity, step {step}, bucket {call.index}: {what} (wire_checksum=True). The bytes "
        f"changed after their sender encoded them (in memory or on the way); nothing of this bucket was applied, so no "
        f"parameter changes, and the hook raises this on every rank that received them; {undo}"
    )


def ranks(numbers) -> str:
    """"rank 1", "ranks 0, 2"."""
    return ("rank " if len(numbers) == 1 else "ranks ") + ", ".join(str(r) for r in numbers)
