"""``unpack_add``: scatter-add of world_size payloads into the dense bucket, in row (rank)
order, every implementation against the pure-torch reference (the oracle: one ``index_add_``
per row; implementations: tests/kernel_implementations.py). Sums are compared bitwise,
NaN-aware; +0/-0 included (a bucket entry that only padding lands on becomes +0).
"""
import pytest
import torch
from kernel_cases import INF
from kernel_implementations import (CpuLevelTests, LevelCase,
                                    assert_no_host_synchronisation, assert_same, assert_triton_kernels_compile_for_sm90,
                                    dtype_id, implementation_cases, implementations)

from sparsecomm import ops
from sparsecomm.compress.packing import pack_into, payload_nbytes
from sparsecomm.ops import payload_views, reference

OP = "unpack_add"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.mark.parametrize("impl", implementations(OP, "cpu"))
@pytest.mark.parametrize("out_dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("value_dtype", (torch.float32, torch.float16), ids=dtype_id)
def test_matches_index_add_in_rank_order(impl, out_dtype, value_dtype):
    k, n, world_size = 300, 1000, 3
    gathered = torch.zeros(world_size * payload_nbytes(k, value_dtype), dtype=torch.uint8)
    indices, values = ops.payload_views(gathered, k, value_dtype)  # strided rows
    generator = torch.Generator().manual_seed(5)
    for rank in range(world_size):  # overlapping index sets across ranks
        indices[rank] = torch.randperm(n, generator=generator)[:k].int()
        values[rank] = (torch.randn(k, generator=generator) * 100).to(value_dtype)
    expected, actual = torch.full((n,), 7.0, dtype=out_dtype), torch.full((n,), 7.0, dtype=out_dtype)
    reference.unpack_add(indices, values, expected, True)
    impl.ops.unpack_add(indices, values, actual, True)
    assert torch.equal(expected.view(torch.uint8), actual.view(torch.uint8))
    reference.unpack_add(indices, values, expected, False)  # accumulate onto existing values
    impl.ops.unpack_add(indices, values, actual, False)
    assert torch.equal(expected.view(torch.uint8), actual.view(torch.uint8))


def _gathered(rows, k, n, value_dtype, seed, pad_row=None, real_zero=False):
    """An all-gather-like byte buffer of ``rows`` payloads (sparsecomm.ops.payload_views).

    Index 0 appears only where placed here: in ``pad_row`` as padding (index 0, value +0.0)
    repeated, as a threshold payload pads, and with ``real_zero`` also as one real entry of
    that row (value 1.5), which a racy or last-store-wins update would lose. Row 0 sends NaN,
    +Inf, -0.0 and +0.0.
    """
    gen = torch.Generator().manual_seed(seed)
    nbytes = payload_nbytes(k, value_dtype)
    buffer = torch.zeros(rows * nbytes, dtype=torch.uint8)
    for r in range(rows):
        indices = 1 + torch.randperm(n - 1, generator=gen)[:k]
        values = torch.randn(k, generator=gen).to(value_dtype)
        if r == 0:
            values[:4] = torch.tensor([float("nan"), INF, -0.0, 0.0]).to(value_dtype)
        if r == pad_row:
            indices[k // 2:] = 0
            values[k // 2:] = 0
            if real_zero:
                indices[1] = 0
                values[1] = 1.5
        pack_into(buffer[r * nbytes:(r + 1) * nbytes], indices, values, k)
    return buffer


@pytest.mark.parametrize("impl,out_dtype,value_dtype,rows", implementation_cases(OP, {
    family: [(o, v, rows) for o in DTYPES for v in DTYPES for rows in rows_of_family]
    for family, rows_of_family in (("cpu", (1, 2, 3)), ("triton", (2, 3)), ("cuda", (1, 2, 3)))}))
def test_padding_signed_zeros_and_non_finite_values_add_as_the_reference(impl, out_dtype, value_dtype, rows):
    n, k = 1000, 300
    for real_zero in (False, True):
        buffer = _gathered(rows, k, n, value_dtype, seed=rows, pad_row=rows - 1, real_zero=real_zero)
        indices, values = payload_views(buffer, k, value_dtype)
        device_indices, device_values = payload_views(buffer.to(impl.device), k, value_dtype)  # strided rows
        assert device_indices.stride(0) * 4 == payload_nbytes(k, value_dtype) or rows == 1
        start = torch.randn(n).to(out_dtype)
        # -0.0 where only padding lands (becomes +0.0), where a real -0.0 lands (stays -0.0),
        # where a real +0.0 lands (becomes +0.0) and where a nonzero value lands.
        start[0] = -0.0
        start[indices[0, 2:6].long()] = -0.0
        for zero_out in (True, False):
            out = start.clone().to(impl.device)
            impl.ops.unpack_add(device_indices, device_values, out, zero_out)
            expected = start.clone()
            reference.unpack_add(indices, values, expected, zero_out)
            assert_same(out, expected, f"unpack_add zero_out={zero_out} real_zero={real_zero}")
            if not zero_out and not real_zero:
                assert expected[0].item() == 0 and not torch.signbit(expected[0])


@pytest.mark.parametrize("impl", implementations(OP, "triton"))
def test_triton_reads_row_views_of_one_gathered_device_buffer(impl):
    """Row views of one gathered device buffer (the all-gather output) are read in place."""
    buffer = _gathered(3, 50, 200, torch.bfloat16, seed=7)
    indices, values = payload_views(buffer, 50, torch.bfloat16)
    device_indices, device_values = payload_views(buffer.to(impl.device), 50, torch.bfloat16)
    out = torch.empty(200, dtype=torch.float32, device=impl.device)
    impl.ops.unpack_add(device_indices, device_values, out)
    expected = torch.empty(200)
    reference.unpack_add(indices, values, expected)
    assert_same(out, expected)


@pytest.mark.parametrize("impl", implementations(OP, "cuda"))
def test_cuda_large_bucket(impl):
    n = 2**24 + 1
    k, rows = n // 100, 4
    gen = torch.Generator().manual_seed(0)
    indices = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(rows)]).int()
    values = torch.randn(rows, k, generator=gen)
    out = torch.empty(n, device=impl.device)
    impl.ops.unpack_add(indices.to(impl.device), values.to(impl.device), out, True)
    expected = torch.empty(n)
    reference.unpack_add(indices, values, expected, True)
    assert_same(out, expected, "unpack_add large")


@pytest.mark.parametrize("impl", implementations(OP, "cpu"))
def test_indices_outside_the_bucket_are_rejected(impl):
    indices = torch.tensor([[0, 5, 10]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="1 indices outside \\[0, 10\\)"):
        impl.ops.unpack_add(indices, torch.ones(1, 3), torch.zeros(10), True)


@pytest.mark.parametrize("impl", implementations(OP, "cpu"))
def test_opcheck(impl):
    torch.library.opcheck(torch.ops.sparsecomm.unpack_add.default,
                          (torch.randint(0, 1000, (2, 10), dtype=torch.int32).unique(dim=1)[:, :5].contiguous(),
                           torch.ones(2, 5), torch.zeros(1000), True))


@pytest.mark.parametrize("impl", implementations(OP, "cuda") + implementations(OP, "triton")[1:])
def test_no_host_synchronisation(impl):
    n, k, rows = 1 << 20, 10_000, 3
    gen = torch.Generator().manual_seed(0)
    indices = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(rows)]).int().to(impl.device)
    values = torch.randn(rows, k, generator=gen).to(impl.device)
    out = torch.empty(n, device=impl.device)
    assert_no_host_synchronisation(lambda: impl.ops.unpack_add(indices, values, out, True))


