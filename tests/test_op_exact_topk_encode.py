"""``exact_topk_encode``: exact top-k on the compact wire, every implementation against the
pure-torch reference (the comparison: tests/chunk_kernel_checks.py, the implementations:
tests/kernel_implementations.py).

That wire is ``ChunkLayout(numel, numel, density, index_codec, value_codec, scale_group=64)``
(the hook's exact top-k with an index or value codec; the owner exchange's exact parts too):
one chunk of the whole bucket, a bf16 scale per 64 payload entries. The op is ``chunk_encode``
of such a layout (the CPU kernel: csrc/cpu/compact_encode.cpp; Triton:
sparsecomm/ops/triton/exact_topk_encode.py; no CUDA kernel: the dispatch takes Triton on
GPUs) under a name that says what it is, refusing every other layout. It must write the same
payload bytes and the same bits of residual, indices and decoded values as ChunkLayout.encode
of the compensated acc, for every index x value codec pair; on bucket sizes that are and are
not multiples of 64, k that is and is not, buckets of >= 2^20 entries (the sampled one-pass
selection, and its fallback when the sample misleads it), density 1; on data with ties,
zeros, subnormals and +-Inf/NaN (also more of them than k, and all NaN); with and without a
residual, adding it or not, divisor 1 and 3. The decoder: test_op_exact_topk_decode_add.py.
"""
import importlib
import sys
import warnings

import pytest
import torch
from chunk_kernel_checks import (ALL_MODES, EF_MODES, EXACT_CPU_GEOMETRIES, EXACT_SAMPLED, EXACT_SAMPLED_PAIRS,
                                 EXACT_SIXTEEN_BIT_VALUE_CODECS, EXACT_TRITON_EVERY_PAIR_GEOMETRY,
                                 EXACT_TRITON_GEOMETRIES, EXACT_TRITON_GEOMETRY_PAIRS, PAIRS, check_encode,
                                 chunk_arguments, encode, exact_layout, exact_sixteen_bit_layout, large_bucket_inputs,
                                 layout_inputs, level_encode_case, misleading_sample_inputs, non_finite_beyond_k_inputs,
                                 pair_mode, sixteen_bit_inputs)
from kernel_cases import check_fp16_saturation, chunk_data, ef_inputs, fp16_saturation_grad
from kernel_implementations import (DISPATCH, NEEDS_NATIVE, REFERENCE, CpuLevelTests, LevelCase,
                                    assert_the_hook_trains_with_the_kernels_as_with_the_reference,
                                    assert_triton_kernels_compile_for_sm90, bits, dtype_id, implementation_cases,
                                    implementations)

from sparsecomm import ops
from sparsecomm.compress.chunk_layout import ChunkLayout
from sparsecomm.compress.owner_layout import EXACT_SCALE_GROUP
from sparsecomm.ops import native

OP = "exact_topk_encode"
pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|overflow) encountered:RuntimeWarning")
def check_every_mode(impl, layout, grad, residual, modes=ALL_MODES):
    """Encode in every mode: add the residual with divisor 3, overwrite it with divisor 1, no
    residual with divisor 2."""
    for mode in modes:
        divisor, add_residual, has_residual = EF_MODES[mode]
        check_encode(impl, OP, layout, grad, residual if has_residual else None, divisor, add_residual)


@pytest.mark.parametrize("impl,index_codec,value_codec,geometry,nonfinite,modes", implementation_cases(OP, {
    "cpu": [(i, v, g, nonfinite, ALL_MODES)
            for i, v in PAIRS for g in EXACT_CPU_GEOMETRIES for nonfinite in (False, True)],
    "triton": [(i, v, EXACT_TRITON_EVERY_PAIR_GEOMETRY, nonfinite, (pair_mode(i, v),))
               for i, v in PAIRS for nonfinite in (True, False)]
    + [(i, v, g, g[0] >= 8, (0,)) for g in EXACT_TRITON_GEOMETRIES for i, v in EXACT_TRITON_GEOMETRY_PAIRS],
}))
def test_matches_the_reference(impl, index_codec, value_codec, geometry, nonfinite, modes):
    layout = exact_layout(*geometry, index_codec, value_codec)
    check_every_mode(impl, layout, *layout_inputs(layout.numel, nonfinite), modes)


@pytest.mark.parametrize("impl", implementations(OP, "cpu"))
@pytest.mark.parametrize("index_codec,value_codec", EXACT_SAMPLED_PAIRS)
def test_large_buckets_match_the_reference(impl, index_codec, value_codec):
    check_every_mode(impl, exact_layout(EXACT_SAMPLED, 0.01, index_codec, value_codec), *large_bucket_inputs())


