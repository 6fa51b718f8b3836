"""``chunk_decode_add``: decode world_size chunked payloads and add them, in row (rank) order,
into the dense bucket; every implementation against the pure-torch reference (ChunkLayout.views
+ one index_add_ per row; the comparison: tests/chunk_kernel_checks.py, the implementations:
tests/kernel_implementations.py).

The payloads are those the hook sends (chunk_kernel_checks.payloads_of: the native encoder,
which test_op_chunk_encode.py holds to the reference's bytes, or the reference where no kernel
applies) of the gradients and layouts the encoder is tested on, several per bucket (the
error-feedback modes select differently, as ranks do), back to back or as rows farther apart
than their size (sealed: each followed by its trailer). Sums are compared with NaN at the
same places and all else bitwise.
"""
from dataclasses import dataclass

import pytest
import torch
from chunk_kernel_checks import (ALL_MODES, CPU_GEOMETRIES, CUDA_GEOMETRIES, EF_MODES, PAIRS,
                                 TRITON_EVERY_PAIR_GEOMETRY,
                                 TRITON_GEOMETRIES, TRITON_GEOMETRY_PAIRS, check_decode_add, chunk_arguments, encode,
                                 layout_inputs, level_decode_case, pair_mode, payloads_of, rice_window_inputs,
                                 sixteen_bit_inputs, sixteen_bit_layout, triton_geometry_modes)
from kernel_cases import chunk_data
from kernel_implementations import (REFERENCE, CpuLevelTests, LevelCase,
                                    assert_no_host_synchronisation, assert_same, assert_triton_kernels_compile_for_sm90,
                                    dtype_id, implementation_cases, implementations)

from sparsecomm.compress import payload_seal
from sparsecomm.compress.chunk_layout import ChunkLayout
from sparsecomm.compress.value_codecs import VALUE_CODECS
from sparsecomm.ops import native, reference

OP = "chunk_decode_add"
ENCODER = "chunk_encode"
pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|overflow) encountered:RuntimeWarning")


@dataclass(frozen=True)
class Rows:
    """The payloads of a bucket: the gradient of layout_inputs (with NaN/+-Inf or not) encoded
    in each of the error-feedback ``modes``, and with ``finite_too`` the finite gradient (seed 7)
    in the same modes."""

    nonfinite: bool
    modes: tuple
    finite_too: bool = False

    def payloads(self, layout) -> torch.Tensor:
        grad, residual = layout_inputs(layout.numel, self.nonfinite)
        rows = payloads_of(ENCODER, layout, grad, residual, self.modes)
        if self.finite_too:
            rows += payloads_of(ENCODER, layout, *layout_inputs(layout.numel, False, seed=7), self.modes)
        return torch.cat(rows)

    def __str__(self) -> str:
        return f"{'nonfinite' if self.nonfinite else 'finite'}{''.join(map(str, self.modes))}" + (
            "+finite" if self.finite_too else "")


def _triton_cases():
    """Every codec pair on one layout (two payloads: with and without NaN/+-Inf, in the pair's
    mode), onto zeros and onto the bucket; three pairs on every geometry onto the bucket
    (zero_out=True only zeroes the bucket first and then runs the same kernels)."""
    every_pair = [(i, v, TRITON_EVERY_PAIR_GEOMETRY, Rows(True, (pair_mode(i, v),), finite_too=True), (True, False))
                  for i, v in PAIRS]
    geometries = [(i, v, g, Rows(g[0] >= 8, triton_geometry_modes(ChunkLayout(*g, i, v))), (False,))
                  for g in TRITON_GEOMETRIES for i, v in TRITON_GEOMETRY_PAIRS]
    return every_pair + geometries


