"""Which implementation of an op runs (sparsecomm/ops/dispatch.py), and what happens when the
preferred one is missing: the native kernels on CPU, on CUDA the extension's kernels or Triton,
the reference when asked for or when nothing else takes a call (warning once, with the reason,
where a kernel is missing); a registered kernel first. The CPU level a fresh process runs at,
and the refusal of one its CPU lacks; the extension's codec tables; a machine without Triton.
The ops themselves: tests/test_op_*.py.
"""
import importlib
import json
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
from kernel_implementations import CPU_LEVELS, NEEDS_NATIVE, restore_triton_package, save_triton_package

from sparsecomm import ops
from sparsecomm.compress.chunk_layout import ChunkLayout
from sparsecomm.compress.index_codecs import INDEX_CODECS
from sparsecomm.compress.value_codecs import VALUE_CODECS
from sparsecomm.ops import dispatch, native, reference

LEVEL_PROCESS = Path(__file__).with_name("cpu_level_child.py")
SUBPROCESS_TIMEOUT = 120


@NEEDS_NATIVE
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


# --------------------------------------------------------------------------- the chunk ops: the layout too


def _cuda_like(dtype=torch.float32):
    """What _chunk_implementation reads of a tensor: its device type and dtype."""
    return types.SimpleNamespace(device=types.SimpleNamespace(type="cuda"), dtype=dtype)


EXACT_TOPK_OPS = ("exact_topk_encode", "exact_topk_decode_add")


@pytest.fixture
def fake_cuda(monkeypatch):
    """The dispatch as on a CUDA machine: Triton usable, and, when asked, the extension's CUDA
    kernels (which exact top-k on the compact wire has none of: native.has_kernel)."""
    pytest.importorskip("triton", reason="triton is not installed")
    from sparsecomm.ops import triton as triton_ops

    monkeypatch.delenv(native.KERNELS_ENV, raising=False)
    monkeypatch.setattr(triton_ops, "available", lambda device_type="cuda": (True, ""))
    state = {"native_cuda": False}
    monkeypatch.setattr(native, "load", lambda: (True, ""))
    monkeypatch.setattr(native, "has_kernel",
                        lambda op, key: key == "CPU" or (state["native_cuda"] and op not in EXACT_TOPK_OPS))
    return triton_ops, state


def test_chunk_ops_on_cuda(fake_cuda, monkeypatch):
    triton_ops, state = fake_cuda
    layout = ChunkLayout(10_000, 4096, 0.01, "rice", "int4")
    pick = dispatch._chunk_implementation
    # No native CUDA kernel: Triton, for 16-bit gradients too; the decode likewise.
    assert pick("chunk_encode", _cuda_like(), layout) is triton_ops.chunk_encode
    assert pick("chunk_encode", _cuda_like(torch.bfloat16), layout) is triton_ops.chunk_encode
    assert pick("chunk_decode_add", _cuda_like(torch.float16), layout) is triton_ops.chunk_decode_add
    # What the Triton kernels do not take: the reference.
    assert pick("chunk_encode", _cuda_like(), ChunkLayout(40_000, 16384, 0.01, "rice", "int4")) \
        is reference.chunk_encode
    assert pick("chunk_encode", _cuda_like(), ChunkLayout(10_000, 4096, 0.01, "rice", "int4", scale_group=64)) \
        is reference.chunk_encode
    # Exact top-k on the compact wire (a scale_group, one chunk): its ops, by Triton.
    exact = ChunkLayout(10_000, 10_000, 0.01, "rice", "int4", scale_group=64)
    assert pick("chunk_encode", _cuda_like(torch.float16), exact) is triton_ops.exact_topk_encode
    assert pick("chunk_decode_add", _cuda_like(), exact) is triton_ops.exact_topk_decode_add
    assert pick("chunk_encode", _cuda_like(torch.float64), layout) is reference.chunk_encode
    # A native CUDA kernel wins (float32 gradients), unless SPARSECOMM_KERNELS=triton.
    state["native_cuda"] = True
    assert pick("chunk_encode", _cuda_like(), layout) is native.chunk_encode
    assert pick("chunk_decode_add", _cuda_like(torch.bfloat16), layout) is native.chunk_decode_add
    assert pick("chunk_encode", _cuda_like(torch.bfloat16), layout) is triton_ops.chunk_encode
    assert pick("chunk_encode", _cuda_like(), ChunkLayout(70_000, 65536, 0.01, "rice", "int4")) \
        is native.chunk_encode
    assert pick("chunk_encode", _cuda_like(), exact) is triton_ops.exact_topk_encode  # no CUDA kernel takes it
    monkeypatch.setenv(native.KERNELS_ENV, "triton")
    assert pick("chunk_encode", _cuda_like(), layout) is triton_ops.chunk_encode
    monkeypatch.setenv(native.KERNELS_ENV, "native")
    assert pick("chunk_encode", _cuda_like(), layout) is native.chunk_encode
    monkeypatch.setenv(native.KERNELS_ENV, "reference")
    assert pick("chunk_encode", _cuda_like(), layout) is reference.chunk_encode
    assert pick("chunk_decode_add", _cuda_like(), layout) is reference.chunk_decode_add
    assert pick("chunk_encode", _cuda_like(), exact) is reference.exact_topk_encode
    assert not dispatch.native_chunk_encode(_cuda_like(), layout)
    # Neither: native required raises, auto warns once and takes the reference.
    state["native_cuda"] = False
    monkeypatch.setenv(native.KERNELS_ENV, "native")
    with pytest.raises(RuntimeError, match="SPARSECOMM_KERNELS=native"):
        pick("chunk_encode", _cuda_like(), layout)
    monkeypatch.delenv(native.KERNELS_ENV)
    assert dispatch.native_chunk_encode(_cuda_like(), layout)  # Triton is a kernel
    monkeypatch.setattr(triton_ops, "available", lambda device_type="cuda": (False, "no triton (test)"))
    native.warn_unavailable.cache_clear()
    with pytest.warns(native.NativeKernelsUnavailableWarning, match="no triton"):
        assert pick("chunk_encode", _cuda_like(), layout) is reference.chunk_encode
        assert not dispatch.native_chunk_encode(_cuda_like(), layout)
    native.warn_unavailable.cache_clear()


