"""Pure-torch reference compression functions, checked without any process group.

Covers :mod:`sparsecomm.compress`: exact top-k against a sort-based oracle, ``num_selected``,
the sampled-threshold selector (size bounds, subset of large entries, each of its three
branches, determinism, no use of the global RNG), random-k indices, the payload layout and
its pack / unpack round trip, and error feedback (``compensate`` and the bit-exact
conservation ``sent + residual == acc`` of ``select_and_pack``). Also the read-only part of
the dispatch point in :mod:`sparsecomm.ops`.

Every comparison is exact unless a comment says otherwise.
"""
import math

import pytest
import torch
from kernel_cases import FP16_SATURATION, check_conservation, check_fp16_saturation, fp16_saturation_grad

from sparsecomm import compress, ops
from sparsecomm.ops import reference
from sparsecomm.compress import (
    SELECTORS,
    compensate,
    num_selected,
    per_parameter,
    pack_into,
    payload_nbytes,
    random_indices,
    sampled_threshold_indices,
    select_and_pack,
    topk_indices,
    unpack_add,
)
from sparsecomm.compress import sampled_threshold
from sparsecomm.compress.chunk_layout import ChunkLayout
from sparsecomm.compress.error_feedback import residual_after_sending, to_wire_dtype
from sparsecomm.compress.packing import INDEX_DTYPE