@pytest.mark.parametrize("impl,index_codec,value_codec,geometry,rows,zero_outs", implementation_cases(OP, {
    "cpu": [(i, v, g, Rows(nonfinite, ALL_MODES), (True, False))
            for i, v in PAIRS for g in CPU_GEOMETRIES for nonfinite in (False, True)],
    "triton": _triton_cases(),
    "cuda": [(i, v, g, Rows(nonfinite, ALL_MODES), (True, False))
             for i, v in PAIRS for g in CUDA_GEOMETRIES for nonfinite in (False, True)],
}))
def test_matches_the_reference(impl, index_codec, value_codec, geometry, rows, zero_outs):
    layout = ChunkLayout(*geometry, index_codec, value_codec)
    n = layout.numel
    gathered = rows.payloads(layout)
    for zero_out in zero_outs:
        check_decode_add(impl, OP, layout, gathered, torch.randn(n, generator=torch.Generator().manual_seed(0)),
                         zero_out)
    if impl.family == "cuda":  # the device's own payloads (NaN bits of its own), and one row alone
        grad, residual = layout_inputs(n, rows.nonfinite)
        device_rows = [encode(impl, ENCODER, layout, grad, residual if has else None, divisor, add)[0]
                       for divisor, add, has in (EF_MODES[mode] for mode in rows.modes)]
        for zero_out in zero_outs:
            check_decode_add(impl, OP, layout, torch.cat(device_rows), torch.randn(n), zero_out)
    if impl.family in ("cpu", "cuda"):
        check_decode_add(impl, OP, layout, gathered[: layout.nbytes], torch.randn(n), False)


FLOAT32_PAYLOADS_VALUE_CODECS = ("fp32", "bf16", "fp16", "int4")


INTO_16_BIT_BUCKETS = {  # family -> (geometry, index codec, value codec, rows, the row with NaN/+-Inf, bucket dtype)
    "cpu": [((10_003, 4096, 0.01), "rice", v, 2, None, out) for v in FLOAT32_PAYLOADS_VALUE_CODECS
            for out in (torch.bfloat16, torch.float16)],
    "triton": [((1003, 64, 0.1), "chunk", v, 3, 1, out) for v in FLOAT32_PAYLOADS_VALUE_CODECS
               for out in (torch.bfloat16, torch.float16)],
    "cuda": [((10_003, 4096, 0.01), i, v, 3, None, out) for i, v in (("rice", "fp32"), ("chunk", "bf16"),
                                                                      ("int32", "fp16"), ("rice", "int4"),
                                                                      ("chunk", "sign"))
             for out in (torch.bfloat16, torch.float16)],
}


@pytest.mark.parametrize("impl,geometry,index_codec,value_codec,rows,nonfinite_row,out_dtype",
                         implementation_cases(OP, INTO_16_BIT_BUCKETS))
def test_into_16_bit_buckets_from_float32_payloads(impl, geometry, index_codec, value_codec, rows, nonfinite_row,
                                                   out_dtype):
    """``rows`` payloads of float32 gradients (x 100; the row ``nonfinite_row`` with NaN/+-Inf)
    added into bf16 and fp16 buckets."""
    layout = ChunkLayout(*geometry, index_codec, value_codec)
    payloads = []
    for seed in range(rows):
        payload = torch.empty(layout.nbytes, dtype=torch.uint8)
        reference.chunk_encode(chunk_data(layout.numel, seed, seed == nonfinite_row) * 100, None, 1.0, False, layout,
                               payload)
        payloads.append(payload)
    for zero_out in (True, False):
        check_decode_add(impl, OP, layout, torch.cat(payloads), torch.randn(layout.numel).to(out_dtype), zero_out)


@pytest.mark.slow  # CI time on the interpreter; scripts/gpu_check.sh runs it (-m "")
@pytest.mark.parametrize("impl", implementations(OP, "triton"))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("value_codec", VALUE_CODECS)
def test_16_bit_gradients_and_buckets(impl, dtype, value_codec):
    """Payloads of bf16/fp16 gradients (test_op_chunk_encode.py) into buckets of their dtype."""
    layout = sixteen_bit_layout(value_codec)
    gathered = torch.cat(payloads_of(ENCODER, layout, *sixteen_bit_inputs(layout, dtype), (0, 2)))
    for zero_out in (True, False):
        check_decode_add(impl, OP, layout, gathered, torch.randn(layout.numel).to(dtype), zero_out)


