"""One collective that tells every rank whether all ranks agree, and who does not.

Used by the replica digest and the gradient agreement monitors. The fast path is a
single all-reduce (MAX) of ``[value, ~value, failed]`` as int64: its result holds the
maximum value, the bitwise complement of the minimum (``~`` reverses int64 order without
overflowing, unlike negation at -2**63) and whether any rank reported a local failure.
Every rank receives the same three numbers, so every rank takes the same branch: either
all return, or all enter the (rare) diagnosis all-gather and all raise. No rank can be
left blocked in a collective the others skipped.
"""
from collections import Counter

import torch
import torch.distributed as dist

from sparsecomm.monitor.errors import CorruptionDetected


def _group(group):
    if not dist.is_initialized():
        raise RuntimeError("cross-rank monitors need torch.distributed to be initialised (init_process_group)")
    return group if group is not None else dist.group.WORLD


def suspects(values: list[int], failed: list[bool], reference_rank: int | None = None) -> tuple[tuple[int, ...], str]:
    """(suspect ranks, rule used) given every rank's value and local-failure flag.

    1. Ranks that reported a local failure are the suspects.
    2. Otherwise, if a strict majority of ranks hold the same value, the others.
    3. Otherwise, if ``reference_rank`` is given, the ranks that differ from it.
    4. Otherwise all ranks: with no majority (e.g. two ranks) nothing says which is right.
    """
    if any(failed):
        return tuple(r for r, f in enumerate(failed) if f), "ranks that failed locally"
    value, count = Counter(values).most_common(1)[0]
    if count * 2 > len(values):
        return tuple(r for r, v in enumerate(values) if v != value), "ranks that differ from the majority"
    if reference_rank is not None:
        reference = values[reference_rank]
        return tuple(r for r, v in enumerate(values) if v != reference), f"ranks that differ from rank {reference_rank}"
    return tuple(range(len(values))), "all ranks (no strict majority, so no replica can be trusted over another)"


def compare_across_ranks(
    value: torch.Tensor,
    *,
    group,
    check: str,
    step: int,
    what: str,
    failure: BaseException | None = None,
    reference_rank: int | None = None,
) -> int:
    """The common value if all ranks hold the same ``value`` (0-d int64) and none failed.

    Raises:
        CorruptionDetected: on every rank otherwise, naming the suspects (see
        :func:`suspects`); chained to ``failure`` on the rank that passed one.
    """
    group = _group(group)
    device = torch.device("cpu") if dist.get_backend(group) == "gloo" else value.device
    local = value.to(device)
    failed = failure is not None
    packed = torch.stack([local, ~local, torch.tensor(int(failed), dtype=torch.int64, device=device)])
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    high, inverted_low, any_failed = packed.tolist()
    if high == ~inverted_low and not any_failed:
        return high
    # Rare path: learn every rank's value, flag and message to name the suspects.
    mine = (int(local.item()), failed, None if failure is None else f"{type(failure).__name__}: {failure}")
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    values = [v for v, _, _ in everyone]
    flags = [f for _, f, _ in everyone]
    ranks, rule = suspects(values, flags, reference_rank)
    if any(flags):
        reasons = "; ".join(f"rank {r}: {message}" for r, (_, f, message) in enumerate(everyone) if f)
        detail = f"step abandoned because a rank failed locally ({reasons})"
    else:
        listing = ", ".join(f"rank {r}: {v & ((1 << 64) - 1):016x}" for r, v in enumerate(values))
        detail = f"{what} differs across ranks ({listing}); suspects = {rule}"
    raise CorruptionDetected(check, step, ranks, detail) from failure