@pytest.mark.parametrize("impl", implementations(OP, "cpu"))
def test_a_misleading_sample_falls_back_to_the_exact_two_passes(impl):
    check_every_mode(impl, exact_layout(EXACT_SAMPLED, 0.01, "rice", "int4"), *misleading_sample_inputs())


@pytest.mark.parametrize("impl", implementations(OP, "cpu"))
@pytest.mark.parametrize("value_codec", ["int4", "fp32", "bf16"])
@pytest.mark.parametrize("count", [3, 300, 10_003], ids=["fewer-than-k", "more-than-k", "all-nan"])
def test_non_finite_entries_beyond_k(impl, value_codec, count):
    # More Inf/NaN than k: every sent value is non-finite and the unsent ones must leave +0 too.
    check_every_mode(impl, exact_layout(10_003, 0.01, "rice", value_codec), *non_finite_beyond_k_inputs(count))


@pytest.mark.slow  # CI time on the interpreter; scripts/gpu_check.sh runs it (-m "")
@pytest.mark.parametrize("impl", implementations(OP, "triton"))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("value_codec", EXACT_SIXTEEN_BIT_VALUE_CODECS)
def test_16_bit_gradients_match_the_reference(impl, dtype, value_codec):
    layout = exact_sixteen_bit_layout(value_codec)
    check_every_mode(impl, layout, *sixteen_bit_inputs(layout, dtype), (0, 2))


SATURATION_CASES = {"reference": [(torch.float32, "hand-worked"), (torch.float32, EXACT_SAMPLED)],
                    "cpu": [(torch.float32, "hand-worked"), (torch.float32, EXACT_SAMPLED)],
                    "triton": [(torch.float32, "hand-worked"), (torch.bfloat16, "hand-worked")]}


@pytest.mark.parametrize("impl,dtype,n", implementation_cases(OP, SATURATION_CASES))
def test_fp16_codec_saturation_conserves_every_finite_acc(impl, dtype, n):
    """kernel_cases.FP16_SATURATION's accs on the fp16 value codec, selected by the two passes
    and, in a bucket of 2^20 + 3, by the sampled one pass: sent + residual == acc up to
    float32's largest."""
    grad, k = fp16_saturation_grad(dtype)
    n = grad.numel() if n == "hand-worked" else n
    acc = torch.cat([grad, torch.randn(n - grad.numel(), generator=torch.Generator().manual_seed(n)).to(dtype)])
    layout = exact_layout(n, k / n, "rice", "fp16")
    assert layout.capacity == k
    _, indices, decoded, residual = encode(impl, OP, layout, acc, torch.zeros(n, dtype=dtype), 1.0, True)
    check_fp16_saturation(acc, indices, decoded, residual)


@pytest.mark.parametrize("impl,n,density,index_codec,value_codec", implementation_cases(OP, {
    "cpu": [(10_000, 0.01, "chunk", "int2")], "triton": [(700, 0.1, "chunk", "int4")]}))
def test_equal_keys_take_the_lowest_indices(impl, n, density, index_codec, value_codec):
    grad = torch.ones(n)
    grad[1::2] = -1.0  # all ties
    layout = exact_layout(n, density, index_codec, value_codec)
    _, indices, _, _ = encode(impl, OP, layout, grad, None, 1.0, False)
    assert torch.equal(indices, torch.arange(layout.capacity))


@pytest.mark.parametrize("impl", implementations(OP, "cpu"))
@pytest.mark.parametrize("threads", [1, 2])
def test_the_result_does_not_depend_on_the_thread_count(impl, threads):
    layout = exact_layout(EXACT_SAMPLED, 0.01, "rice", "int2")
    grad, residual = chunk_data(EXACT_SAMPLED, 7, False), chunk_data(EXACT_SAMPLED, 8, False)
    want = encode(REFERENCE, OP, layout, grad, residual, 2.0, True)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_encode(impl, OP, layout, grad, residual, 2.0, True, want=want)
    finally:
        torch.set_num_threads(before)


# --------------------------------------------------------------------------- the op's name, and the choice


@pytest.mark.parametrize("impl", implementations(OP, "reference", "cpu", "triton") + [pytest.param(DISPATCH,
                                                                                                  id="dispatch")])
def test_every_other_layout_is_refused(impl):
    chunked = ChunkLayout(1000, 100, 0.1, "rice", "int4")
    payload = torch.empty(chunked.nbytes, dtype=torch.uint8, device=impl.device)
    with pytest.raises(ValueError, match="exact_topk_encode: the layout must be one chunk"):
        impl.ops.exact_topk_encode(torch.zeros(1000, device=impl.device), None, 1.0, False, chunked, payload)