@pytest.mark.parametrize("impl", implementations(OP, "cpu", "triton"))
def test_rice_codes_longer_than_one_window(impl):
    layout = ChunkLayout(2048, 1024, 0.1, "rice", "int2")
    grad, residual = rice_window_inputs()
    payload = encode(REFERENCE, ENCODER, layout, grad, residual, 1.0, True)[0]
    for zero_out in (True, False):
        check_decode_add(impl, OP, layout, payload, torch.randn(2048), zero_out)


@pytest.mark.parametrize("impl,geometry,index_codec,value_codec", implementation_cases(OP, {
    family: [((5003, 1024, 0.02), i, v) for i, v in (("int32", "fp32"), ("rice", "int4"), ("chunk", "sign"))]
    for family in ("reference", "cpu")} | {
    "triton": [((299, 64, 0.1), i, "int4") for i in ("int32", "rice")]}))
def test_reads_sealed_rows_as_back_to_back_ones(impl, geometry, index_codec, value_codec):
    """Payloads farther apart than their size (each followed by its 8-byte seal on the wire):
    a [rows, nbytes] view with a longer row stride decodes as back-to-back ones do."""
    layout = ChunkLayout(*geometry, index_codec, value_codec)
    n = layout.numel
    generator = torch.Generator().manual_seed(11)
    sealed = torch.full((3, payload_seal.sealed_nbytes(layout.nbytes)), 0xEE, dtype=torch.uint8)
    for row in sealed:
        layout.encode(torch.randn(n, generator=generator), None, row[: layout.nbytes])
    want, got = torch.zeros(n), torch.full((n,), 7.0, device=impl.device)
    reference.chunk_decode_add(sealed[:, : layout.nbytes].reshape(-1), layout, want, True)
    impl.ops.chunk_decode_add(sealed.to(impl.device)[:, : layout.nbytes], layout, got, True)
    assert_same(got, want, f"decode_add of sealed rows ({index_codec})")


# --------------------------------------------------------------------------- corrupt payloads


@pytest.mark.parametrize("impl", implementations(OP, "cpu"))
def test_cpu_a_corrupt_payload_raises_and_writes_nothing_outside_the_bucket(impl):
    layout = ChunkLayout(1000, 100, 0.1, "int32", "fp32")
    payload = torch.empty(layout.nbytes, dtype=torch.uint8)
    reference.chunk_encode(torch.randn(1000), None, 1.0, False, layout, payload)
    payload[:4] = torch.tensor([0xFF, 0xFF, 0xFF, 0x7F], dtype=torch.uint8)  # index 2^31 - 1
    with pytest.raises(RuntimeError, match="corrupt payload"):
        impl.ops.chunk_decode_add(payload, layout, torch.zeros(1000))


@pytest.mark.parametrize("impl", implementations(OP, "triton"))
def test_triton_a_corrupt_payload_writes_nothing_outside_its_chunks(impl):
    for index_codec in ("int32", "chunk", "rice"):
        layout = ChunkLayout(1000, 100, 0.1, index_codec, "fp32")
        payload = torch.empty(layout.nbytes, dtype=torch.uint8)
        reference.chunk_encode(torch.randn(1000), None, 1.0, False, layout, payload)
        payload[: layout.index_bytes] = 0xFF  # int32: index -1; chunk: 127 >= 100; rice: all ones
        out = torch.zeros(1002, device=impl.device)
        impl.ops.chunk_decode_add(payload.to(impl.device), layout, out[1:-1])
        assert int(torch.count_nonzero(out)) == 0, index_codec  # every entry dropped, none outside


