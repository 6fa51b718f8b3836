"""``budget="model"`` (the default): the buckets of a step share one top-k budget, density x
the model's entries, instead of each sending density x its own.

DDP (and FSDP, per module) hand the hook one bucket at a time, so no top-k can see the
whole model at once. The next best: each bucket's k comes from the last step's model-wide
top-k. Every sparse bucket counts its acc's entries by magnitude, in bins of an eighth of a
power of two (the float32 exponent of |acc| and its mantissa's first 3 bits: one pass, no
sort). At the step's last bucket one all-reduce sums those counts
over the group; from the summed histogram every rank finds the same threshold, the bin
where the K x world-size largest entries end (K = the sum of the buckets' plain k), and each
bucket's count above it (with its part of the threshold bin, pro rata) becomes its share of
K. Bins must be fine: a bin a whole power of two wide lets the pro-rata part, split by count
rather than by magnitude, take much of K (under HSDP 2x2 on the default task such bins
ended a seed at +0.17 in val loss where exact magnitudes ended it at -0.04). A bucket's next k is its share, at least 1: the same on every rank,
so the fixed-size payloads still line up. Shares are kept per parameter name (a bucket's
share split by its parameters' sizes), so they survive DDP's bucket rebuild and a
checkpoint (``state_dict``).

Cost: one histogram pass per bucket, and one all-reduce of ``WINDOW - 1`` int32 counts per
bucket (plus one) per step, whose result is the step's one host synchronisation. The
window: what is all-reduced are the bins of the 4 powers of two around the last step's
threshold, those above it added into its top bin; the entries below it are the bucket's
size less the others, so they need not travel. The first step after construction or a load has no last
threshold: the ranks agree on one first (an all-reduce of one number, the largest of the
ranks' own). A job whose steps have one bucket has nothing to share, and one whose counts
would cost more than a tenth of its dense gradient's bytes (a toy model) little to gain:
after its first step the budget counts nothing and sends nothing (and plain error feedback
takes the fused kernel again).

Where the mass of a gradient sits in few layers (embeddings) the plain per-bucket density
starves them: under HSDP 2x2, where each FSDP module is a bucket, the model budget is
equivalent to dense where the per-module one is not; on the default task in 7 DDP buckets
it takes `topk-dgc` from worse (+0.27) to inconclusive (+0.04) (docs/results.md, docs/fsdp.md).
"""
import torch
import torch.distributed as dist

SUB_BINS = 8
"""Bins per power of two: the mantissa's first 3 bits (each bin 9% wide at most)."""
BINS = 255 * SUB_BINS
"""Bins of finite float32 magnitudes (the exponent 255 is Inf/NaN: the codes from BINS on)."""
WINDOW = 4 * SUB_BINS
"""Bins around the last threshold that the all-reduce carries (the lowest derived): a threshold
that moves by up to 2 powers of two in a step is found exactly; one that moves further is
found in an end bin, less exactly, and the next step re-centres."""


MAX_COUNT_BYTES = 0.1
"""The counts are sent only while they cost less than this share of the dense gradient's bytes
(a toy model's counts can outweigh the entries they would move)."""


