"""Inputs shared by the kernel tests of every backend (CPU, CUDA, Triton)."""
import torch

# (grad dtype, wire dtype) pairs where the wire's range is narrower than the gradient's.
NARROW_WIRE_PAIRS = [(torch.float32, torch.float16), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16)]


def beyond_wire_range(grad_dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """A gradient with values at and beyond fp16/bf16 limits, +-Inf and NaN, plus small noise;
    and k = the number of such special values (so they are exactly the ones selected)."""
    big = [65504.0, 65519.0, 65520.0, 70000.0, 1e6, 3.3e38, float("inf"), -float("inf"), float("nan")]
    if grad_dtype == torch.float32:
        big += [3.3895e38, 3.3896e38, 3.4e38, -3.4e38]
    grad = torch.cat([torch.tensor(big), -torch.tensor(big), torch.randn(50)]).to(grad_dtype)
    return grad, 2 * len(big)


# --------------------------------------------------------------------------- non-finite acc
#
# The residual rule of csrc/README.md: an entry whose acc is +-Inf or NaN is sent first
# (unchanged, so every rank sees the overflow) and leaves exactly +0 in the residual, sent or
# not; finite entries keep sent + residual == acc. Inf - Inf = NaN left in a residual would
# rank first and be sent on every later step: one overflow step would poison training.

NON_FINITE = (float("nan"), float("inf"), -float("inf"))


def with_non_finite(n: int, dtype: torch.dtype, count: int, seed: int) -> torch.Tensor:
    """A randn gradient with ``count`` entries at random positions set to NaN, +Inf, -Inf in
    turn; ``count >= n``: every entry is NaN (an all-NaN bucket)."""
    generator = torch.Generator().manual_seed(seed)
    grad = torch.randn(n, generator=generator)
    if count >= n:
        grad.fill_(float("nan"))
    else:
        positions = torch.randperm(n, generator=generator)[:count]
        grad[positions] = torch.tensor([NON_FINITE[j % 3] for j in range(count)])
    return grad.to(dtype)


def topk_non_finite_cases(n: int) -> list[tuple[str, int, int]]:
    """(name, non-finite entries, k) for ef_topk_pack on n entries."""
    return [
        ("one-of-each, k larger", 3, max(4, n // 100)),  # every non-finite entry is sent
        ("more than k", 9, 5),                           # 4 of them are not sent
        ("exactly k", 9, 9),                             # all sent, nothing non-finite left over
        ("all NaN", n, max(1, n // 100)),
    ]


def threshold_non_finite_cases(n: int) -> list[tuple[str, int, float, int]]:
    """(name, non-finite entries, threshold, capacity) for ef_threshold_pack on n entries."""
    return [
        ("one-of-each, room for all", 3, 0.5, n),
        ("more than the capacity", 9, 0.5, 4),          # the lowest-index hits fill the capacity
        ("only non-finite selected, capacity short", 9, float("inf"), 4),
        ("NaN threshold: Inf not selected", 9, float("nan"), n),
        ("capacity 0", 3, 0.5, 0),
        ("all NaN", n, 0.5, max(1, n // 100)),
    ]


def check_non_finite_rule(acc: torch.Tensor, indices: torch.Tensor, values: torch.Tensor,
                          residual: torch.Tensor) -> None:
    """The rule, checked from acc alone (no backend involved). ``indices``: bucket-relative
    positions of the sent ``values`` (any order)."""
    acc, indices, values, residual = acc.cpu(), indices.cpu().long(), values.cpu(), residual.cpu()
    bad = ~torch.isfinite(acc)
    assert bool(torch.isfinite(residual).all()), \
        f"residual holds Inf/NaN at {torch.nonzero(~torch.isfinite(residual)).flatten()[:10].tolist()}"
    zero_bits = residual[bad].float().view(torch.int32)  # +0.0 exactly (not -0.0)
    assert bool((zero_bits == 0).all()), "residual at a non-finite acc must be +0"
    sent = torch.zeros_like(acc)
    sent[indices] = values.to(acc.dtype)
    total = (sent.float() + residual.float()).to(acc.dtype)
    assert bool((total[~bad] == acc[~bad]).all()), "sent + residual != acc at a finite acc"
    # Non-finite values travel unchanged: NaN as NaN, +-Inf with its sign.
    sent_bad = bad[indices]
    wire, exact = values.float()[sent_bad], acc.float()[indices][sent_bad]
    assert torch.equal(torch.isnan(wire), torch.isnan(exact))
    assert torch.equal(wire[~torch.isnan(wire)], exact[~torch.isnan(exact)])
