"""The exact oracle of the multi-rank tests (exact_sums) on hand-worked cases: it must let
through the worst a legitimate order of additions rounds, and nothing more."""
import pytest
import torch

from exact_sums import gamma, sum_rounding_misses, units


def test_units_are_exact_multiples_of_two_to_the_minus_150():
    smallest_subnormal = torch.tensor([2.0**-149])
    assert units(smallest_subnormal) == [2]
    assert units(torch.tensor([-1.5, 0.0], dtype=torch.bfloat16)) == [-3 * 2**149, 0]
    assert units(torch.tensor([torch.finfo(torch.float32).max])) == [(2**24 - 1) * 2**(127 - 23 + 150)]
    with pytest.raises((OverflowError, ValueError)):
        units(torch.tensor([float("inf")]))
    with pytest.raises(TypeError, match="float64"):
        units(torch.tensor([1.0], dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_worst_rounding_of_two_additions_passes_and_one_ulp_more_does_not(dtype):
    u = torch.finfo(dtype).eps / 2
    one, half_ulp = torch.tensor([1.0], dtype=dtype), torch.tensor([u], dtype=dtype)
    # (1 + u) + u: each addition is a tie that rounds to even, back to 1; the exact sum is
    # 1 + 2u, so the error 2u is the most two roundings may lose here: within gamma_2 (1 + 2u).
    computed = (one + half_ulp) + half_ulp
    assert computed.item() == 1.0
    assert sum_rounding_misses(computed, [one, half_ulp, half_ulp], dtype) == []
    below = torch.tensor([1.0 - u], dtype=dtype)  # the next value below 1: error 3u
    assert sum_rounding_misses(below, [one, half_ulp, half_ulp], dtype) == [0]


def test_a_single_term_allows_no_rounding_and_positions_are_reported():
    assert gamma(0, torch.float32) == 0
    x = torch.tensor([1.0, 2.0, 3.0])
    assert sum_rounding_misses(x, [x], torch.float32) == []
    off = x.clone()
    off[2] = torch.nextafter(off[2], torch.tensor(4.0))
    assert sum_rounding_misses(off, [x], torch.float32) == [2]
