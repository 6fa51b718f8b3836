"""Inputs shared by the kernel tests of every implementation (tests/test_op_*.py: CPU, CUDA,
Triton), and what some of them must give, worked by hand."""
from fractions import Fraction

import torch

INF, NAN = float("inf"), float("nan")


def ef_inputs(n: int, dtype: torch.dtype, seed: int, kind: str = "randn") -> tuple[torch.Tensor, torch.Tensor]:
    """(grad, residual) of the error-feedback ops, on the CPU in ``dtype``. Kinds: ``randn``
    (residual 0.1 randn); ``nonfinite``: randn with NaN, +Inf and -Inf at entries 1, n // 2 and
    n - 2; ``scattered``: randn with three each of NaN, +Inf and -Inf at random entries, residual
    zero; ``ties``: few distinct magnitudes, both signs, so the k-th is tied (the residual keeps
    them discrete); ``equal``: one magnitude everywhere; ``zeros``: mostly exact zeros
    (embedding-like gradients), residual zero; ``special``: NaN, +-Inf, signed zeros, large
    finite values (no saturation) and tiny ones among randn."""
    gen = torch.Generator().manual_seed(seed)
    if kind in ("randn", "nonfinite"):
        grad = torch.randn(n, generator=gen)
        residual = torch.randn(n, generator=gen) * 0.1
        if kind == "nonfinite" and n >= 7:
            grad[[1, n // 2, n - 2]] = torch.tensor([NAN, INF, -INF])
    elif kind == "scattered":
        grad = torch.randn(n, generator=gen)
        for position, value in zip(torch.randperm(n, generator=gen)[:9].tolist(), [NAN, INF, -INF] * 3):
            grad[position] = value
        residual = torch.zeros(n)
    elif kind == "ties":
        grad = torch.randint(-4, 5, (n,), generator=gen) * 0.25
        residual = torch.randint(-2, 3, (n,), generator=gen) * 0.125
    elif kind == "equal":
        grad = torch.full((n,), 0.5)
        residual = torch.full((n,), 0.25)
    elif kind == "zeros":
        grad = torch.randn(n, generator=gen)
        grad[torch.rand(n, generator=gen) < 0.9] = 0.0
        residual = torch.zeros(n)
    elif kind == "special":
        grad = torch.randn(n, generator=gen)
        grad[5::17] = INF
        grad[9::17] = -INF
        grad[3::19] = -0.0
        grad[7::23] = 0.0
        grad[11::29] = 6.0e4
        grad[13::31] = -1.0e-30
        grad[1::13] = NAN
        residual = torch.randn(n, generator=gen) * 0.1
    else:
        raise ValueError(kind)
    return grad.to(dtype), residual.to(dtype)


def chunk_data(n: int, seed: int, nonfinite: bool) -> torch.Tensor:
    """A float32 gradient for the chunk ops: randn with zeros, exact ties, subnormals, a run of
    zeros inside the second 4096-entry chunk, and optionally NaN, +-Inf and -NaN."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=generator)
    draw = torch.rand(n, generator=generator)
    x[draw < 0.05] = 0.0
    x[(draw >= 0.05) & (draw < 0.07)] = 1.5  # ties with each other, above most of randn
    x[(draw >= 0.07) & (draw < 0.08)] = -1.5
    x[(draw >= 0.08) & (draw < 0.09)] = 1e-40  # subnormal
    x[(draw >= 0.09) & (draw < 0.095)] = -3e-42
    if n >= 4200:
        x[4096:4200] = 0.0
    if nonfinite and n >= 8:
        x[[1, n // 2, n // 3, n - 1]] = torch.tensor([NAN, INF, -INF, -NAN])
    return x

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


# --------------------------------------------------------------------------- fp16 saturation
#
# A finite acc beyond fp16's range goes out as +-s, s = 65504 rounded down to a multiple of
# ulp(acc) in acc's own dtype (docs/precision.md): then s and acc - s are both exact there, and
# sent + residual == acc holds for every finite acc. 65504 itself would not do once ulp(acc)
# exceeds 32 (65504 = 2047 x 32): float32 from 2^29 on, bfloat16 from 2^13 on. Worked by hand:
# (acc, s); ulp(acc) = 2^(e - 23) in float32, 2^(e - 7) in bfloat16, for acc in [2^e, 2^(e+1)).
FP16_SATURATION = {
    torch.float32: [
        (65520.0, 65504.0),                 # ulp 2^-8
        (2.0**29 - 32, 65504.0),            # ulp 32 (65504's own): the largest acc sent as 65504
        (2.0**29, 65472.0),                 # ulp 64: 1023 x 64
        (2.0**29 + 65536, 65472.0),         # acc - 65504 = 2^29 + 32 is no float32 (ulp 64 there)
        (2.0**30 - 64, 65472.0),            # ulp 64
        (2.0**30, 65408.0),                 # ulp 128: 511 x 128
        (2.0**39 - 2.0**15, 32768.0),       # ulp 2^15: once
        (2.0**39, 0.0),                     # ulp 2^16 > 65504: all of acc stays in the residual
        (2.0**100 * 3, 0.0),
        (float.fromhex("0x1.c363cap+127"), 0.0),  # the float32 just under 3e38's
        (float.fromhex("0x1.c363ccp+127"), 0.0),  # 3e38 in float32
        (float.fromhex("0x1.fffffep+127"), 0.0),  # float32's largest
    ],
    torch.bfloat16: [
        (65280.0, 65280.0),                 # bfloat16's largest below 65504: fp16 holds it
        (65536.0, 65024.0),                 # ulp 512: 127 x 512
        (2.0**17, 64512.0),                 # ulp 1024: 63 x 1024
        (2.0**23 - 2.0**15, 32768.0),       # ulp 2^15: once
        (2.0**23, 0.0),                     # ulp 2^16
        (float.fromhex("0x1.c4p+127"), 0.0),  # 3e38 in bfloat16
    ],
}


def fp16_saturation_grad(dtype: torch.dtype, noise: int = 40) -> tuple[torch.Tensor, int]:
    """The hand-worked accs of ``dtype`` and their negatives, then ``noise`` small entries; and
    k = the number of hand-worked ones (every one of them exact in ``dtype``)."""
    big = [acc for acc, _ in FP16_SATURATION[dtype]]
    values = torch.tensor(big + [-acc for acc in big], dtype=torch.float64)
    assert torch.equal(values.to(dtype).double(), values), "a hand-worked acc is not exact in its dtype"
    small = torch.randn(noise, generator=torch.Generator().manual_seed(len(big))).double()
    return torch.cat([values, small]).to(dtype), 2 * len(big)


def check_fp16_saturation(acc: torch.Tensor, indices: torch.Tensor, values: torch.Tensor,
                          residual: torch.Tensor) -> None:
    """``acc`` from :func:`fp16_saturation_grad`, an fp16 wire's sent ``indices`` (bucket-relative,
    any order), ``values`` and the new ``residual``: every hand-worked acc went out as its s,
    with acc's sign, and sent + residual == acc at every sent entry, in exact rational
    arithmetic (sent: the value in acc's dtype, as receivers add it)."""
    acc, indices, values, residual = acc.cpu(), indices.cpu().long(), values.cpu(), residual.cpu()
    assert values.dtype == torch.float16
    sent = dict(zip(indices.tolist(), values.float().tolist()))
    cases = FP16_SATURATION[acc.dtype]
    for position, (_, s) in enumerate(cases):
        for entry, sign in ((position, 1.0), (position + len(cases), -1.0)):
            assert entry in sent, f"acc {acc[entry].item()!r} was not selected"
            assert sent[entry] == sign * s, f"acc {acc[entry].item()!r} went out as {sent[entry]!r}, not {sign * s!r}"
    check_conservation(acc[indices], values, residual[indices])


def check_conservation(acc: torch.Tensor, values: torch.Tensor, residual: torch.Tensor) -> None:
    """values.to(acc.dtype) + residual == acc, entry by entry, in exact rational arithmetic."""
    for a, v, r in zip(acc.tolist(), values.to(acc.dtype).tolist(), residual.tolist()):
        assert Fraction(v) + Fraction(r) == Fraction(a), f"acc {a!r}: sent {v!r} + residual {r!r} != acc"