@pytest.mark.parametrize("impl", implementations(OP, "cuda"))
def test_cuda_a_corrupt_payload_trips_a_device_assert(impl):
    """An index outside its chunk: the entry is skipped and a device assert fires (the CPU
    operator raises instead; on CUDA that would need a host synchronisation). In a
    subprocess: the assert leaves the CUDA context unusable."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import torch
        import sparsecomm._C  # noqa: F401
        from sparsecomm.compress.chunk_layout import ChunkLayout
        from sparsecomm.ops import reference
        layout = ChunkLayout(1000, 100, 0.1, "int32", "fp32")
        payload = torch.empty(layout.nbytes, dtype=torch.uint8)
        reference.chunk_encode(torch.randn(1000), None, 1.0, False, layout, payload)
        payload[:4] = torch.tensor([0xFF, 0xFF, 0xFF, 0x7F], dtype=torch.uint8)  # index 2^31 - 1
        guard = torch.zeros(3000, device="cuda")
        out = guard[1000:2000]
        torch.ops.sparsecomm.chunk_decode_add(payload.cuda(), 100, 10, 10, 0, 0, 0, out, True)
        try:
            torch.cuda.synchronize()
        except RuntimeError as error:
            print("RAISED", "corrupt payload" in str(error) or "device-side assert" in str(error))
        else:
            print("NOT RAISED")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "RAISED True" in result.stdout, result.stdout + result.stderr[-3000:]


# --------------------------------------------------------------------------- arguments, opcheck, GPUs


@pytest.mark.parametrize("impl", implementations(OP, "cpu", "triton"))
def test_a_gathered_buffer_of_the_wrong_size_is_rejected(impl):
    layout = ChunkLayout(1000, 100, 0.1, "chunk", "int8")
    payload = torch.empty(layout.nbytes, dtype=torch.uint8, device=impl.device)
    with pytest.raises(RuntimeError if impl.family == "cpu" else ValueError, match="gathered must be"):
        impl.ops.chunk_decode_add(payload[:-1], layout, torch.zeros(1000, device=impl.device))


@pytest.mark.parametrize("impl", implementations(OP, "cuda"))
def test_cuda_rejects_bad_arguments(impl):
    layout = ChunkLayout(1000, 100, 0.1, "chunk", "int8")
    args = chunk_arguments(layout)
    payload = torch.empty(layout.nbytes, dtype=torch.uint8, device=impl.device)
    decode = torch.ops.sparsecomm.chunk_decode_add
    with pytest.raises(RuntimeError, match="gathered must be"):
        decode(payload[:-1], *args, torch.zeros(1000, device=impl.device), True)
    with pytest.raises(RuntimeError, match="one device"):
        decode(payload.cpu(), *args, torch.zeros(1000, device=impl.device), True)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        decode(payload, *args, torch.zeros(1000, device=impl.device, dtype=torch.float64), True)


@pytest.mark.parametrize("impl,index_codec,value_codec", implementation_cases(OP, {
    "cpu": [("rice", "int2"), ("int32", "bf16"), ("chunk", "sign")],
    "cuda": [("rice", "int2"), ("int32", "bf16"), ("chunk", "sign"), ("rice", "fp16")]}))
def test_opcheck(impl, index_codec, value_codec):
    layout = ChunkLayout(10_003, 4096, 0.01, index_codec, value_codec)
    args = chunk_arguments(layout)
    # Finite data: opcheck compares outputs of repeated runs, and NaN != NaN there.
    grad, residual = (x.to(impl.device) for x in (chunk_data(10_003, 0, False), chunk_data(10_003, 1, False)))
    payload = torch.empty(layout.nbytes, dtype=torch.uint8, device=impl.device)
    torch.ops.sparsecomm.chunk_encode(grad, residual, 3.0, True, *args, payload)
    gathered = torch.cat([payload, payload])
    torch.library.opcheck(torch.ops.sparsecomm.chunk_decode_add.default,
                          (gathered, *args, torch.zeros(10_003, device=impl.device), True))
    if impl.family == "cuda":
        torch.library.opcheck(torch.ops.sparsecomm.chunk_decode_add.default,
                              (gathered, *args, torch.ones(10_003, device=impl.device, dtype=torch.bfloat16), False))


@pytest.mark.parametrize("impl", implementations(OP, "cuda"))
@pytest.mark.parametrize("value_codec", ["fp32", "int4", "sign", "fp8"])
@pytest.mark.parametrize("index_codec", ["int32", "chunk", "rice"])
def test_cuda_large_bucket_matches_the_cpu_kernel(impl, index_codec, value_codec):
    """2^24 + 1 entries (4097 chunks of 4096, the last of 1 entry), the CPU kernel's payloads
    and the device's own: compared with the native CPU kernel (bit-identical to the reference), which is faster."""
    n = 2**24 + 1
    layout = ChunkLayout(n, 4096, 0.01, index_codec, value_codec)
    grad, residual = chunk_data(n, 7, True), chunk_data(n, 8, False) * 0.1
    payload = torch.empty(layout.nbytes, dtype=torch.uint8)
    native.chunk_encode(grad, residual.clone(), 3.0, True, layout, payload)
    device_payload = encode(impl, ENCODER, layout, grad, residual, 3.0, True)[0]
    gathered = torch.cat([payload, device_payload, payload])
    want = torch.randn(n)
    out = want.to(impl.device, copy=True)
    native.chunk_decode_add(gathered, layout, want, False)
    impl.ops.chunk_decode_add(gathered.to(impl.device), layout, out, False)
    assert_same(out, want, "chunk_decode_add large")