VALUE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _distinct_magnitudes(n: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    """Random signs on a random permutation of 1..n: every magnitude differs (exact in fp32)."""
    g = _gen(seed)
    magnitudes = (torch.randperm(n, generator=g) + 1).to(torch.float64)
    signs = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    return (magnitudes * signs).to(dtype)


def _oracle_topk_set(acc: torch.Tensor, k: int) -> set[int]:
    """Indices of the k largest magnitudes, by a full descending sort."""
    order = torch.argsort(acc.abs(), descending=True, stable=True)
    return set(order[:k].tolist())


# ----- exact top-k ---------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 7, 1023])
def test_topk_indices_matches_sort_oracle(n):
    acc = _distinct_magnitudes(n, seed=n)
    for k in sorted({1, max(1, n // 3), max(1, n - 1), n}):
        indices = topk_indices(acc, k)
        assert indices.dtype == torch.int64
        assert indices.numel() == k
        assert set(indices.tolist()) == _oracle_topk_set(acc, k), (n, k)


def test_topk_indices_k_at_least_n_returns_everything():
    acc = _distinct_magnitudes(7)
    for k in (7, 8, 100):
        indices = topk_indices(acc, k)
        assert indices.dtype == torch.int64
        assert indices.tolist() == list(range(7))


def test_topk_indices_selects_by_magnitude_not_sign():
    acc = torch.tensor([0.5, -4.0, 3.0, -2.0, 1.0, -0.25, 0.0])
    assert set(topk_indices(acc, 1).tolist()) == {1}
    assert set(topk_indices(acc, 2).tolist()) == {1, 2}
    assert set(topk_indices(acc, 3).tolist()) == {1, 2, 3}
    all_negative = -_distinct_magnitudes(1023, seed=5).abs()
    assert set(topk_indices(all_negative, 10).tolist()) == _oracle_topk_set(all_negative, 10)


def test_topk_indices_treats_nan_as_largest_magnitude():
    # Documented policy: a NaN gradient is sent, not hidden in the residual.
    acc = torch.tensor([1.0, float("nan"), 3.0])
    assert topk_indices(acc, 1).tolist() == [1]
    assert set(topk_indices(acc, 2).tolist()) == {1, 2}


def test_topk_indices_ignores_generator_argument():
    acc = _distinct_magnitudes(1023, seed=3)
    assert torch.equal(topk_indices(acc, 17, _gen(0)), topk_indices(acc, 17, None))


# ----- num_selected --------------------------------------------------------------------


@pytest.mark.parametrize(
    "numel, density, expected",
    [
        (1000, 0.01, 10),  # exact product
        (1001, 0.01, 11),  # 10.01 rounds up
        (999, 0.01, 10),  # 9.99 rounds up
        (100, 0.001, 1),  # 0.1 rounds up to 1
        (10, 1e-9, 1),  # never fewer than 1
        (1, 0.5, 1),
        (10, 1.0, 10),  # all of it
        (10, 1.5, 10),  # never more than numel
        (3, 0.5, 2),
        (100, 0.07, 7),  # 0.07 * 100 == 7.000000000000001 in floating point: still 7
        (25_000_000, 0.07, 1_750_000),
    ],
)
def test_num_selected(numel, density, expected):
    assert num_selected(numel, density) == expected


# ----- sampled threshold ----------------------------------------------------------------

SAMPLED_N = 200_000
SAMPLED_K = 2_000


@pytest.fixture(scope="module")
def normal_acc():
    return torch.randn(SAMPLED_N, generator=_gen(1234))


def _num_samples(n: int) -> int:
    return min(n, max(sampled_threshold.MIN_SAMPLE, math.ceil(sampled_threshold.SAMPLE_FRACTION * n)))


def _sample_positions(n: int, seed: int) -> torch.Tensor:
    """The positions the selector will sample with a generator seeded ``seed`` (same stream)."""
    return torch.randint(n, (_num_samples(n),), generator=_gen(seed))


@pytest.mark.parametrize("seed", range(8))
def test_sampled_threshold_size_and_large_entries(normal_acc, seed):
    acc, k = normal_acc, SAMPLED_K
    indices = sampled_threshold_indices(acc, k, _gen(seed))
    assert indices.dtype == torch.int64
    assert (1 - sampled_threshold.UNDERSHOOT) * k <= indices.numel() <= k
    assert indices.unique().numel() == indices.numel()  # distinct
    assert 0 <= indices.min().item() and indices.max().item() < SAMPLED_N
    # Only a subset of large entries is guaranteed: the threshold is the 41st largest of
    # 4096 samples, which falls below the (3k)-th largest magnitude (the 97th percentile,
    # ~123 expected samples above it) with negligible probability; the seeds are fixed.
    third_k_largest = acc.abs().sort(descending=True).values[3 * k - 1]
    assert acc.abs()[indices].min() >= third_k_largest


def test_sampled_threshold_truncates_to_exactly_k_when_too_many_pass(normal_acc):
    # Zero every sampled position: the sample's threshold becomes 0, every entry passes,
    # so count = n > k and the selector keeps the k largest candidates, i.e. exact top-k.
    seed = 7
    acc = normal_acc.clone()
    acc[_sample_positions(SAMPLED_N, seed)] = 0.0
    indices = sampled_threshold_indices(acc, SAMPLED_K, _gen(seed))
    assert indices.numel() == SAMPLED_K
    assert set(indices.tolist()) == _oracle_topk_set(acc, SAMPLED_K)


def test_sampled_threshold_truncates_ties_to_exactly_k():
    # Constant magnitude: whatever the sample, all n entries pass the threshold.
    acc = torch.where(torch.rand(SAMPLED_N, generator=_gen(2)) < 0.5, -1.0, 1.0)
    indices = sampled_threshold_indices(acc, SAMPLED_K, _gen(3))
    assert indices.numel() == SAMPLED_K
    assert indices.unique().numel() == SAMPLED_K


def test_sampled_threshold_falls_back_to_exact_topk_when_sample_overshoots(normal_acc):
    # Put huge values exactly on the first 100 sampled positions: the threshold (41st
    # largest of the sample) is then >= 10, at most 100 entries pass (< 0.8k), and the
    # selector must fall back to the exact top-k.
    seed = 11
    acc = normal_acc.clone().clamp_(-5.0, 5.0)
    positions = _sample_positions(SAMPLED_N, seed)[:100]
    acc[positions] = 10.0 + torch.arange(100, dtype=acc.dtype)
    indices = sampled_threshold_indices(acc, SAMPLED_K, _gen(seed))
    assert indices.numel() == SAMPLED_K
    assert set(indices.tolist()) == _oracle_topk_set(acc, SAMPLED_K)


def test_sampled_threshold_small_inputs_are_exact():
    # n <= MIN_SAMPLE: the "sample" would be the whole tensor, so exact top-k is used.
    acc = _distinct_magnitudes(1023, seed=9)
    assert set(sampled_threshold_indices(acc, 50, _gen(0)).tolist()) == _oracle_topk_set(acc, 50)
    assert sampled_threshold_indices(acc, 1023, _gen(0)).tolist() == list(range(1023))
    assert sampled_threshold_indices(acc, 5000, _gen(0)).tolist() == list(range(1023))


def test_sampled_threshold_is_deterministic_per_generator_seed(normal_acc):
    a = sampled_threshold_indices(normal_acc, SAMPLED_K, _gen(5))
    b = sampled_threshold_indices(normal_acc, SAMPLED_K, _gen(5))
    assert torch.equal(a, b)


def test_sampled_threshold_does_not_touch_global_rng(normal_acc):
    before = torch.get_rng_state()
    sampled_threshold_indices(normal_acc, SAMPLED_K, _gen(5))
    assert torch.equal(torch.get_rng_state(), before)


def test_sampled_threshold_advances_the_given_generator(normal_acc):
    g = _gen(5)
    before = g.get_state()
    sampled_threshold_indices(normal_acc, SAMPLED_K, g)
    assert not torch.equal(g.get_state(), before)


# ----- random-k ---------------------------------------------------------------------------


def test_random_indices_distinct_and_in_range():
    indices = random_indices(1000, 37, seed=3, step=4, stream=1)
    assert indices.dtype == torch.int64
    assert indices.numel() == 37
    assert indices.unique().numel() == 37
    assert indices.min().item() >= 0 and indices.max().item() < 1000


def test_random_indices_reproducible_and_vary_with_each_argument():
    base = dict(seed=3, step=4, stream=1)
    reference = random_indices(1000, 37, **base)
    assert torch.equal(random_indices(1000, 37, **base), reference)
    for changed in (dict(step=5), dict(stream=2), dict(seed=4)):
        other = random_indices(1000, 37, **{**base, **changed})
        assert not torch.equal(other, reference), changed


def test_random_indices_k_at_least_numel_returns_everything():
    assert random_indices(7, 7, seed=0, step=0, stream=0).tolist() == list(range(7))
    assert random_indices(7, 9, seed=0, step=0, stream=0).tolist() == list(range(7))


def test_random_indices_does_not_touch_global_rng():
    before = torch.get_rng_state()
    random_indices(1000, 37, seed=3, step=4, stream=1)
    assert torch.equal(torch.get_rng_state(), before)


# ----- payload packing ----------------------------------------------------------------


@pytest.mark.parametrize(
    "k, value_dtype, expected",
    [
        # k * (4 + value bytes), padded up to a multiple of 8 so gathered payloads stay aligned
        (3, torch.float32, 24),
        (3, torch.bfloat16, 24),
        (5, torch.float16, 32),
        (1, torch.float64, 16),
        (0, torch.float32, 0),
    ],
)
def test_payload_nbytes(k, value_dtype, expected):
    assert payload_nbytes(k, value_dtype) == expected


@pytest.mark.parametrize("value_dtype", VALUE_DTYPES)
@pytest.mark.parametrize("k", [3, 5, 8])
def test_pack_unpack_round_trip(value_dtype, k):
    n = 23
    indices = torch.tensor([0, 22, 7, 11, 3, 19, 5, 14][:k])
    values = (torch.arange(1, k + 1, dtype=torch.float32) * torch.tensor([-1.5, 2.25] * 4)[:k]).to(value_dtype)
    payload = torch.full((payload_nbytes(k, value_dtype),), 0xAB, dtype=torch.uint8)
    pack_into(payload, indices, values, k)
    # Documented layout: k int32 indices, then k values.
    assert torch.equal(payload[: 4 * k].view(INDEX_DTYPE), indices.to(INDEX_DTYPE))
    assert torch.equal(payload[4 * k : 4 * k + k * value_dtype.itemsize].view(value_dtype), values)
    assert not payload[4 * k + k * value_dtype.itemsize :].any()  # alignment padding is zero
    out = torch.full((n,), 99.0, dtype=value_dtype)  # overwritten, not added to
    result = unpack_add(payload.view(1, -1), out, k, value_dtype)
    assert result is out
    expected = torch.zeros(n, dtype=value_dtype)
    expected[indices] = values
    assert torch.equal(out, expected)


@pytest.mark.parametrize("value_dtype", VALUE_DTYPES)
def test_pack_pads_short_selection_with_zeros(value_dtype):
    k, m, n = 5, 2, 9
    indices = torch.tensor([4, 8])
    values = torch.tensor([3.0, -7.0], dtype=value_dtype)
    payload = torch.full((payload_nbytes(k, value_dtype),), 0xFF, dtype=torch.uint8)
    pack_into(payload, indices, values, k)
    index_view = payload[: 4 * k].view(INDEX_DTYPE)
    value_view = payload[4 * k : 4 * k + k * value_dtype.itemsize].view(value_dtype)
    assert index_view[m:].tolist() == [0] * (k - m)
    assert value_view[m:].tolist() == [0.0] * (k - m)
    out = unpack_add(payload, torch.full((n,), 5.0, dtype=value_dtype), k, value_dtype)
    expected = torch.zeros(n, dtype=value_dtype)
    expected[indices] = values
    assert torch.equal(out, expected)  # the padding added nothing, even at index 0


@pytest.mark.parametrize("value_dtype, k", [(torch.float32, 3), (torch.float32, 4), (torch.float16, 4), (torch.bfloat16, 2)])
def test_unpack_add_sums_payloads_sharing_an_index(value_dtype, k):
    n = 6
    nbytes = payload_nbytes(k, value_dtype)
    gathered = torch.empty(2 * nbytes, dtype=torch.uint8)
    idx0 = torch.tensor([1, 4, 0, 5][:k])
    idx1 = torch.tensor([4, 2, 5, 3][:k])
    val0 = torch.tensor([1.5, 2.0, -3.0, 0.25][:k], dtype=value_dtype)
    val1 = torch.tensor([0.5, -1.0, 4.0, 8.0][:k], dtype=value_dtype)
    pack_into(gathered[:nbytes], idx0, val0, k)
    pack_into(gathered[nbytes:], idx1, val1, k)
    out = unpack_add(gathered.view(2, nbytes), torch.empty(n, dtype=torch.float32), k, value_dtype)
    expected = torch.zeros(n, dtype=torch.float32)
    expected.index_add_(0, idx0, val0.float())
    expected.index_add_(0, idx1, val1.float())
    assert torch.equal(out, expected)
    assert out[4].item() == 2.5  # index 4 is in both payloads: 2.0 + 0.5


@pytest.mark.parametrize("value_dtype", [torch.float16, torch.bfloat16])
def test_unpack_add_of_several_payloads_with_odd_k_and_2_byte_values(value_dtype):
    # Regression: 3 * (4 + 2) = 18 bytes per payload put rank 1's int32 indices at byte 18,
    # which cannot be viewed as int32; payloads are now padded to a multiple of 8 bytes.
    k, n, world_size = 3, 10, 3
    nbytes = payload_nbytes(k, value_dtype)
    gathered = torch.empty(world_size * nbytes, dtype=torch.uint8)
    expected = torch.zeros(n)
    for rank in range(world_size):
        indices = torch.tensor([rank, rank + 3, 9])
        values = torch.tensor([1.0, 2.0, 0.5], dtype=value_dtype) * (rank + 1)
        pack_into(gathered[rank * nbytes : (rank + 1) * nbytes], indices, values, k)
        expected.index_add_(0, indices, values.float())
    out = unpack_add(gathered.view(world_size, nbytes), torch.empty(n), k, value_dtype)
    assert torch.equal(out, expected)


def test_unpack_add_casts_values_to_out_dtype():
    k = 3
    payload = torch.empty(payload_nbytes(k, torch.bfloat16), dtype=torch.uint8)
    values = torch.tensor([1.0, -2.5, 0.375], dtype=torch.bfloat16)
    pack_into(payload, torch.tensor([2, 0, 1]), values, k)
    out = unpack_add(payload, torch.empty(3, dtype=torch.float32), k, torch.bfloat16)
    assert out.dtype == torch.float32
    assert out.tolist() == [-2.5, 0.375, 1.0]


# ----- error feedback -------------------------------------------------------------------


def test_compensate_divides_then_adds_in_place():
    grad = torch.tensor([3.0, -6.0, 1.0, 0.0])
    residual = torch.tensor([0.5, 0.25, -1.0, 2.0])
    expected = grad / 3 + residual
    result = compensate(grad, residual, 3)
    assert result is grad
    assert torch.equal(grad, expected)


def test_compensate_without_residual_only_divides():
    grad = torch.tensor([3.0, -6.0, 1.0])
    expected = grad / 4
    assert torch.equal(compensate(grad, None, 4), expected)


def test_compensate_divides_before_adding_fp16():
    # In fp16 (max 65504) grad + residual would overflow to inf before the division;
    # dividing first keeps 60000/2 + 30000 = 60000 finite.
    grad = torch.tensor([60000.0], dtype=torch.float16)
    residual = torch.tensor([30000.0], dtype=torch.float16)
    assert compensate(grad, residual, 2).item() == 60000.0


# (acc dtype, value dtype): equal and narrower value dtypes.
EF_DTYPES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16),
]


def _acc(n: int, dtype, seed: int) -> torch.Tensor:
    # Spread over several decades, down into fp16's subnormal range (< 6.1e-5), so that
    # narrowing casts really round; all values stay far below fp16's max (65504).
    g = _gen(seed)
    scale = 10.0 ** torch.randint(-6, 2, (n,), generator=g).double()
    return (torch.randn(n, generator=g, dtype=torch.float64) * scale).to(dtype)


@pytest.mark.parametrize("selector", ["exact", "sampled"])
@pytest.mark.parametrize("acc_dtype, value_dtype", EF_DTYPES)
def test_select_and_pack_conserves_bit_for_bit(acc_dtype, value_dtype, selector):
    n, k = 5003, 251  # n > MIN_SAMPLE so "sampled" really samples; both odd
    acc = _acc(n, acc_dtype, seed=42)
    acc_before = acc.clone()
    payload = torch.empty(payload_nbytes(k, value_dtype), dtype=torch.uint8)
    residual = torch.full_like(acc, float("nan"))  # every entry must be overwritten
    indices = select_and_pack(acc, k, SELECTORS[selector], payload, value_dtype, residual_out=residual, generator=_gen(0))
    assert torch.equal(acc, acc_before)  # acc is read, not modified
    assert indices.numel() <= k and indices.unique().numel() == indices.numel()
    if selector == "exact":
        assert set(indices.tolist()) == _oracle_topk_set(acc, k)
    sent = unpack_add(payload, torch.empty_like(acc), k, value_dtype)
    assert torch.equal(sent + residual, acc)
    # Unselected entries stay entirely in the residual.
    unselected = torch.ones(n, dtype=torch.bool)
    unselected[indices] = False
    assert torch.equal(residual[unselected], acc[unselected])
    assert torch.equal(sent[unselected], torch.zeros_like(sent[unselected]))
    if acc_dtype == value_dtype:
        assert torch.equal(residual[indices], torch.zeros_like(residual[indices]))
    else:
        # The narrowing cast must actually have rounded something, or the check is vacuous.
        assert (residual[indices] != 0).any()


@pytest.mark.parametrize("acc_dtype, value_dtype", EF_DTYPES)
def test_select_and_pack_without_residual(acc_dtype, value_dtype):
    n, k = 1023, 31
    acc = _acc(n, acc_dtype, seed=7)
    acc_before = acc.clone()
    with_residual = torch.empty(payload_nbytes(k, value_dtype), dtype=torch.uint8)
    without_residual = torch.empty_like(with_residual)
    select_and_pack(acc, k, topk_indices, with_residual, value_dtype, residual_out=torch.empty_like(acc))
    indices = select_and_pack(acc, k, topk_indices, without_residual, value_dtype)
    assert torch.equal(acc, acc_before)  # nothing written back into acc
    assert torch.equal(without_residual, with_residual)  # same payload either way
    sent = unpack_add(without_residual, torch.empty_like(acc), k, value_dtype)
    expected = torch.zeros_like(acc)
    expected[indices] = acc[indices].to(value_dtype).to(acc_dtype)
    assert torch.equal(sent, expected)


def test_select_and_pack_sends_nan():
    acc = torch.tensor([1.0, float("nan"), 3.0, -0.5])
    payload = torch.empty(payload_nbytes(1, torch.float32), dtype=torch.uint8)
    indices = select_and_pack(acc, 1, topk_indices, payload, torch.float32)
    assert indices.tolist() == [1]
    sent = unpack_add(payload, torch.empty_like(acc), 1, torch.float32)
    assert math.isnan(sent[1].item())


@pytest.mark.parametrize("acc_dtype, value_dtype", EF_DTYPES)
def test_select_and_pack_non_finite_acc_leaves_zero_residual(acc_dtype, value_dtype):
    # Hand-worked: Inf/NaN are sent unchanged, and leave +0 in the residual whether sent or
    # not (Inf - Inf = NaN kept there would be selected and sent again on every later step).
    inf, nan = float("inf"), float("nan")

    def run(acc, k, selector):
        acc = torch.tensor(acc, dtype=acc_dtype)
        payload = torch.empty(payload_nbytes(k, value_dtype), dtype=torch.uint8)
        residual = torch.full_like(acc, 7.0)
        indices = select_and_pack(acc, k, selector, payload, value_dtype, residual_out=residual, generator=_gen(0))
        sent = unpack_add(payload, torch.empty_like(acc), k, value_dtype)
        return sorted(indices.tolist()), sent, residual.float().view(torch.int32).tolist()  # bits: -0.0 != +0.0

    def bits(values):
        return torch.tensor(values).view(torch.int32).tolist()

    indices, sent, residual = run([inf, 1.0], 1, topk_indices)
    assert indices == [0] and sent[0].item() == inf and residual == bits([0.0, 1.0])
    indices, sent, residual = run([nan, -inf, 2.0, 3.0], 1, topk_indices)  # -Inf is not sent
    assert indices == [0] and math.isnan(sent[0].item()) and residual == bits([0.0, 0.0, 2.0, 3.0])
    # A selector that ignores magnitudes (random-k, sampled): non-finite entries it does not
    # pick leave +0 all the same.
    indices, sent, residual = run([nan, inf, 2.0, 3.0], 1, lambda acc, k, generator: torch.tensor([2]))
    assert indices == [2] and sent.tolist() == [0.0, 0.0, 2.0, 0.0] and residual == bits([0.0, 0.0, 0.0, 3.0])
    indices, sent, residual = run([nan] * 5, 2, SELECTORS["sampled"])
    assert len(indices) <= 2 and residual == bits([0.0] * 5)


# ----- dispatch (read-only) -------------------------------------------------------------


def test_dispatch_uses_reference_without_registered_kernel():
    # No kernel is ever registered for this made-up device type.
    assert ops.implementation("select_and_pack", "no_such_device") is compress.select_and_pack
    assert ops.implementation("ef_topk_pack", "no_such_device") is reference.ef_topk_pack
    assert ops.implementation("unpack_add", "no_such_device") is reference.unpack_add


def test_dispatch_rejects_unknown_op():
    with pytest.raises(ValueError, match="op must be one of"):
        ops.register_kernel("topk", "cpu", lambda *a: None)


def test_narrow_wire_dtype_saturates_and_keeps_the_excess_in_the_residual():
    # 1e5 does not fit in fp16 (max 65504): it is sent as 65504 and 34496 stays behind, so
    # conservation still holds exactly; Inf is not a range problem and propagates as Inf.
    acc = torch.tensor([1e5, 1.0, -2.0, -7e4])
    payload = torch.empty(payload_nbytes(2, torch.float16), dtype=torch.uint8)
    residual = torch.empty_like(acc)
    select_and_pack(acc, 2, topk_indices, payload, torch.float16, residual_out=residual)
    sent = unpack_add(payload, torch.empty_like(acc), 2, torch.float16)
    assert sent.tolist() == [65504.0, 0.0, 0.0, -65504.0]
    assert torch.equal(sent + residual, acc)
    inf_acc = torch.tensor([float("inf"), 1.0])
    select_and_pack(inf_acc, 1, topk_indices, payload, torch.float16, residual_out=residual[:2])
    assert unpack_add(payload, torch.empty(2), 1, torch.float16)[0].item() == float("inf")
    assert residual[:2].tolist() == [0.0, 1.0]  # not Inf - Inf = NaN


@pytest.mark.parametrize("dtype", list(FP16_SATURATION), ids=str)
def test_fp16_saturation_conserves_every_finite_acc(dtype):
    """Values beyond 65504 go out as 65504 rounded down to a multiple of acc's ulp (0 from
    float32 2^39 or bfloat16 2^23 on), so acc - sent is exact: the hand-worked values of
    kernel_cases.FP16_SATURATION, on the fp16 value_dtype and the fp16 value codec (chunked
    selection, and exact top-k on the compact wire)."""
    acc, k = fp16_saturation_grad(dtype)
    payload = torch.empty(payload_nbytes(k, torch.float16), dtype=torch.uint8)
    residual = torch.empty_like(acc)
    indices = select_and_pack(acc, k, topk_indices, payload, torch.float16, residual_out=residual)
    check_fp16_saturation(acc, indices, payload[k * 4 : k * 6].view(torch.float16), residual)
    for layout in (ChunkLayout(acc.numel(), acc.numel(), k / acc.numel(), "int32", "fp16"),
                   ChunkLayout(acc.numel(), acc.numel(), k / acc.numel(), "rice", "fp16", scale_group=64)):
        assert layout.capacity == k
        residual = torch.empty_like(acc)
        indices, decoded = layout.encode(acc, residual, torch.empty(layout.nbytes, dtype=torch.uint8))
        check_fp16_saturation(acc, indices, decoded, residual)


def _finite_bit_patterns(dtype: torch.dtype, per_exponent: int = 16) -> torch.Tensor:
    """``per_exponent`` random mantissas (and both signs) in every binade of ``dtype``,
    subnormals included: every finite magnitude range the wire can meet."""
    info = torch.finfo(dtype)
    mantissa_bits, width = -int(math.log2(info.eps)), info.bits
    exponents = torch.arange(2 ** (width - 1 - mantissa_bits) - 1).repeat_interleave(per_exponent)
    mantissas = torch.randint(0, 2**mantissa_bits, exponents.shape, generator=_gen(width))
    signs = torch.randint(0, 2, exponents.shape, generator=_gen(width + 1))
    bits = (signs << (width - 1)) | (exponents << mantissa_bits) | mantissas
    as_int = {32: torch.int32, 16: torch.int16}[width]
    return bits.to(as_int).view(dtype)  # int64 -> narrower int keeps the low bits


@pytest.mark.parametrize("acc_dtype,wire_dtype", [(torch.float32, torch.float16), (torch.float32, torch.bfloat16),
                                                  (torch.bfloat16, torch.float16)], ids=str)
def test_narrow_wires_conserve_acc_in_every_binade(acc_dtype, wire_dtype):
    """sent + residual == acc, in exact rational arithmetic, for acc in every binade of its
    dtype. bfloat16 needs no special care (docs/precision.md): it has float32's exponent
    range, so bf16(acc) differs from a float32 acc by at most half a bfloat16 ulp, 2^15 float32
    ulps of acc, and saturation at its largest value leaves less than 2^16 float32 ulps."""
    acc = _finite_bit_patterns(acc_dtype)
    assert bool(torch.isfinite(acc).all())
    indices = torch.arange(acc.numel())
    values = to_wire_dtype(acc, wire_dtype)
    residual = torch.empty_like(acc)
    residual_after_sending(residual, acc, indices, values)
    limit = torch.finfo(wire_dtype).max
    for a, v in zip(acc.tolist(), values.float().tolist()):
        assert abs(v) <= limit and (v == 0 or (v > 0) == (a > 0)), (a, v)
    check_conservation(acc, values, residual)


def test_per_parameter_selection_takes_k_inside_each_slice():
    # Slices of sizes 4 and 6; the big values all sit in the second slice, yet the first
    # still sends its own top-1: per-parameter k is what makes selection layout-independent.
    acc = torch.tensor([0.1, -0.4, 0.2, 0.3, 9.0, -8.0, 7.0, 1.0, 2.0, -3.0])
    select = per_parameter(topk_indices, (1, 2), (4, 6))
    assert sorted(select(acc, 3).tolist()) == [1, 4, 5]
