"""``ef_threshold_pack``: fused error feedback + selection by a threshold + packing (one pass),
every implementation against the pure-torch reference (the oracle; implementations:
tests/kernel_implementations.py). Only the CPU has a kernel: the op's one caller, the MPI
transport's variable-size wire, runs on CPU.

The entries whose key reaches the threshold's are sent lowest index first, up to the capacity,
so the payload order is defined and compared as it is; the count, the indices and the updated
residual bit for bit (no NaN in a residual: a non-finite acc leaves +0, csrc/README.md), sent
values NaN-aware.
"""
import pytest
import torch
from kernel_cases import (FP16_SATURATION, INF, NAN, check_fp16_saturation, check_non_finite_rule, ef_inputs,
                          fp16_saturation_grad, threshold_non_finite_cases, with_non_finite)
from kernel_implementations import (REFERENCE, CpuLevelTests, LevelCase,
                                    assert_same, dtype_id, implementation_cases, implementations)

from sparsecomm.ops import reference

OP = "ef_threshold_pack"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PAIRS = [(g, v) for g in DTYPES for v in DTYPES]
SAMPLED = 2**20 + 3


def run_threshold(impl, grad, residual, divisor, add_residual, threshold, capacity, value_dtype, offset=0):
    """(count, indices, values, residual) of ``impl``'s ef_threshold_pack on copies of the inputs."""
    residual = None if residual is None else residual.clone()
    indices = torch.full((capacity,), -1, dtype=torch.int32)
    values = torch.full((capacity,), 7.0, dtype=value_dtype)
    count = int(impl.ops.ef_threshold_pack(grad, residual, divisor, add_residual, threshold, indices, values, offset))
    return count, indices, values, residual


def check_threshold(impl, *args):
    """``impl`` == the oracle: count, indices, values (NaN-aware) and residual (no NaN). Returns impl's outputs."""
    (count_ref, *want), (count, *got) = run_threshold(REFERENCE, *args), run_threshold(impl, *args)
    assert count == count_ref
    for name, w, g in zip(("indices", "values", "residual"), want, got):
        if w is not None:
            assert_same(g, w, name, nan_ok=name != "residual")
    return count, *got


@pytest.mark.parametrize("impl", implementations(OP, "cpu"))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_matches_the_reference_with_and_without_overflow(impl, dtype):
    grad, residual = ef_inputs(10_007, dtype, seed=3, kind="nonfinite")
    for threshold, capacity in ((1.5, 4000), (1.5, 100), (0.0, 10_007), (INF, 10)):
        check_threshold(impl, grad, residual, 3.0, True, threshold, capacity, torch.bfloat16, 7)


@pytest.mark.parametrize("impl", implementations(OP, "reference", "cpu"))
@pytest.mark.parametrize("dtype,value_dtype", PAIRS, ids=dtype_id)
def test_non_finite_acc_worked_by_hand(impl, dtype, value_dtype):
    """The rule checked by hand (every value here is exact in every dtype)."""
    def threshold(acc, bar, capacity):
        count, indices, values, residual = run_threshold(impl, torch.tensor(acc, dtype=dtype),
                                                         torch.zeros(len(acc), dtype=dtype), 1.0, True, bar, capacity,
                                                         value_dtype)
        return count, indices.tolist(), values.float().tolist(), residual.float().view(torch.int32).tolist()

    def plus(values):  # +0.0 and -0.0 differ here
        return torch.tensor(values).view(torch.int32).tolist()

    # Capacity 2: Inf and 5 are sent (lowest indices); NaN and -Inf do not fit, 0.5 is below.
    count, indices, values, residual = threshold([INF, 5.0, NAN, -INF, 0.5], 1.0, 2)
    assert count == 2 and indices == [0, 1] and values == [INF, 5.0]
    assert residual == plus([0.0, 0.0, 0.0, 0.0, 0.5])
    # A NaN threshold selects only NaN: the Inf is not selected and still leaves +0.
    count, indices, values, residual = threshold([INF, NAN, 2.0], NAN, 2)
    assert count == 1 and indices == [1, 0] and values[0] != values[0] and values[1] == 0.0
    assert residual == plus([0.0, 0.0, 2.0])
    count, indices, _, residual = threshold([NAN, 1.0, -INF], 0.5, 0)  # nothing sent at capacity 0
    assert count == 0 and residual == plus([0.0, 1.0, 0.0])


@pytest.mark.parametrize("impl", implementations(OP, "cpu"))
def test_cleanup_keeps_the_remainder_of_a_sent_finite_acc(impl):
    """fp16 grad with bf16 values (refused by the hook, allowed by the op): 65504 goes out as
    bf16 65536, which is Inf in fp16, so its remainder is -Inf although acc is finite. The
    pass that zeroes the unsent NaNs (beyond the capacity) must leave that remainder alone."""
    grad = torch.tensor([65504.0, NAN, 1.0, NAN], dtype=torch.float16)
    results = [run_threshold(i, grad, torch.zeros(4, dtype=torch.float16), 1.0, True, 0.5, 1, torch.bfloat16)
               for i in (REFERENCE, impl)]
    for count, indices, values, residual in results:
        assert count == 1 and indices.tolist() == [0] and values.float().tolist() == [65536.0]
        assert residual.float().tolist() == [-INF, 0.0, 1.0, 0.0]
    assert torch.equal(results[0][3].view(torch.uint8), results[1][3].view(torch.uint8))