@pytest.mark.parametrize("impl", implementations(OP, "triton")[1:])
def test_triton_no_host_synchronisation(impl):
    grad, residual = torch.randn(100_000, device=impl.device), torch.zeros(100_000, device=impl.device)
    for index_codec, value_codec in (("rice", "int4"), ("chunk", "bf16")):
        layout = ChunkLayout(100_000, 4096, 0.01, index_codec, value_codec)
        payload = torch.empty(layout.nbytes, dtype=torch.uint8, device=impl.device)
        impl.ops.chunk_encode(grad, residual, 2.0, True, layout, payload)
        gathered, out = torch.cat([payload, payload]), grad.clone()
        assert_no_host_synchronisation(lambda: impl.ops.chunk_decode_add(gathered, layout, out, False))


def _sm90_specs(triton_ops):
    """Variants of the chunk decoder's kernels (Rice walk, one row's entries added)."""
    decode = triton_ops.chunk_decode_add.__globals__
    i32 = "i32"
    add = dict(row_ptr="*u8", index_ptr="*i32", chunk_size=i32, chunks=i32, last_length=i32, k_full=i32,
               capacity=i32, scale_group=i32, index_start=i32, value_start=i32, value_end=i32)
    return [
        (decode["_rice_decode_kernel"], dict(gathered_ptr="*u8", index_ptr="*i32", row_stride=i32, index_start=i32,
                                             index_bytes=i32, chunk_size=i32, chunks=i32, last_length=i32,
                                             k_full=i32, k_last=i32, r_full=i32, r_last=i32, bits_full=i32,
                                             bits_last=i32, capacity=i32), {}, 1),
        (decode["_add_row_kernel"], dict(out_ptr="*bf16", **add),
         dict(INDEX_CODEC=2, INDEX_BITS=1, VALUE_CODEC=3, VALUE_BITS=8, BLOCK=1024), 4),
        (decode["_add_row_kernel"], dict(out_ptr="*fp32", **add),
         dict(INDEX_CODEC=1, INDEX_BITS=7, VALUE_CODEC=1, VALUE_BITS=16, BLOCK=1024), 4),
    ]


def test_triton_kernels_compile_for_sm90_without_a_gpu():
    assert_triton_kernels_compile_for_sm90(_sm90_specs)


# --------------------------------------------------------------------------- every CPU level


def cpu_level_cases() -> dict[str, LevelCase]:
    """Every codec pair on three geometries (3 payloads each), and 2 sealed rows on the first."""
    cases = {}
    for n, chunk_size, density in ((10_003, 4096, 0.01), (1003, 100, 0.3), (65_537, 65_536, 0.002)):
        for index_codec, value_codec in PAIRS:
            layout = ChunkLayout(n, chunk_size, density, index_codec, value_codec)
            what = f"n={n} chunk_size={chunk_size} density={density} {index_codec}+{value_codec}"
            cases[f"chunk_decode_add {what}"] = LevelCase(level_decode_case(OP, layout, 3, seed=n))
            if n == 10_003:
                cases[f"chunk_decode_add {what} sealed rows"] = LevelCase(
                    level_decode_case(OP, layout, 2, seed=n, gap=8))
    return cases


class TestEveryCpuLevel(CpuLevelTests):
    cases = cpu_level_cases