class ModelBudget:
    """Per-parameter shares of the model's k, agreed by all ranks at each step's end."""

    __slots__ = ("shares", "shares_before_step", "low_bin", "counting", "observed")

    def __init__(self):
        self.shares: dict[str, float] = {}  # name -> entries of K it gets (the last step's top-k)
        self.shares_before_step: dict[str, float] = {}  # what a rolled-back step gets back
        self.low_bin: int | None = None  # the window's lowest bin (None: not agreed yet)
        self.counting = True  # False while the steps have one bucket, or counts too dear to send
        self.observed: list[tuple[tuple[str, ...], tuple[int, ...], int, torch.Tensor | None]] = []

    def k_of(self, names: tuple[str, ...], numels: tuple[int, ...], plain_k: int) -> int:
        """The bucket's k: its parameters' shares, or the plain k before any step agreed on them."""
        if not self.shares or any(name not in self.shares for name in names):
            return plain_k
        return min(sum(numels), max(1, round(sum(self.shares[name] for name in names))))

    def observe(self, names: tuple[str, ...], numels: tuple[int, ...], plain_k: int, acc: torch.Tensor | None) -> None:
        """Note a sparse bucket; while counting, count its entries of ``acc`` per bin of magnitude
        (on acc's device). ``acc`` None: not counting (the kernel forms acc itself)."""
        counts = None
        if self.counting:
            # the exponent and the mantissa's first 3 bits of |acc| (the sign bit shifted out)
            codes = (acc.detach().float().view(torch.int32) >> (23 - 3)) & 0x7FF
            counts = torch.bincount(codes, minlength=256 * SUB_BINS)  # the finite bins, then Inf/NaN
        self.observed.append((names, numels, plain_k, counts))

    def agree(self, group) -> int:
        """At the step's last bucket: this step's model-wide top-k, counted per bucket and
        summed over the ranks, becomes every parameter's share for the next step. Returns the
        bytes this rank put into the all-reduce."""
        self.shares_before_step = self.shares
        observed = sorted(self.observed, key=lambda bucket: bucket[0])  # the same order on every rank
        self.observed.clear()
        if not observed:  # a dense step (warm-up, fallback): nothing to learn from
            return 0
        # Every rank has the same buckets, so every rank decides these alike, without a word.
        sizes = [sum(numels) for _, numels, _, _ in observed]
        if len(observed) == 1 or (len(observed) * (WINDOW - 1) + 1) * 4 > MAX_COUNT_BYTES * 4 * sum(sizes):
            self.counting = False  # one bucket, or a model so small that the counts cost more than they save
            return 0
        if any(counts is None for *_, counts in observed):
            self.counting = True  # more buckets than before: count from the next step
            return 0
        world_size = dist.get_world_size(group)
        histograms = torch.stack([counts for *_, counts in observed])
        budget = sum(plain_k for _, _, plain_k, _ in observed)
        target = budget * world_size
        # int32 while no count can pass 2^31 (every bucket's entries on every rank).
        dtype = torch.int32 if max(sizes) * world_size < 2**31 else torch.int64
        sent = 0
        if self.low_bin is None:  # no last threshold: agree on the largest of the ranks' own
            mine = torch.tensor([_threshold_bin(histograms[:, :BINS].sum(0).cpu(), budget)], dtype=dtype,
                                device=histograms.device)
            dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
            sent += mine.element_size()
            self._centre_window(int(mine.item()), relative_to=0)
        message = self._message(histograms).to(dtype)
        dist.all_reduce(message, group=group)
        sent += message.numel() * message.element_size()
        message = message.cpu().double()  # the step's host synchronisation
        if message[-1] > 0:  # Inf/NaN on some rank: the step is skipped (on_overflow); shares stay
            return sent
        counts = self._histograms(message[:-1], [size * world_size for size in sizes])
        entries = _top_entries(counts, target)
        whole = float(entries.sum())
        if whole > 0:
            self.shares = {name: budget * float(count) / whole * numel / size
                           for (names, numels, _, _), count, size in zip(observed, entries, sizes)
                           for name, numel in zip(names, numels)}
            self._centre_window(_threshold_bin(counts.sum(0), target), relative_to=self.low_bin)
        return sent

    def _message(self, histograms: torch.Tensor) -> torch.Tensor:
        """(buckets, 2048) counts by bin -> what the all-reduce carries: per bucket the window's
        bins but its lowest (those above the window added into its top), then the number of
        Inf/NaN entries of all buckets."""
        nonfinite = histograms[:, BINS:].sum().reshape(1)
        low, high = self.low_bin, self.low_bin + WINDOW - 1
        bins = torch.cat([histograms[:, low + 1:high], histograms[:, high:BINS].sum(1, keepdim=True)], dim=1)
        return torch.cat([bins.flatten(), nonfinite])

    def _histograms(self, message: torch.Tensor, entries: list[int]) -> torch.Tensor:
        """The summed histograms back from the message: (buckets, bins), the lowest bin each
        bucket's entries less the others (everything at or below the window)."""
        above = message.reshape(len(entries), -1)
        lowest = torch.tensor(entries, dtype=above.dtype) - above.sum(1)
        return torch.cat([lowest[:, None], above], dim=1)

    def _centre_window(self, threshold_bin: int, relative_to: int) -> None:
        """Put the window around a threshold (a bin of a histogram that starts at bin ``relative_to``)."""
        self.low_bin = min(max(threshold_bin + relative_to - WINDOW // 2, 0), BINS - WINDOW)

    def undo_step(self) -> None:
        """The loop skipped the last step: its shares go, the ones it started from come back."""
        self.shares = self.shares_before_step

    def forget_step(self) -> None:
        """A step that did not finish (an error mid-step): what it counted is dropped."""
        self.observed.clear()

    def state_dict(self) -> dict[str, float]:
        return dict(self.shares)

    def load_state_dict(self, shares: dict[str, float]) -> None:
        self.shares = self.shares_before_step = {str(name): float(share) for name, share in shares.items()}
        self.low_bin, self.counting = None, True
        self.observed.clear()


def _threshold_bin(per_bin: torch.Tensor, target: int) -> int:
    """The highest bin at or above which ``target`` entries lie (0 if fewer lie anywhere)."""
    at_or_above = per_bin.flip(0).cumsum(0).flip(0)
    reached = (at_or_above >= target).nonzero()
    return int(reached[-1]) if reached.numel() else 0


def _top_entries(counts: torch.Tensor, target: int) -> torch.Tensor:
    """Per bucket (row), how many of the ``target`` largest entries it holds: every entry
    above the threshold bin, and of the threshold bin's entries the share the target still
    needs, pro rata (the bin cannot tell its entries apart)."""
    per_bin = counts.sum(0)
    threshold = _threshold_bin(per_bin, target)
    above = counts[:, threshold + 1:].sum(1)
    still_needed = max(target - float(per_bin[threshold + 1:].sum()), 0.0)
    at = counts[:, threshold]
    in_bin = float(per_bin[threshold])
    return above + (at * min(still_needed / in_bin, 1.0) if in_bin else 0.0)