@NEEDS_NATIVE
def test_chunk_ops_on_cpu_keep_the_native_kernels(monkeypatch):
    monkeypatch.delenv(native.KERNELS_ENV, raising=False)
    layout = ChunkLayout(5000, 1024, 0.02, "rice", "int4")
    grad = torch.zeros(5000)
    assert dispatch._chunk_implementation("chunk_encode", grad, layout) is native.chunk_encode
    assert dispatch._chunk_implementation("chunk_decode_add", grad, layout) is native.chunk_decode_add
    assert dispatch.native_chunk_encode(grad, layout)
    assert not dispatch.native_chunk_encode(grad.bfloat16(), layout)  # 16-bit: the reference on CPU
    monkeypatch.setenv(native.KERNELS_ENV, "triton")  # Triton never runs on CPU tensors
    assert dispatch._chunk_implementation("chunk_encode", grad, layout) is native.chunk_encode
    monkeypatch.setenv(native.KERNELS_ENV, "reference")
    assert dispatch._chunk_implementation("chunk_encode", grad, layout) is reference.chunk_encode
    assert not dispatch.native_chunk_encode(grad, layout)


@NEEDS_NATIVE
def test_the_extension_names_the_codecs_of_the_python_tables(monkeypatch):
    index_names, value_names = torch.ops.sparsecomm.chunk_codecs()
    assert tuple(index_names) == INDEX_CODECS and tuple(value_names) == VALUE_CODECS
    from sparsecomm.compress import value_codecs

    monkeypatch.setattr(value_codecs, "VALUE_CODECS", ("fp32", "bf16", "fp16", "fp8", "int8", "int2", "int4", "sign"))
    with pytest.raises(RuntimeError, match="value codecs .* rebuild the extension"):
        native._check_codec_ids()


def test_import_without_triton_is_harmless(monkeypatch):
    """Without triton, importing works, available() says why, and calling raises ImportError."""
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    saved = save_triton_package()
    try:
        module = importlib.import_module("sparsecomm.ops.triton")
        usable, reason = module.available()
        assert not usable and "triton" in reason
        with pytest.raises(ImportError, match="triton"):
            module.ef_topk_pack(torch.zeros(3), None, 1, False, 1, torch.empty(1, dtype=torch.int32),
                                torch.empty(1))
        with pytest.raises(ImportError, match="triton"):
            module.exact_topk_encode(torch.zeros(3), None, 1, False, None, torch.empty(1, dtype=torch.uint8))
    finally:
        restore_triton_package(saved)


# --------------------------------------------------------------------------- the CPU level of a process


def _level_process(level: str | None, what: str):
    """cpu_level_child.py run as a script (a fresh interpreter) at ``level`` (None: the variable unset)."""
    import os
    import subprocess

    env = dict(os.environ)
    env.pop("SPARSECOMM_CPU_CAPABILITY", None)
    if level is not None:
        env["SPARSECOMM_CPU_CAPABILITY"] = level
    result = subprocess.run([sys.executable, str(LEVEL_PROCESS), what], env=env, capture_output=True, text=True,
                            timeout=SUBPROCESS_TIMEOUT)
    assert result.returncode == 0, f"level {level}: {result.stdout}\n{result.stderr}"
    return result


@NEEDS_NATIVE
def test_without_the_variable_the_widest_supported_level_runs():
    assert _level_process(None, "report").stdout.strip() == CPU_LEVELS[-1]
    assert native.compiled_cpu_levels()[0] == "default" and set(CPU_LEVELS) <= set(native.compiled_cpu_levels())


# Levels that must be refused here: a name no build has, and any level this CPU or build lacks.
REFUSED = ("avx1024",) + tuple(level for level in ("avx2", "avx512") if level not in CPU_LEVELS)


@NEEDS_NATIVE
@pytest.mark.parametrize("level", REFUSED)
def test_a_level_this_cpu_lacks_is_refused_with_the_choices(level):
    messages = json.loads(_level_process(level, "refuse").stdout)
    # Asking for the level and calling a kernel both fail, naming the variable, the value and
    # the levels this CPU supports; no kernel runs.
    assert messages["cpu_capability"] is not None and messages["kernel"] == messages["cpu_capability"]
    assert f"SPARSECOMM_CPU_CAPABILITY={level}" in messages["kernel"]
    assert f"supports: {', '.join(CPU_LEVELS)}" in messages["kernel"]
