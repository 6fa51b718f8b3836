"""Every CPU level of the native kernels (csrc/README.md, "CPU levels") computes the same bytes.

A process chooses its level once (when the native library loads), so each level runs in a
process of its own with SPARSECOMM_CPU_CAPABILITY set: forked from the tests' fork server
(tests/multiprocess.py: torch imported, the library not loaded; tests/cpu_level_child.py
sets the variable before anything loads it). The checks of what a fresh interpreter does
(no variable; a level this CPU lacks) start this file as a script instead. It runs every CPU
operator on fixed-seed inputs: odd sizes (the 8- and 16-lane loops end in scalar tails),
NaN and +-Inf among the values, every dtype pair at one size, buckets of >= 2^20 entries
for the sampled one-pass strategies, and the chunked-selection ops with every codec pair,
per-chunk and as exact top-k on the compact wire (scale_group).
Outputs must match the pure-torch reference (sparsecomm/ops/reference.py) as
tests/test_kernels.py compares them, and the levels must agree byte for byte, payload
order included.
"""
import functools
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
from kernel_cases import FP16_SATURATION, check_fp16_saturation, fp16_saturation_grad

from sparsecomm import ops
from sparsecomm.compress.chunk_layout import ChunkLayout
from sparsecomm.compress.index_codecs import INDEX_CODECS
from sparsecomm.compress.packing import payload_nbytes
from sparsecomm.compress.value_codecs import VALUE_CODECS
from sparsecomm.ops import native, reference

LOADED, WHY_NOT = native.load()
SUPPORTED = native.supported_cpu_levels() if LOADED else ()
# Levels that must be refused here: a name no build has, and any level this CPU or build lacks.
REFUSED = ("avx1024",) + tuple(level for level in ("avx2", "avx512") if level not in SUPPORTED)
pytestmark = [pytest.mark.skipif(not LOADED, reason=f"native extension not built: {WHY_NOT}"),
              pytest.mark.timeout(300)]

SUBPROCESS_TIMEOUT = 120
INF, NAN = float("inf"), float("nan")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PAIRS = [(g, v) for g in DTYPES for v in DTYPES]
FP32 = [(torch.float32, torch.float32)]  # the pair with hand-written vector loops
SAMPLED = 2**20 + 3  # ef_topk_pack (and chunk_encode with a scale_group) take their one-pass strategy from 2^20 entries
OFFSET = 5


