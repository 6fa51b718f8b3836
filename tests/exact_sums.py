"""Exact sums of float tensors, and the rounding a floating-point sum is allowed.

An oracle that adds in float32 rounds as well as the code it checks, and in another order:
a bound for the code's rounding alone then holds or not depending on the data. These
oracles do not round. Every float32, bfloat16 and float16 value is a whole multiple of
2^-149 (float32's smallest subnormal; bf16's is 2^-133, fp16's 2^-24), so counted in
UNIT = 2^-150 (half of it: halves of those values are whole units too) it is a Python int,
and sums and differences of ints are exact.

The allowance: a sum of n terms formed by n - 1 additions in any order (recursive, pairwise
or a ring allreduce's), each rounded to nearest in a format of unit roundoff u = eps / 2, is
within gamma_{n-1} * sum |x_i| of the exact sum, gamma_m = m u / (1 - m u) (Higham,
"Accuracy and Stability of Numerical Algorithms", 2nd ed., section 4.2). An addition never
rounds on underflow (a subnormal sum is exact), so the bound holds for every finite input.
"""
from fractions import Fraction
from typing import Sequence

import torch

UNIT_EXPONENT = 150
UNIT = Fraction(1, 2**UNIT_EXPONENT)
EXACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def units(tensor: torch.Tensor) -> list[int]:
    """Every entry of a float32/bfloat16/float16 tensor as a whole number of UNIT, exactly
    (flattened). A non-finite entry raises: it has no exact value."""
    if tensor.dtype not in EXACT_DTYPES:
        raise TypeError(f"units: {tensor.dtype} values are not all whole multiples of 2^-{UNIT_EXPONENT}")
    # Widening to float64 is exact; so is scaling by a power of two (|x| < 2^128, so the
    # product stays below 2^278, far inside float64); int() of a whole float64 is exact.
    scaled = tensor.detach().cpu().double().flatten() * 2.0**UNIT_EXPONENT
    return [int(v) for v in scaled.tolist()]


def unit_roundoff(dtype: torch.dtype) -> Fraction:
    """u = eps / 2 of ``dtype``, exactly (eps is a power of two)."""
    return Fraction(torch.finfo(dtype).eps) / 2


def gamma(m: int, dtype: torch.dtype) -> Fraction:
    """gamma_m = m u / (1 - m u): the relative error m roundings to nearest in ``dtype`` may compound."""
    u = unit_roundoff(dtype)
    return m * u / (1 - m * u)


def sum_rounding_misses(computed: torch.Tensor, addends: Sequence[torch.Tensor], dtype: torch.dtype) -> list[int]:
    """Flat positions where ``computed`` is farther from the exact sum of ``addends`` (one
    tensor per term, all of computed's shape) than p - 1 additions in ``dtype`` may put it,
    p = len(addends): |computed - sum_r x_r| > gamma_{p-1} sum_r |x_r|, decided exactly."""
    bound = gamma(len(addends) - 1, dtype)
    misses = []
    for position, (got, *terms) in enumerate(zip(units(computed), *(units(a) for a in addends))):
        if abs(got - sum(terms)) * bound.denominator > bound.numerator * sum(abs(t) for t in terms):
            misses.append(position)
    return misses
