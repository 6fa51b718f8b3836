"""Native CPU kernels (sparsecomm._C) against their pure-torch reference twins.

The reference (sparsecomm/ops/reference.py) is the oracle: the selected set, the wire
values and the updated residual must match bit for bit (payload order is unspecified,
so payloads are compared sorted by index). Sent values may be NaN (any NaN matches any
NaN); residuals never may: a non-finite acc leaves +0 (csrc/README.md), which hand-worked
cases check for the reference itself. The fallback path (no extension) is tested by
making the loader fail.
"""
import warnings

import pytest
import torch

from kernel_cases import (FP16_SATURATION, check_fp16_saturation, check_non_finite_rule, fp16_saturation_grad,
                          threshold_non_finite_cases, topk_non_finite_cases, with_non_finite)
from sparsecomm import ops
from sparsecomm.compress.packing import payload_nbytes
from sparsecomm.ops import dispatch, native, reference

LOADED, WHY_NOT = native.load()
needs_native = pytest.mark.skipif(not LOADED, reason=f"native extension not built: {WHY_NOT}")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SIZES = (1, 7, 1000, 2**16 + 3)


def _inputs(n, dtype, seed, *, ties=False, non_finite=False):
    generator = torch.Generator().manual_seed(seed)
    grad = torch.randn(n, generator=generator)
    residual = torch.randn(n, generator=generator) * 0.1
    if ties:  # few distinct magnitudes, both signs: many equal keys around the k-th
        grad = torch.randint(-3, 4, (n,), generator=generator).float()
        residual = torch.zeros(n)
    if non_finite and n >= 7:
        grad[[1, n // 2, n - 2]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    return grad.to(dtype), residual.to(dtype)


def _run_pack(impl, grad, residual, divisor, add_residual, k, value_dtype, offset):
    residual = None if residual is None else residual.clone()
    indices = torch.full((k,), -1, dtype=torch.int32)
    values = torch.empty(k, dtype=value_dtype)
    impl(grad, residual, divisor, add_residual, k, indices, values, offset)
    order = torch.argsort(indices.long())
    return indices[order], values[order], residual


def _assert_same(expected, actual):
    for name, e, a in zip(("indices", "values", "residual"), expected, actual):
        if e is None:
            assert a is None
            continue
        if e.dtype == torch.int32:
            assert torch.equal(e, a), name
            continue
        if name == "residual":  # never NaN (a non-finite acc leaves +0): every byte equal
            assert not bool(torch.isnan(a).any()) and not bool(torch.isnan(e).any()), "NaN in a residual"
            assert torch.equal(e.view(torch.uint8), a.view(torch.uint8)), name
            continue
        # Sent values: NaN at the same places (their payload bits are not specified); all
        # else bitwise, so -0.0 != 0.0.
        nan = torch.isnan(e)
        assert torch.equal(nan, torch.isnan(a)), name
        assert torch.equal(e[~nan].view(torch.uint8), a[~nan].view(torch.uint8)), name


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value_dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_ef_topk_pack_matches_reference(dtype, value_dtype, n):
    grad, residual = _inputs(n, dtype, seed=n)
    for k in sorted({1, max(1, n // 100), n}):
        for divisor, add_residual, with_residual in ((3.0, True, True), (2.0, False, True), (1.0, False, False)):
            args = (grad, residual if with_residual else None, divisor, add_residual, k, value_dtype, 5)
            _assert_same(_run_pack(reference.ef_topk_pack, *args), _run_pack(native.ef_topk_pack, *args))


@needs_native
@pytest.mark.parametrize("n", (1000, 2**24 + 1))
def test_ef_topk_pack_large_and_ties_and_non_finite(n):
    for ties, non_finite in ((False, True), (True, False)):
        grad, residual = _inputs(n, torch.float32, seed=1, ties=ties, non_finite=non_finite)
        for k in (1, max(1, n // 100)):
            args = (grad, residual, 2.0, True, k, torch.float32, 0)
            expected = _run_pack(reference.ef_topk_pack, *args)
            _assert_same(expected, _run_pack(native.ef_topk_pack, *args))
            if non_finite and k >= 3:  # NaN and +-Inf are sent first, never kept back
                assert {1, n // 2, n - 2} <= set(expected[0].tolist())


@needs_native
@pytest.mark.parametrize("with_residual", (True, False))
def test_sampled_bound_that_fails_falls_back_to_the_exact_passes(with_residual):
    # Buckets of >= 2^20 entries first guess a key bound from 65,536 strided samples
    # (positions j * n // 65536). Put large values exactly there: the guess claims far more
    # large entries than exist (fewer than k reach the bound), so the kernel must fall back.
    n, samples = 2**23 + 5, 2**16
    grad, residual = _inputs(n, torch.float32, seed=7)
    grad[torch.arange(samples) * n // samples] = 100.0
    k = n // 100  # > samples: the large values alone cannot fill the payload
    args = (grad, residual if with_residual else None, 2.0, with_residual, k, torch.float32, 0)
    _assert_same(_run_pack(reference.ef_topk_pack, *args), _run_pack(native.ef_topk_pack, *args))


# ----- non-finite acc: sent first and unchanged, +0 in the residual -------------------------

IMPLS = [pytest.param(reference, id="reference"), pytest.param(native, id="native", marks=needs_native)]
PAIRS = [(g, v) for g in DTYPES for v in DTYPES]
INF, NAN = float("inf"), float("nan")


def _threshold_run(impl, grad, residual, divisor, add_residual, threshold, capacity, value_dtype, offset):
    residual = None if residual is None else residual.clone()
    indices = torch.full((capacity,), -1, dtype=torch.int32)
    values = torch.full((capacity,), 7.0, dtype=value_dtype)
    count = int(impl.ef_threshold_pack(grad, residual, divisor, add_residual, threshold, indices, values, offset))
    return count, indices, values, residual


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype,value_dtype", PAIRS, ids=str)
def test_non_finite_acc_hand_worked(impl, dtype, value_dtype):
    """The oracle checked by hand (every value here is exact in every dtype)."""
    def topk(acc, k):
        indices, values, residual = _run_pack(impl.ef_topk_pack, torch.tensor(acc, dtype=dtype),
                                              torch.zeros(len(acc), dtype=dtype), 1.0, True, k, value_dtype, 0)
        return indices.tolist(), values.float().tolist(), residual

    def bits(residual):  # +0.0 and -0.0 differ here
        return residual.float().view(torch.int32).tolist()

    def plus(values):
        return torch.tensor(values).view(torch.int32).tolist()

    indices, values, residual = topk([INF, 1.0], 1)  # Inf - Inf would leave NaN behind
    assert indices == [0] and values == [INF] and bits(residual) == plus([0.0, 1.0])
    indices, values, residual = topk([NAN, -INF, 2.0, 3.0], 1)  # -Inf not sent: +0 all the same
    assert indices == [0] and values[0] != values[0] and bits(residual) == plus([0.0, 0.0, 2.0, 3.0])
    indices, values, residual = topk([2.0, -INF, 3.0, INF], 3)  # both Inf sent, then the largest finite
    assert indices == [1, 2, 3] and values == [-INF, 3.0, INF] and bits(residual) == plus([2.0, 0.0, 0.0, 0.0])
    indices, values, residual = topk([NAN] * 4, 2)  # all-NaN bucket: the lowest indices, nothing kept
    assert indices == [0, 1] and bits(residual) == plus([0.0] * 4)

    def threshold(acc, bar, capacity):
        count, indices, values, residual = _threshold_run(impl, torch.tensor(acc, dtype=dtype),
                                                          torch.zeros(len(acc), dtype=dtype), 1.0, True, bar,
                                                          capacity, value_dtype, 0)
        return count, indices.tolist(), values.float().tolist(), residual

    # Capacity 2: Inf and 5 are sent (lowest indices); NaN and -Inf do not fit, 0.5 is below.
    count, indices, values, residual = threshold([INF, 5.0, NAN, -INF, 0.5], 1.0, 2)
    assert count == 2 and indices == [0, 1] and values == [INF, 5.0]
    assert bits(residual) == plus([0.0, 0.0, 0.0, 0.0, 0.5])
    # A NaN threshold selects only NaN: the Inf is not selected and still leaves +0.
    count, indices, values, residual = threshold([INF, NAN, 2.0], NAN, 2)
    assert count == 1 and indices == [1, 0] and values[0] != values[0] and values[1] == 0.0
    assert bits(residual) == plus([0.0, 0.0, 2.0])
    count, indices, _, residual = threshold([NAN, 1.0, -INF], 0.5, 0)  # nothing sent at capacity 0
    assert count == 0 and bits(residual) == plus([0.0, 1.0, 0.0])


@needs_native
def test_cleanup_keeps_the_remainder_of_a_sent_finite_acc():
    """fp16 grad with bf16 values (refused by the hook, allowed by the op): 65504 goes out as
    bf16 65536, which is Inf in fp16, so its remainder is -Inf although acc is finite. The
    pass that zeroes the unsent NaNs (beyond the capacity) must leave that remainder alone."""
    grad = torch.tensor([65504.0, NAN, 1.0, NAN], dtype=torch.float16)
    results = [_threshold_run(impl, grad, torch.zeros(4, dtype=torch.float16), 1.0, True, 0.5, 1, torch.bfloat16, 0)
               for impl in (reference, native)]
    for count, indices, values, residual in results:
        assert count == 1 and indices.tolist() == [0] and values.float().tolist() == [65536.0]
        assert residual.float().tolist() == [-INF, 0.0, 1.0, 0.0]
    assert torch.equal(results[0][3].view(torch.uint8), results[1][3].view(torch.uint8))


# 10,007 entries take the two-pass strategy of ef_topk_pack; 2^20 + 3 at density < 4% the
# sampled one-pass strategy (an all-NaN bucket overflows its slabs and falls back to the
# two passes from the residual). fp32 -> fp32 runs the AVX-512 paths where built with them.
# Every pair runs at 10,007; at 2^20 + 3 the pairs that take every branch of the one-pass
# code (csrc/cpu/sampled_candidates.h: fp32 -> fp32 vector loops, the scalar loop for
# the others) with every grad dtype and every wire dtype, narrower wires among them. The
# per-pair conversions (compensate, to_wire, sent_remainder) are the same functions in
# both strategies.
LARGE_PAIRS = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16),
               (torch.float16, torch.float32)]


def _non_finite_params(small, large):
    return [pytest.param(dtype, value_dtype, n, id=f"{dtype}-{value_dtype}-{name}")
            for n, name, pairs in ((10_007, small, PAIRS), (2**20 + 3, large, LARGE_PAIRS))
            for dtype, value_dtype in pairs]


@needs_native
@pytest.mark.parametrize("dtype,value_dtype,n", _non_finite_params("two-pass", "sampled"))
def test_ef_topk_pack_non_finite_acc_leaves_zero_residual(dtype, value_dtype, n):
    for name, count, k in topk_non_finite_cases(n):
        grad = with_non_finite(n, dtype, count, seed=count)
        residual = (torch.randn(n, generator=torch.Generator().manual_seed(1)) * 0.1).to(dtype)
        args = (grad, residual, 3.0, True, k, value_dtype, 5)
        expected = _run_pack(reference.ef_topk_pack, *args)
        actual = _run_pack(native.ef_topk_pack, *args)
        _assert_same(expected, actual)
        acc = reference.compensated(grad, residual, 3.0, True)
        check_non_finite_rule(acc, actual[0].long() - 5, actual[1], actual[2])
        sent_non_finite = int((~torch.isfinite(acc[actual[0].long() - 5])).sum())
        assert sent_non_finite == min(k, int((~torch.isfinite(acc)).sum())), name  # selected first


@needs_native
@pytest.mark.parametrize("dtype,value_dtype,n", _non_finite_params("small", "large"))
def test_ef_threshold_pack_non_finite_acc_leaves_zero_residual(dtype, value_dtype, n):
    for name, count, threshold, capacity in threshold_non_finite_cases(n):
        grad = with_non_finite(n, dtype, count, seed=count)
        residual = (torch.randn(n, generator=torch.Generator().manual_seed(1)) * 0.1).to(dtype)
        args = (grad, residual, 3.0, True, threshold, capacity, value_dtype, 5)
        (count_ref, *expected), (count_native, *actual) = (_threshold_run(reference, *args),
                                                           _threshold_run(native, *args))
        assert count_native == count_ref, name
        _assert_same(expected, actual)  # lowest indices first, so the order is defined here
        acc = reference.compensated(grad, residual, 3.0, True)
        check_non_finite_rule(acc, actual[0][:count_native].long() - 5, actual[1][:count_native], actual[2])


@needs_native
def test_ef_topk_pack_conserves_and_breaks_ties_by_lower_index():
    grad = torch.tensor([1.0, -2.0, 2.0, 0.5, -2.0, 2.0])
    residual = torch.zeros(6)
    indices, values, new_residual = _run_pack(native.ef_topk_pack, grad, residual, 1.0, True, 3, torch.float16, 0)
    assert indices.tolist() == [1, 2, 4]  # four entries of magnitude 2: the lowest three indices
    sent = torch.zeros(6)
    sent[indices.long()] = values.float()
    assert torch.equal(sent + new_residual, grad)


@needs_native
def test_results_do_not_depend_on_the_thread_count():
    grad, residual = _inputs(3_000_001, torch.float32, seed=2)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            residual_copy = residual.clone()
            indices = torch.empty(30_000, dtype=torch.int32)
            values = torch.empty(30_000)
            native.ef_topk_pack(grad, residual_copy, 2.0, True, 30_000, indices, values, 0)
            results.append((indices, values, residual_copy))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:  # same bytes, same order
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_ef_threshold_pack_matches_reference_with_and_without_overflow(dtype):
    grad, residual = _inputs(10_007, dtype, seed=3, non_finite=True)
    for threshold, capacity in ((1.5, 4000), (1.5, 100), (0.0, 10_007), (float("inf"), 10)):
        outputs = []
        for impl in (reference.ef_threshold_pack, native.ef_threshold_pack):
            r = residual.clone()
            indices = torch.empty(capacity, dtype=torch.int32)
            values = torch.empty(capacity, dtype=torch.bfloat16)
            count = impl(grad, r, 3.0, True, threshold, indices, values, 7)
            outputs.append((int(count), indices, values, r))
        (count_ref, *ref), (count, *got) = outputs
        assert count == count_ref
        _assert_same(ref, got)  # lowest indices first, so the order is defined here


@needs_native
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("value_dtype", (torch.float32, torch.float16))
def test_unpack_add_matches_index_add_in_rank_order(out_dtype, value_dtype):
    k, n, world_size = 300, 1000, 3
    gathered = torch.zeros(world_size * payload_nbytes(k, value_dtype), dtype=torch.uint8)
    indices, values = ops.payload_views(gathered, k, value_dtype)  # strided rows
    generator = torch.Generator().manual_seed(5)
    for rank in range(world_size):  # overlapping index sets across ranks
        indices[rank] = torch.randperm(n, generator=generator)[:k].int()
        values[rank] = (torch.randn(k, generator=generator) * 100).to(value_dtype)
    expected, actual = torch.full((n,), 7.0, dtype=out_dtype), torch.full((n,), 7.0, dtype=out_dtype)
    reference.unpack_add(indices, values, expected, True)
    native.unpack_add(indices, values, actual, True)
    assert torch.equal(expected.view(torch.uint8), actual.view(torch.uint8))
    reference.unpack_add(indices, values, expected, False)  # accumulate onto existing values
    native.unpack_add(indices, values, actual, False)
    assert torch.equal(expected.view(torch.uint8), actual.view(torch.uint8))


@needs_native
def test_unpack_add_rejects_indices_outside_the_bucket():
    indices = torch.tensor([[0, 5, 10]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="1 indices outside \\[0, 10\\)"):
        native.unpack_add(indices, torch.ones(1, 3), torch.zeros(10), True)


@needs_native
@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: native.ef_topk_pack(torch.ones(5), None, 1.0, False, 6, torch.empty(6, dtype=torch.int32),
                                     torch.empty(6), 0), "k must be in \\[1, 5\\], got 6"),
        (lambda: native.ef_topk_pack(torch.ones(5), None, 1.0, False, 2, torch.empty(2), torch.empty(2), 0),
         "indices_out must be a contiguous 1-D int32 tensor"),
        (lambda: native.ef_topk_pack(torch.ones(5), None, 1.0, True, 2, torch.empty(2, dtype=torch.int32),
                                     torch.empty(2), 0), "add_residual=True needs a residual"),
        (lambda: native.ef_topk_pack(torch.ones(5, dtype=torch.float64), None, 1.0, False, 2,
                                     torch.empty(2, dtype=torch.int32), torch.empty(2), 0),
         "dtype must be float32, bfloat16 or float16"),
        (lambda: native.ef_topk_pack(torch.ones(5), torch.ones(4), 1.0, True, 2, torch.empty(2, dtype=torch.int32),
                                     torch.empty(2), 0), "residual must be a contiguous 1-D tensor matching grad"),
    ],
)
def test_bad_arguments_are_rejected_with_the_accepted_range(call, message):
    with pytest.raises(RuntimeError, match=message):
        call()


@needs_native
def test_residual_aliasing_grad_is_rejected():
    grad = torch.ones(5)
    with pytest.raises(RuntimeError, match="residual may not alias grad"):
        native.ef_topk_pack(grad, grad, 1.0, True, 2, torch.empty(2, dtype=torch.int32), torch.empty(2), 0)


@needs_native
def test_opcheck():
    from torch.library import opcheck

    grad, residual = _inputs(1000, torch.float32, seed=6)
    opcheck(torch.ops.sparsecomm.ef_topk_pack.default,
            (grad, residual.clone(), 2.0, True, 10, torch.empty(10, dtype=torch.int32), torch.empty(10), 0))
    opcheck(torch.ops.sparsecomm.ef_threshold_pack.default,
            (grad, residual.clone(), 2.0, True, 1.0, torch.empty(400, dtype=torch.int32), torch.empty(400), 0))
    opcheck(torch.ops.sparsecomm.unpack_add.default,
            (torch.randint(0, 1000, (2, 10), dtype=torch.int32).unique(dim=1)[:, :5].contiguous(),
             torch.ones(2, 5), torch.zeros(1000), True))


# ----- dispatch and the fallback path ------------------------------------------------------


@needs_native
def test_dispatch_picks_the_native_kernel_on_cpu(monkeypatch):
    monkeypatch.delenv(native.KERNELS_ENV, raising=False)
    assert ops.implementation("ef_topk_pack", "cpu") is native.ef_topk_pack
    assert ops.implementation("unpack_add", "cpu") is native.unpack_add


def test_missing_extension_warns_once_with_the_reason_and_uses_the_reference(monkeypatch):
    monkeypatch.delenv(native.KERNELS_ENV, raising=False)
    monkeypatch.setattr(native, "load", lambda: (False, "sparsecomm._C could not be imported (test)"))
    native.warn_unavailable.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ops.implementation("ef_topk_pack", "cpu") is reference.ef_topk_pack
        assert ops.implementation("unpack_add", "cpu") is reference.unpack_add
    native.warn_unavailable.cache_clear()
    relevant = [w for w in caught if issubclass(w.category, native.NativeKernelsUnavailableWarning)]
    assert len(relevant) == 1
    assert "could not be imported (test)" in str(relevant[0].message)


def test_reference_can_be_forced_without_a_warning(monkeypatch):
    monkeypatch.setenv(native.KERNELS_ENV, "reference")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ops.implementation("ef_topk_pack", "cpu") is reference.ef_topk_pack


def test_requiring_native_kernels_fails_clearly_when_missing(monkeypatch):
    monkeypatch.setenv(native.KERNELS_ENV, "native")
    monkeypatch.setattr(native, "load", lambda: (False, "sparsecomm._C could not be imported (test)"))
    with pytest.raises(RuntimeError, match="SPARSECOMM_KERNELS=native.*could not be imported"):
        ops.implementation("ef_topk_pack", "cpu")


def test_unknown_kernel_choice_is_rejected(monkeypatch):
    monkeypatch.setenv(native.KERNELS_ENV, "fastest")
    with pytest.raises(ValueError, match="SPARSECOMM_KERNELS must be one of"):
        ops.implementation("ef_topk_pack", "cpu")


def test_registered_kernel_wins_and_can_be_removed():
    def marker(*args):
        return None

    dispatch.register_kernel("unpack_add", "cpu", marker)
    try:
        assert ops.implementation("unpack_add", "cpu") is marker
    finally:
        dispatch.unregister_kernel("unpack_add", "cpu")
    assert ops.implementation("unpack_add", "cpu") is not marker


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_values_beyond_fp16_saturate_on_the_wire_and_the_excess_stays(impl, dtype):
    # 7e4 and -1e5 (bf16: 70144 and -99840, ulp 512) go out as 65504 (fp32: ulp 2^-7) or
    # 65024 (127 x 512, exact in bf16), not Inf; Inf stays Inf.
    grad = torch.tensor([7e4, -1e5, 1.0, float("inf")], dtype=dtype)
    indices, values, residual = _run_pack(impl.ef_topk_pack, grad, torch.zeros(4, dtype=dtype), 1.0, True, 3,
                                          torch.float16, 0)
    sent = {torch.float32: 65504.0, torch.bfloat16: 65024.0}[dtype]
    assert indices.tolist() == [0, 1, 3] and values.tolist() == [sent, -sent, float("inf")]
    assert residual.tolist() == [grad[0].item() - sent, grad[1].item() + sent, 1.0, 0.0]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", list(FP16_SATURATION), ids=str)
def test_fp16_saturation_conserves_every_finite_acc(impl, dtype):
    """kernel_cases.FP16_SATURATION (sent + residual == acc up to float32's largest) by
    ef_topk_pack, its two passes and, in a bucket of 2^20 + 3, its sampled one pass, and by
    ef_threshold_pack. Every CPU level: test_kernels_isa.py."""
    grad, k = fp16_saturation_grad(dtype)
    for n in (grad.numel(), 2**20 + 3):
        acc = torch.cat([grad, torch.randn(n - grad.numel(), generator=torch.Generator().manual_seed(n)).to(dtype)])
        zeros = torch.zeros(n, dtype=dtype)
        check_fp16_saturation(acc, *_run_pack(impl.ef_topk_pack, acc, zeros, 1.0, True, k, torch.float16, 0))
        count, indices, values, residual = _threshold_run(impl, acc, zeros, 1.0, True, 1000.0, k, torch.float16, 0)
        assert count == k
        check_fp16_saturation(acc, indices, values, residual)


@needs_native
def test_every_nan_has_one_key_so_the_lower_index_wins():
    nan_bits = torch.tensor([0x7FC00000, 0x7FC00001, 0xFFC00000, 0x7F800001], dtype=torch.int64)
    grad = torch.zeros(8)
    grad[[6, 5, 3, 1]] = nan_bits.to(torch.int32).view(torch.float32)  # four NaNs, different payloads
    for impl in (reference.ef_topk_pack, native.ef_topk_pack):
        indices, _, _ = _run_pack(impl, grad, torch.zeros(8), 1.0, True, 2, torch.float32, 0)
        assert indices.tolist() == [1, 3]