def _inputs(n, dtype, seed):
    """A randn gradient with NaN, +Inf and -Inf at three places, and a small residual."""
    generator = torch.Generator().manual_seed(seed)
    grad = torch.randn(n, generator=generator)
    residual = torch.randn(n, generator=generator) * 0.1
    if n >= 7:
        grad[[1, n // 2, n - 2]] = torch.tensor([NAN, INF, -INF])
    return grad.to(dtype), residual.to(dtype)


def _topk(grad, residual, divisor, add_residual, k, value_dtype):
    def run(impl):
        r = None if residual is None else residual.clone()
        indices = torch.full((k,), -1, dtype=torch.int32)
        values = torch.empty(k, dtype=value_dtype)
        impl.ef_topk_pack(grad, r, divisor, add_residual, k, indices, values, OFFSET)
        return [indices, values] + ([] if r is None else [r])
    return run


def _threshold(grad, residual, divisor, add_residual, threshold, capacity, value_dtype):
    def run(impl):
        r = None if residual is None else residual.clone()
        indices = torch.full((capacity,), -1, dtype=torch.int32)
        values = torch.full((capacity,), 7.0, dtype=value_dtype)
        count = impl.ef_threshold_pack(grad, r, divisor, add_residual, threshold, indices, values, OFFSET)
        return [count.reshape(1), indices, values] + ([] if r is None else [r])
    return run


def _unpack(n, k, world_size, out_dtype, value_dtype, zero_out, seed):
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

    def run(impl):
        out = start.clone()[1:]  # not 64-byte aligned: the streaming stores' head and tail run
        impl.unpack_add(indices, values, out, zero_out)
        return [out]
    return run


def _crc32c(rows, n, seed):
    data = torch.randint(0, 256, (rows, n + 11), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    data = data[:, 3 : 3 + n]  # strided rows, unaligned: the 8-byte loads' head and tail

    def run(impl):
        return [impl.crc32c(data), impl.crc32c(data[0])]
    return run


def _chunk_encode(grad, residual, divisor, add_residual, layout):
    def run(impl):
        r = None if residual is None else residual.clone()
        payload = torch.full((layout.nbytes,), 0xAB, dtype=torch.uint8)
        indices, decoded = impl.chunk_encode(grad, r, divisor, add_residual, layout, payload)
        return [payload, indices, decoded] + ([] if r is None else [r])
    return run


# Reference payloads, the inputs of the chunk_decode_add cases, by (layout, seed): encoded once
# by the parent, which hands them to each level's subprocess in a file (the "run" command's third argument).
_PAYLOADS: dict[str, torch.Tensor] = {}


def _payload(layout, seed):
    key = (f"{layout.numel} {layout.chunk_size} {layout.density} {layout.index_codec} {layout.value_codec} "
           f"{layout.scale_group} {seed}")
    if key not in _PAYLOADS:
        grad, residual = _inputs(layout.numel, torch.float32, seed=seed)
        payload = torch.empty(layout.nbytes, dtype=torch.uint8)
        reference.chunk_encode(grad, residual, 2.0, True, layout, payload)
        _PAYLOADS[key] = payload
    return _PAYLOADS[key]


def _chunk_decode_add(layout, world_size, seed, gap=0):
    rows = []
    for rank in range(world_size):
        payload = torch.empty(layout.nbytes + gap, dtype=torch.uint8)
        payload[: layout.nbytes] = _payload(layout, seed + rank)
        rows.append(payload)
    # gap > 0: payloads farther apart than their size (sealed, each followed by its trailer).
    gathered = torch.stack(rows)[:, : layout.nbytes] if gap else torch.cat(rows)

    def run(impl):
        out = torch.randn(layout.numel + 1)[1:]
        impl.chunk_decode_add(gathered, layout, out, True)
        return [out]
    return run


@dataclass(frozen=True)
class Case:
    run: Callable  # impl (native or reference) -> list of output tensors
    unordered: bool = False  # a payload in unspecified order: compared with the reference sorted by index


@functools.cache
def cases() -> dict[str, Case]:
    found = {}
    for n in (1, 7, 1003, 65_537, SAMPLED):
        for dtype, value_dtype in PAIRS if n == 1003 else FP32:
            grad, residual = _inputs(n, dtype, seed=n)
            for k in sorted({1, max(1, n // 100), n}) if n < SAMPLED else (n // 100,):
                for divisor, add_residual, r in ((3.0, True, residual), (2.0, False, None)):
                    name = f"ef_topk_pack n={n} {dtype}->{value_dtype} k={k} residual={r is not None}"
                    found[name] = Case(_topk(grad, r, divisor, add_residual, k, value_dtype), unordered=True)
    for n in (7, 1003, 65_537, SAMPLED):
        for dtype, value_dtype in PAIRS if n == 1003 else FP32:
            grad, residual = _inputs(n, dtype, seed=n + 1)
            settings = [(1.5, max(1, n // 50))] if n == SAMPLED else [(1.5, n), (1.5, max(1, n // 50)), (INF, 2),
                                                                       (NAN, n)]
            for threshold, capacity in settings:
                for divisor, add_residual, r in ((3.0, True, residual), (2.0, False, None)):
                    name = (f"ef_threshold_pack n={n} {dtype}->{value_dtype} threshold={threshold} "
                            f"capacity={capacity} residual={r is not None}")
                    found[name] = Case(_threshold(grad, r, divisor, add_residual, threshold, capacity, value_dtype))
    for n, k, world_size in ((1003, 300, 3), (65_537, 6_000, 2)):
        for out_dtype, value_dtype in PAIRS if n == 1003 else FP32:
            for zero_out in (True, False):
                name = f"unpack_add n={n} {value_dtype}->{out_dtype} world_size={world_size} zero_out={zero_out}"
                found[name] = Case(_unpack(n, k, world_size, out_dtype, value_dtype, zero_out, seed=n))
    for n, chunk_size, density in ((10_003, 4096, 0.01), (1003, 100, 0.3), (65_537, 65_536, 0.002)):
        grad, residual = _inputs(n, torch.float32, seed=n + 3)
        for index_codec in INDEX_CODECS:
            for value_codec in VALUE_CODECS:
                layout = ChunkLayout(n, chunk_size, density, index_codec, value_codec)
                what = f"n={n} chunk_size={chunk_size} density={density} {index_codec}+{value_codec}"
                for divisor, add_residual, r in ((3.0, True, residual), (2.0, False, None)):
                    found[f"chunk_encode {what} residual={r is not None}"] = Case(
                        _chunk_encode(grad, r, divisor, add_residual, layout))
                found[f"chunk_decode_add {what}"] = Case(_chunk_decode_add(layout, 3, seed=n))
                if n == 10_003:
                    found[f"chunk_decode_add {what} sealed rows"] = Case(_chunk_decode_add(layout, 2, seed=n, gap=8))
    # Exact top-k on the compact wire: one chunk of the bucket, scales per 64 payload entries
    # (csrc/cpu/compact_encode.cpp); the large bucket takes the sampled selection.
    for n, density, pairs in ((10_003, 0.01, [(i, v) for i in INDEX_CODECS for v in VALUE_CODECS]),
                              (SAMPLED, 0.01, [("rice", "int4"), ("rice", "int2"), ("chunk", "sign")])):
        grad, residual = _inputs(n, torch.float32, seed=n + 4)
        for index_codec, value_codec in pairs:
            layout = ChunkLayout(n, n, density, index_codec, value_codec, scale_group=64)
            what = f"n={n} density={density} {index_codec}+{value_codec} scale_group=64"
            for divisor, add_residual, r in ((3.0, True, residual), (2.0, False, None)):
                found[f"chunk_encode {what} residual={r is not None}"] = Case(
                    _chunk_encode(grad, r, divisor, add_residual, layout))
            found[f"chunk_decode_add {what}"] = Case(_chunk_decode_add(layout, 2, seed=n))
    for rows, n in ((1, 0), (3, 7), (2, 1537), (4, 3 * 1536 + 13), (2, 100_003)):
        found[f"crc32c rows={rows} n={n}"] = Case(_crc32c(rows, n, seed=n))
    found.update({name: case for name, (case, _) in saturation_cases().items()})
    return found


@functools.cache
def saturation_cases() -> dict[str, tuple[Case, torch.Tensor]]:
    """name -> (case, acc): the fp16 wire and codec on kernel_cases.FP16_SATURATION's accs,
    whose outputs are also checked against those hand-worked values."""
    found = {}
    for dtype in FP16_SATURATION:
        grad, k = fp16_saturation_grad(dtype)
        for n in (grad.numel(), SAMPLED):
            acc = torch.cat([grad, torch.randn(n - grad.numel(), generator=torch.Generator().manual_seed(n)).to(dtype)])
            zeros = torch.zeros(n, dtype=dtype)
            found[f"fp16 saturation ef_topk_pack n={n} {dtype}"] = (
                Case(_topk(acc, zeros, 1.0, True, k, torch.float16), unordered=True), acc)
            found[f"fp16 saturation ef_threshold_pack n={n} {dtype}"] = (
                Case(_threshold(acc, zeros, 1.0, True, 1000.0, k, torch.float16)), acc)
            if dtype == torch.float32:  # the chunk kernels' dtype
                scale_group = 64 if n == SAMPLED else 0  # exact top-k on the compact wire, or one chunk
                layout = ChunkLayout(n, n, k / n, "rice", "fp16", scale_group)
                found[f"fp16 saturation chunk_encode n={n} scale_group={scale_group}"] = (
                    Case(_chunk_encode(acc, zeros, 1.0, True, layout)), acc)
    return found


# ----- the subprocess --------------------------------------------------------------------


def _run_every_case(path: str, payloads: str | None = None) -> None:
    if payloads is not None:
        _PAYLOADS.update(torch.load(payloads))
    results = {name: [t.clone() for t in case.run(native)] for name, case in cases().items()}
    torch.save({"capability": native.cpu_capability(), "results": results}, path)


def _report_refusal() -> None:
    messages = {}
    for what, call in (("cpu_capability", native.cpu_capability),
                       ("kernel", lambda: native.crc32c(torch.zeros(3, dtype=torch.uint8)))):
        try:
            call()
            messages[what] = None
        except RuntimeError as error:
            messages[what] = str(error)
    print(json.dumps(messages))


def _subprocess(level: str | None, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("SPARSECOMM_CPU_CAPABILITY", None)
    if level is not None:
        env["SPARSECOMM_CPU_CAPABILITY"] = level
    result = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True,
                            timeout=SUBPROCESS_TIMEOUT)
    assert result.returncode == 0, f"level {level}: {result.stdout}\n{result.stderr}"
    return result


def _forked(level: str, path: Path, payloads: Path) -> None:
    """Every case at ``level`` (saved to ``path``) in a process forked from the tests' fork server."""
    import cpu_level_child
    from multiprocess import _context

    env = dict(os.environ)
    env["SPARSECOMM_CPU_CAPABILITY"] = level
    process = _context().Process(target=cpu_level_child.run, args=(env, str(path), str(payloads)))
    process.start()
    process.join(SUBPROCESS_TIMEOUT)
    if process.is_alive():
        process.kill()
        process.join()
        pytest.fail(f"level {level}: still running after {SUBPROCESS_TIMEOUT} s, killed")
    error = Path(f"{path}.error")
    assert process.exitcode == 0, f"level {level}: exit code {process.exitcode}\n" + (
        error.read_text() if error.exists() else "")


# ----- the tests -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def level_results(tmp_path_factory) -> dict:
    """level -> {"capability": the level its process reported, "results": name -> outputs}."""
    folder = tmp_path_factory.mktemp("levels")
    cases()  # encodes the reference payloads once, for every level
    payloads = folder / "payloads.pt"
    torch.save(_PAYLOADS, payloads)
    found = {}
    for level in SUPPORTED:
        path = folder / f"{level}.pt"
        _forked(level, path, payloads)
        found[level] = torch.load(path)
    return found


@pytest.fixture(scope="module")
def expected() -> dict:
    """The reference's outputs."""
    return {name: case.run(reference) for name, case in cases().items()}


def _assert_matches_reference(name, want, got, unordered):
    if unordered:
        order_want, order_got = torch.argsort(want[0].long()), torch.argsort(got[0].long())
        want = [want[0][order_want], want[1][order_want], *want[2:]]
        got = [got[0][order_got], got[1][order_got], *got[2:]]
    assert len(want) == len(got), name
    for position, (w, g) in enumerate(zip(want, got)):
        assert w.dtype == g.dtype and w.shape == g.shape, (name, position)
        if w.is_floating_point():  # NaN at the same places (their bits are unspecified), all else bitwise
            nan = torch.isnan(w)
            assert torch.equal(nan, torch.isnan(g)), (name, position)
            w, g = w[~nan], g[~nan]
        assert torch.equal(w.reshape(-1).view(torch.uint8), g.reshape(-1).view(torch.uint8)), (name, position)


@pytest.mark.parametrize("level", SUPPORTED)
def test_the_subprocess_runs_the_level_it_was_given(level_results, level):
    assert level_results[level]["capability"] == level


@pytest.mark.parametrize("level", SUPPORTED)
def test_every_operator_matches_the_reference(level_results, expected, level):
    results = level_results[level]["results"]
    for name, case in cases().items():
        _assert_matches_reference(name, expected[name], results[name], case.unordered)


@pytest.mark.parametrize("level", SUPPORTED)
def test_fp16_saturation_conserves_every_finite_acc(level_results, level):
    """Beyond the reference: the hand-worked values of kernel_cases.FP16_SATURATION."""
    results = level_results[level]["results"]
    for name, (_, acc) in saturation_cases().items():
        if " ef_topk_pack " in name:
            indices, values, residual = results[name]
        elif " ef_threshold_pack " in name:
            count, indices, values, residual = results[name]
            assert int(count) == indices.numel(), name
        else:  # chunk_encode: bucket-relative indices
            _, indices, values, residual = results[name]
            indices = indices + OFFSET
        check_fp16_saturation(acc, indices.long() - OFFSET, values, residual)


def test_every_level_gives_the_same_bytes(level_results):
    first, *others = SUPPORTED
    for level in others:
        for name, outputs in level_results[first]["results"].items():
            for position, (a, b) in enumerate(zip(outputs, level_results[level]["results"][name])):
                assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), \
                    f"{name}, output {position}: {first} and {level} differ"


def test_without_the_variable_the_widest_supported_level_runs():
    result = _subprocess(None, "report")
    assert result.stdout.strip() == SUPPORTED[-1]
    assert native.compiled_cpu_levels()[0] == "default" and set(SUPPORTED) <= set(native.compiled_cpu_levels())


@pytest.mark.parametrize("level", REFUSED)
def test_a_level_this_cpu_lacks_is_refused_with_the_choices(level):
    messages = json.loads(_subprocess(level, "refuse").stdout)
    # Asking for the level and calling a kernel both fail, naming the variable, the value and
    # the levels this CPU supports; no kernel runs.
    assert messages["cpu_capability"] is not None and messages["kernel"] == messages["cpu_capability"]
    assert f"SPARSECOMM_CPU_CAPABILITY={level}" in messages["kernel"]
    assert f"supports: {', '.join(SUPPORTED)}" in messages["kernel"]


if __name__ == "__main__":
    if sys.argv[1] == "run":
        _run_every_case(*sys.argv[2:4])
    elif sys.argv[1] == "refuse":
        _report_refusal()
    else:  # report
        print(native.cpu_capability())