# 10,007 entries (every pair) and 2^20 + 3 (the pairs that take every branch of the vector
# and scalar loops, as test_op_ef_topk_pack.py's sampled cases).
LARGE_PAIRS = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16),
               (torch.float16, torch.float32)]


@pytest.mark.parametrize("impl,dtype,value_dtype,n", implementation_cases(OP, {
    "cpu": [(g, v, 10_007) for g, v in PAIRS] + [(g, v, SAMPLED) for g, v in LARGE_PAIRS]}))
def test_non_finite_acc_leaves_zero_residual(impl, dtype, value_dtype, n):
    for name, count, threshold, capacity in threshold_non_finite_cases(n):
        grad = with_non_finite(n, dtype, count, seed=count)
        residual = (torch.randn(n, generator=torch.Generator().manual_seed(1)) * 0.1).to(dtype)
        sent, indices, values, new_residual = check_threshold(impl, grad, residual, 3.0, True, threshold, capacity,
                                                              value_dtype, 5)
        acc = reference.compensated(grad, residual, 3.0, True)
        check_non_finite_rule(acc, indices[:sent].long() - 5, values[:sent], new_residual)


@pytest.mark.parametrize("impl", implementations(OP, "reference", "cpu"))
@pytest.mark.parametrize("dtype", list(FP16_SATURATION), ids=dtype_id)
def test_fp16_saturation_conserves_every_finite_acc(impl, dtype):
    """kernel_cases.FP16_SATURATION (sent + residual == acc up to float32's largest), in the
    hand-worked bucket and in one of 2^20 + 3. Every CPU level: TestEveryCpuLevel."""
    grad, k = fp16_saturation_grad(dtype)
    for n in (grad.numel(), SAMPLED):
        acc = torch.cat([grad, torch.randn(n - grad.numel(), generator=torch.Generator().manual_seed(n)).to(dtype)])
        count, indices, values, residual = run_threshold(impl, acc, torch.zeros(n, dtype=dtype), 1.0, True, 1000.0, k,
                                                         torch.float16)
        assert count == k
        check_fp16_saturation(acc, indices, values, residual)


@pytest.mark.parametrize("impl", implementations(OP, "cpu"))
def test_opcheck(impl):
    grad, residual = ef_inputs(1000, torch.float32, seed=6)  # finite: opcheck compares repeated runs, NaN != NaN
    torch.library.opcheck(torch.ops.sparsecomm.ef_threshold_pack.default,
                          (grad, residual.clone(), 2.0, True, 1.0, torch.empty(400, dtype=torch.int32),
                           torch.empty(400), 0))


# --------------------------------------------------------------------------- every CPU level

OFFSET = 5


def _threshold_case(grad, residual, divisor, add_residual, threshold, capacity, value_dtype):
    def run(ops):
        r = None if residual is None else residual.clone()
        indices = torch.full((capacity,), -1, dtype=torch.int32)
        values = torch.full((capacity,), 7.0, dtype=value_dtype)
        count = ops.ef_threshold_pack(grad, r, divisor, add_residual, threshold, indices, values, OFFSET)
        return [count.reshape(1), indices, values] + ([] if r is None else [r])
    return run


def cpu_level_cases() -> dict[str, LevelCase]:
    """Odd sizes (the vector loops' scalar tails), NaN and +-Inf among the values, every dtype
    pair at one size, a bucket of 2^20 + 3, thresholds that fill the capacity, overflow it,
    select only +-Inf or only NaN; and kernel_cases.FP16_SATURATION's accs, also checked against
    the hand-worked values."""
    cases = {}
    for n in (7, 1003, 65_537, SAMPLED):
        for dtype, value_dtype in PAIRS if n == 1003 else [(torch.float32, torch.float32)]:
            grad, residual = ef_inputs(n, dtype, seed=n + 1, kind="nonfinite")
            settings = [(1.5, max(1, n // 50))] if n == SAMPLED else [(1.5, n), (1.5, max(1, n // 50)), (INF, 2),
                                                                       (NAN, n)]
            for threshold, capacity in settings:
                for divisor, add_residual, r in ((3.0, True, residual), (2.0, False, None)):
                    name = (f"ef_threshold_pack n={n} {dtype}->{value_dtype} threshold={threshold} "
                            f"capacity={capacity} residual={r is not None}")
                    cases[name] = LevelCase(_threshold_case(grad, r, divisor, add_residual, threshold, capacity,
                                                            value_dtype))
    for dtype in FP16_SATURATION:
        grad, k = fp16_saturation_grad(dtype)
        for n in (grad.numel(), SAMPLED):
            acc = torch.cat([grad, torch.randn(n - grad.numel(), generator=torch.Generator().manual_seed(n)).to(dtype)])

            def check(outputs, acc=acc):
                count, indices, values, residual = outputs
                assert int(count) == indices.numel()
                check_fp16_saturation(acc, indices.long() - OFFSET, values, residual)

            cases[f"fp16 saturation n={n} {dtype}"] = LevelCase(
                _threshold_case(acc, torch.zeros(n, dtype=dtype), 1.0, True, 1000.0, k, torch.float16), check=check)
    return cases


class TestEveryCpuLevel(CpuLevelTests):
    cases = cpu_level_cases