@pytest.mark.parametrize("impl", implementations(OP, "cpu", "triton"))
def test_chunk_encode_of_the_layout_is_this_op(impl):
    """chunk_encode, what the hook calls, takes these layouts too, with the same bytes."""
    layout = exact_layout(10_003, 0.01, "rice", "int4")
    grad, residual = layout_inputs(10_003, True)
    exact = encode(impl, OP, layout, grad, residual, 3.0, True)
    chunk = encode(impl, "chunk_encode", layout, grad, residual, 3.0, True)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(exact, chunk))


@pytest.mark.parametrize("impl", implementations(OP, "cpu"))
def test_dispatch_takes_the_kernel_for_float32_gradients_only(impl):
    layout = exact_layout(5000, 0.02, "rice", "int4")
    assert ops.dispatch._chunk_implementation("chunk_encode", torch.zeros(5000), layout) is native.exact_topk_encode
    assert ops.dispatch.native_chunk_encode(torch.zeros(5000), layout)
    grad = chunk_data(5000, 3, True).to(torch.bfloat16)  # 16-bit gradients: the reference
    assert not ops.dispatch.native_chunk_encode(grad, layout)
    want = encode(REFERENCE, OP, layout, grad, grad * 0.5, 2.0, True)
    got = encode(DISPATCH, OP, layout, grad, grad * 0.5, 2.0, True)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(want, got))
    # Scale groups on a layout of several chunks: no kernel takes it.
    several = ChunkLayout(5000, 1000, 0.02, "rice", "int4", scale_group=64)
    assert not ops.dispatch.native_chunk_encode(torch.zeros(5000), several)


def test_a_kernel_registered_for_chunk_encode_still_takes_these_layouts():
    """register_kernel("chunk_encode", ...) took every layout before this op had a name of its
    own; one registered for exact_topk_encode wins over it for these layouts only."""
    def chunk_kernel(*args):
        return "chunk"

    def exact_kernel(*args):
        return "exact"

    layout, chunked = exact_layout(100, 0.1, "rice", "int4"), ChunkLayout(100, 10, 0.1, "rice", "int4")
    grad = torch.zeros(100)
    ops.dispatch.register_kernel("chunk_encode", "cpu", chunk_kernel)
    try:
        assert ops.dispatch.chunk_encode(grad, None, 1.0, False, layout, None) == "chunk"
        assert ops.dispatch.exact_topk_encode(grad, None, 1.0, False, layout, None) == "chunk"
        ops.dispatch.register_kernel("exact_topk_encode", "cpu", exact_kernel)
        assert ops.dispatch.chunk_encode(grad, None, 1.0, False, layout, None) == "exact"
        assert ops.dispatch.chunk_encode(grad, None, 1.0, False, chunked, None) == "chunk"
    finally:
        ops.dispatch.unregister_kernel("chunk_encode", "cpu")
        ops.dispatch.unregister_kernel("exact_topk_encode", "cpu")


def test_the_former_triton_module_name_warns_once():
    pytest.importorskip("triton", reason="triton is not installed")
    name = "sparsecomm.ops.triton.compact_encode"
    saved = sys.modules.pop(name, None)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = importlib.import_module(name)
            importlib.import_module(name)
        relevant = [w for w in caught if issubclass(w.category, DeprecationWarning) and name in str(w.message)]
        assert len(relevant) == 1 and "exact_topk_encode" in str(relevant[0].message)
        from sparsecomm.ops.triton.exact_topk_encode import exact_topk_encode

        assert first.compact_encode is exact_topk_encode
    finally:
        sys.modules.pop(name, None)
        if saved is not None:
            sys.modules[name] = saved


# --------------------------------------------------------------------------- errors, opcheck, compiling


@pytest.mark.parametrize("impl", implementations(OP, "cpu"))
def test_cpu_argument_errors(impl):
    layout = exact_layout(1000, 0.1, "rice", "int8")
    geometry = layout.geometry
    payload = torch.empty(layout.nbytes, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="one chunk of the whole bucket"):
        torch.ops.sparsecomm.chunk_encode(torch.zeros(1000), None, 1.0, False, 500, geometry.k_full, geometry.k_full,
                                          2, 4, 64, payload)
    with pytest.raises(RuntimeError, match="scale_group must be >= 0"):
        torch.ops.sparsecomm.chunk_encode(torch.zeros(1000), None, 1.0, False, 1000, geometry.k_full,
                                          geometry.k_last, 2, 4, -1, payload)
    with pytest.raises(RuntimeError, match="payload must be"):
        impl.ops.exact_topk_encode(torch.zeros(1000), None, 1.0, False, layout, payload[:-8])


