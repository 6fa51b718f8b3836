"""``budget="model"`` (the default): the buckets of a step share one top-k budget, density x
the model's entries, instead of each sending density x its own.

DDP (and FSDP, per module) hand the hook one bucket at a time, so no top-k can see the
whole model at once. The next best: each bucket's k comes from the last step's model-wide
top-k. Every sparse bucket counts its acc's entries per parameter by power of two (the
float32 exponent of |acc|: one pass, no sort). At the step's last bucket one all-reduce sums
those counts over the group; from the summed histogram every rank finds the same threshold
bin, where the K x world-size largest entries end (K = the sum of the buckets' plain k), and
each parameter's count above it (with its part of the threshold bin, pro rata) becomes its
share of K. A bucket's next k is K x (its parameters' share), at least 1: the same on every
rank, so the fixed-size payloads still line up. Shares are per parameter name, so they
survive DDP's bucket rebuild and a checkpoint (``state_dict``).

Cost: one histogram pass per bucket and one all-reduce of ``WINDOW + 1`` counts per
parameter per step, whose result is the step's one host synchronisation. The window: what
is all-reduced are the 32 powers of two around the last step's threshold (magnitudes
outside it are added into its end bins), a few hundred bytes per parameter whatever the
model; the first step after construction or a load sends all 255 exponents.

Where the mass of a gradient sits in few layers (embeddings) the plain per-bucket density
starves them: on the default task split into ~10 DDP buckets, and under HSDP 2x2 where each
FSDP module is a bucket, the per-bucket budget loses quality that the model budget keeps
(docs/results.md, docs/fsdp.md).
"""
import torch
import torch.distributed as dist

EXPONENTS = 255
"""Finite float32 exponents (0: zero and subnormals); 255 is Inf/NaN, counted on its own."""
WINDOW = 32
"""Powers of two the histogram keeps around the last threshold: a step's threshold moving by
more than 2^15 is still found, only less exactly (in an end bin), and the next step re-centres."""


class ModelBudget:
    """Per-parameter shares of the model's k, agreed by all ranks at each step's end."""

    __slots__ = ("shares", "shares_before_step", "low_exponent", "observed")

    def __init__(self):
        self.shares: dict[str, float] = {}  # name -> entries of K it gets (the last step's top-k)
        self.shares_before_step: dict[str, float] = {}  # what a rolled-back step gets back
        self.low_exponent: int | None = None  # the window's lowest exponent (None: all of them)
        self.observed: list[tuple[tuple[str, ...], int, torch.Tensor]] = []  # (names, plain k, histograms)

    def k_of(self, names: tuple[str, ...], numels: tuple[int, ...], plain_k: int) -> int:
        """The bucket's k: its parameters' shares, or the plain k before any step agreed on them."""
        if not self.shares or any(name not in self.shares for name in names):
            return plain_k
        return min(sum(numels), max(1, round(sum(self.shares[name] for name in names))))

    def observe(self, names: tuple[str, ...], numels: tuple[int, ...], plain_k: int, acc: torch.Tensor) -> None:
        """Count the bucket's entries of ``acc`` per parameter and power of two (on acc's device)."""
        exponents = (acc.detach().float().view(torch.int32) >> 23) & 0xFF  # the sign bit shifted out
        counts = torch.stack([torch.bincount(part, minlength=EXPONENTS + 1) for part in exponents.split(numels)])
        self.observed.append((names, plain_k, counts))

    def agree(self, group) -> int:
        """At the step's last bucket: this step's model-wide top-k, counted per parameter and
        summed over the ranks, becomes every parameter's share for the next step. Returns the
        bytes this rank put into the all-reduce."""
        self.shares_before_step = self.shares
        if not self.observed:
            return 0
        budget = sum(plain_k for _, plain_k, _ in self.observed)
        names = [name for bucket_names, _, _ in self.observed for name in bucket_names]
        order = sorted(range(len(names)), key=names.__getitem__)  # the same on every rank
        counts = self._fold_into_window(torch.cat([histograms for _, _, histograms in self.observed])[order])
        self.observed.clear()
        dist.all_reduce(counts, group=group)
        sent = counts.numel() * counts.element_size()
        counts = counts.cpu().double()  # the step's one host synchronisation
        # A step that overflowed on any rank is skipped (on_overflow) and leaves the shares as they were.
        if counts[:, -1].sum() > 0:
            return sent
        target = budget * dist.get_world_size(group)
        entries = _top_entries(counts[:, :-1], target)
        whole = float(entries.sum())
        if whole > 0:
            self.shares = {names[i]: budget * float(count) / whole for i, count in zip(order, entries)}
            self._centre_window(counts[:, :-1], target)
        return sent

    def _fold_into_window(self, counts: torch.Tensor) -> torch.Tensor:
        """(parameters, 256) counts by exponent -> (parameters, window + 1): the window's powers of
        two, those below and above it added into its end bins, Inf/NaN (255) last."""
        if self.low_exponent is None:
            return counts
        low, high = self.low_exponent, self.low_exponent + WINDOW - 1
        return torch.cat([counts[:, :low + 1].sum(1, keepdim=True), counts[:, low + 1:high],
                          counts[:, high:EXPONENTS].sum(1, keepdim=True), counts[:, EXPONENTS:]], dim=1)

    def _centre_window(self, counts: torch.Tensor, target: int) -> None:
        """Put the next step's window around this step's threshold exponent."""
        threshold_bin = _threshold_bin(counts.sum(0), target)
        exponent = threshold_bin + (self.low_exponent or 0)
        self.low_exponent = min(max(exponent - WINDOW // 2, 0), EXPONENTS - WINDOW)

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
        self.low_exponent = None
        self.observed.clear()


def _threshold_bin(per_bin: torch.Tensor, target: int) -> int:
    """The highest bin at or above which ``target`` entries lie (0 if fewer lie anywhere)."""
    at_or_above = per_bin.flip(0).cumsum(0).flip(0)
    reached = (at_or_above >= target).nonzero()
    return int(reached[-1]) if reached.numel() else 0


def _top_entries(counts: torch.Tensor, target: int) -> torch.Tensor:
    """Per parameter (row), how many of the ``target`` largest entries it holds: every entry
    above the threshold bin, and of the threshold bin's entries the share the target still
    needs, pro rata (the bin cannot tell its entries apart)."""
    per_bin = counts.sum(0)
    threshold = _threshold_bin(per_bin, target)
    above = counts[:, threshold + 1:].sum(1)
    still_needed = max(target - float(per_bin[threshold + 1:].sum()), 0.0)
    at = counts[:, threshold]
    in_bin = float(per_bin[threshold])
    return above + (at * min(still_needed / in_bin, 1.0) if in_bin else 0.0)