def _sm90_specs(triton_ops):
    i32 = "i32"
    unpack = triton_ops.unpack_add.__globals__
    return [
        (unpack["_add_row_kernel"], dict(idx_ptr="*i32", val_ptr="*bf16", out_ptr="*fp16", k=i32, n=i32),
         dict(BLOCK=1024), 4),
        (unpack["_plus_zero_kernel"], dict(idx_ptr="*i32", val_ptr="*fp32", out_ptr="*bf16", k=i32, n=i32,
                                           idx_row_stride=i32, val_row_stride=i32), dict(BLOCK=1024), 4),
    ]


def test_triton_kernels_compile_for_sm90_without_a_gpu():
    assert_triton_kernels_compile_for_sm90(_sm90_specs)


# --------------------------------------------------------------------------- every CPU level

PAIRS = [(g, v) for g in DTYPES for v in DTYPES]


def _unpack_case(n, k, world_size, out_dtype, value_dtype, zero_out, seed):
    generator = torch.Generator().manual_seed(seed)
    gathered = torch.zeros(world_size * payload_nbytes(k, value_dtype), dtype=torch.uint8)
    indices, values = ops.payload_views(gathered, k, value_dtype)  # strided rows
    for rank in range(world_size):  # overlapping index sets across ranks
        indices[rank] = torch.randperm(n, generator=generator)[:k].int()
        values[rank] = (torch.randn(k, generator=generator) * 100).to(value_dtype)
    # +Inf from rank 0 and -Inf from rank 1 at one index: NaN there.
    values[0, 0] = INF
    same = torch.nonzero(indices[1] == indices[0, 0]).flatten()
    position = int(same[0]) if same.numel() else 0
    indices[1, position] = indices[0, 0]
    values[1, position] = -INF
    start = torch.randn(n + 1, generator=generator).to(out_dtype)

    def run(impl_ops):
        out = start.clone()[1:]  # not 64-byte aligned: the streaming stores' head and tail run
        impl_ops.unpack_add(indices, values, out, zero_out)
        return [out]
    return run


def cpu_level_cases() -> dict[str, LevelCase]:
    """Every dtype pair at 1003 entries (3 ranks), float32 at 65,537 (2 ranks), onto zeros and
    onto the bucket, with +Inf and -Inf meeting at one entry."""
    cases = {}
    for n, k, world_size in ((1003, 300, 3), (65_537, 6_000, 2)):
        for out_dtype, value_dtype in PAIRS if n == 1003 else [(torch.float32, torch.float32)]:
            for zero_out in (True, False):
                name = f"unpack_add n={n} {value_dtype}->{out_dtype} world_size={world_size} zero_out={zero_out}"
                cases[name] = LevelCase(_unpack_case(n, k, world_size, out_dtype, value_dtype, zero_out, seed=n))
    return cases


class TestEveryCpuLevel(CpuLevelTests):
    cases = cpu_level_cases