@pytest.mark.parametrize("impl", implementations(OP, "cpu"))
@pytest.mark.parametrize("index_codec,value_codec", [("rice", "int2"), ("int32", "bf16"), ("chunk", "sign")])
def test_opcheck(impl, index_codec, value_codec):
    layout = exact_layout(10_003, 0.01, index_codec, value_codec)
    # Finite data: opcheck compares outputs of repeated runs, and NaN != NaN there.
    grad, residual = chunk_data(10_003, 0, False), chunk_data(10_003, 1, False)
    payload = torch.empty(layout.nbytes, dtype=torch.uint8)
    torch.library.opcheck(torch.ops.sparsecomm.chunk_encode.default,
                          (grad, residual, 3.0, True, *chunk_arguments(layout), payload))


def _sm90_specs(triton_ops):
    """The group kernel of the Triton encoder (its selection is ef_topk_pack's, its byte
    assembly chunk_encode's: compiled in their tests)."""
    group_kernel = triton_ops.exact_topk_encode.__globals__["_group_kernel"]
    i32 = "i32"
    group = dict(idx_ptr="*i32", val_ptr="*fp32", payload_ptr="*u8", idx_out_ptr="*i64", vcode_ptr="*i32",
                 capacity=i32, scale_group=i32)
    return [
        (group_kernel, dict(group, r_ptr="*fp32", dec_out_ptr="*fp32"),
         dict(HAS_RESIDUAL=True, VALUE_CODEC=5, LIMIT=0.0, GROUP=64), 4),
        (group_kernel, dict(group, r_ptr="*bf16", dec_out_ptr="*fp16"),
         dict(HAS_RESIDUAL=True, VALUE_CODEC=2, LIMIT=65504.0, GROUP=64), 4),
    ]


def test_triton_kernels_compile_for_sm90_without_a_gpu():
    assert_triton_kernels_compile_for_sm90(_sm90_specs)


# --------------------------------------------------------------------------- in the hook


@NEEDS_NATIVE
@pytest.mark.parametrize("exchange", ["allgather", "owner"])
def test_the_hook_trains_bit_for_bit_like_the_reference(exchange):
    # Exact top-k on the compact wire (and the owner exchange's exact parts): the native
    # kernels (this op's and exact_topk_decode_add's) replace the reference, and not one bit
    # of the training changes.
    stats = assert_the_hook_trains_with_the_kernels_as_with_the_reference(
        dict(index_codec="rice", value_codec="int4", exchange=exchange))
    if exchange == "allgather":  # the native encoder forms acc itself: the fused path ran
        for with_kernels, reference_only in stats:
            assert with_kernels["fused_calls"] == with_kernels["sparse_calls"] > 0
            assert reference_only["fused_calls"] == 0


# --------------------------------------------------------------------------- every CPU level


def cpu_level_cases() -> dict[str, LevelCase]:
    """Every codec pair on 10,003 entries, three pairs on a bucket of 2^20 + 3 (the sampled
    selection), NaN and +-Inf among the values; and kernel_cases.FP16_SATURATION's float32 accs
    on the fp16 codec in a bucket of 2^20 + 3, also checked against the hand-worked values."""
    cases = {}
    for n, density, pairs in ((10_003, 0.01, PAIRS), (EXACT_SAMPLED, 0.01, [("rice", "int4"), ("rice", "int2"),
                                                                       ("chunk", "sign")])):
        grad, residual = ef_inputs(n, torch.float32, seed=n + 4, kind="nonfinite")
        for index_codec, value_codec in pairs:
            layout = exact_layout(n, density, index_codec, value_codec)
            what = f"n={n} density={density} {index_codec}+{value_codec} scale_group={EXACT_SCALE_GROUP}"
            for divisor, add_residual, r in ((3.0, True, residual), (2.0, False, None)):
                cases[f"exact_topk_encode {what} residual={r is not None}"] = LevelCase(
                    level_encode_case(OP, grad, r, divisor, add_residual, layout))
    grad, k = fp16_saturation_grad(torch.float32)
    noise = torch.randn(EXACT_SAMPLED - grad.numel(), generator=torch.Generator().manual_seed(EXACT_SAMPLED))
    acc = torch.cat([grad, noise])

    def check(outputs):
        _, indices, values, residual = outputs
        check_fp16_saturation(acc, indices, values, residual)

    cases[f"fp16 saturation exact_topk_encode n={EXACT_SAMPLED}"] = LevelCase(
        level_encode_case(OP, acc, torch.zeros(EXACT_SAMPLED), 1.0, True,
                          exact_layout(EXACT_SAMPLED, k / EXACT_SAMPLED, "rice", "fp16")),
        check=check)
    return cases


class TestEveryCpuLevel(CpuLevelTests):
    cases = cpu_level_cases
