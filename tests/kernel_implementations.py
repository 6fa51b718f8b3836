"""The implementations of the kernel ops, which the op tests (tests/test_op_*.py, one file per
op) compare with the oracle, the pure-torch reference (sparsecomm/ops/reference.py):

* ``reference``: the oracle itself, where a test checks it against values worked by hand;
* ``cpu``: the native CPU kernels (sparsecomm._C) at this process's CPU level, the widest this
  CPU supports (unless SPARSECOMM_CPU_CAPABILITY names another);
* every CPU level this CPU supports, each in a process of its own, since a process chooses its
  level once, when the native library loads (:class:`CpuLevelRuns`);
* ``triton-interpreter``: the Triton kernels on CPU tensors under ``TRITON_INTERPRET=1``; the
  interpreter is slow, so the tests give it small sizes;
* ``triton-cuda``: the same kernels compiled, on CUDA tensors (a GPU);
* ``cuda``: the extension's CUDA kernels (a GPU and an extension built with them).

:func:`implementations` gives the pytest parameters of an op's implementations, each skipped,
with the reason, where it cannot run. The oracle runs on CPU copies of the inputs, so it shares
no CUDA code path with the kernels (torch's CUDA ``tensor.div(python_scalar)`` multiplies by
the reciprocal; the contract, torch on CPU and the kernels divide). Implementations of the same
family (the two Triton ones) run the same cases.

Interpreter mode: Triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` runs, i.e. when a
module defining kernels is imported, not when they are launched (triton.language's own jit
functions, tl.sum, tl.zeros, ..., are fixed when *triton* is first imported; the kernels use
none of them, so only the import of sparsecomm.ops.triton matters). Setting the variable at the
top of a test file is not robust (another test may already have imported the package), so
:func:`fresh_triton` imports a private copy of ``sparsecomm.ops.triton`` with the variable set
(interpreter) or cleared (compiled) and then restores ``sys.modules``, the environment and
``sparsecomm.ops.triton`` exactly as they were; the copy's kernels keep their mode. It checks
the mode it got, so a Triton that changed this behaviour fails loudly instead of silently
testing the wrong thing.
"""
import functools
import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import pytest
import torch

import sparsecomm.ops
from sparsecomm.ops import native, reference

NATIVE_LOADED, NATIVE_MISSING = native.load()
FLOAT_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
_TRITON_PACKAGE = "sparsecomm.ops.triton"
_ABSENT = object()


def fresh_triton(interpret: bool):
    """A private import of sparsecomm.ops.triton whose kernels are interpreted (or compiled)."""
    import triton

    saved = save_triton_package()
    saved_env = os.environ.get("TRITON_INTERPRET")
    knobs = getattr(triton, "knobs", None)
    saved_knob = knobs.runtime.__dict__.pop("interpret", _ABSENT) if knobs is not None else _ABSENT
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        module = importlib.import_module(_TRITON_PACKAGE)
    finally:
        restore_triton_package(saved)
        if saved_env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved_env
        if saved_knob is not _ABSENT:
            knobs.runtime.__dict__["interpret"] = saved_knob
    assert module.interpreting() == interpret, "Triton did not honour TRITON_INTERPRET at import time"
    return module


def _triton_modules() -> list[str]:
    return [name for name in sys.modules if name == _TRITON_PACKAGE or name.startswith(_TRITON_PACKAGE + ".")]


def save_triton_package() -> tuple[dict, object]:
    """Take sparsecomm.ops.triton out of sys.modules (and of sparsecomm.ops), so that the next
    import is a fresh one: what :func:`restore_triton_package` puts back."""
    return {name: sys.modules.pop(name) for name in _triton_modules()}, sparsecomm.ops.__dict__.get("triton", _ABSENT)


def restore_triton_package(saved: tuple[dict, object]) -> None:
    """Put sparsecomm.ops.triton (its modules and the attribute of sparsecomm.ops) back as
    :func:`save_triton_package` found it."""
    saved_modules, saved_attr = saved
    for name in _triton_modules():
        del sys.modules[name]
    sys.modules.update(saved_modules)
    if saved_attr is _ABSENT:
        sparsecomm.ops.__dict__.pop("triton", None)
    else:
        sparsecomm.ops.triton = saved_attr


@functools.cache
def _triton_module(interpret: bool):
    return fresh_triton(interpret)


def _triton_missing(device: str) -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if device == "cuda" and not torch.cuda.is_available():
        return "no CUDA device is available"
    return None


def _cuda_missing(op: str) -> str | None:
    if not torch.cuda.is_available():
        return "CUDA is not available (torch.cuda.is_available() is False)"
    if not NATIVE_LOADED:
        return (f"sparsecomm._C cannot be imported ({NATIVE_MISSING}); build it with "
                "USE_CUDA=1 SPARSECOMM_BUILD_EXT=1 pip install --no-build-isolation -e .")
    if not native.has_kernel(op, "CUDA"):
        return f"sparsecomm._C has no CUDA kernel for {op} (built without CUDA sources)"
    return None


@dataclass(frozen=True, eq=False)
class Implementation:
    """One implementation of the ops: its functions have the reference's signatures."""

    name: str  # the pytest id
    family: str  # "reference", "cpu", "triton" or "cuda": implementations of a family run the same cases
    device: torch.device  # where its tensors live
    load: Callable  # () -> the module of its functions
    missing: Callable[[str], str | None]  # op -> why it cannot run here (None: it can)
    # NaN payload bits as the reference's: CPU arithmetic keeps the operand's NaN, GPU
    # arithmetic (and the interpreter's numpy) returns a canonical one, so elsewhere NaNs are
    # compared as values (any NaN matches any NaN), never as bits.
    nan_bits: bool

    @property
    def ops(self):
        """The module (reference, native, or a private import of sparsecomm.ops.triton)."""
        module = self.load()
        if self.family == "triton":
            usable, reason = module.available(self.device.type)
            if not usable:
                pytest.skip(f"Triton backend unusable: {reason}")
        return module

    def __repr__(self) -> str:
        return self.name


REFERENCE = Implementation("reference", "reference", torch.device("cpu"), lambda: reference, lambda op: None, True)
CPU = Implementation("cpu", "cpu", torch.device("cpu"), lambda: native,
                     lambda op: None if NATIVE_LOADED else f"native extension not built: {NATIVE_MISSING}", True)
TRITON_INTERPRETER = Implementation("triton-interpreter", "triton", torch.device("cpu"),
                                    lambda: _triton_module(True), lambda op: _triton_missing("cpu"), False)
TRITON_CUDA = Implementation("triton-cuda", "triton", torch.device("cuda"), lambda: _triton_module(False),
                             lambda op: _triton_missing("cuda"), False)
CUDA = Implementation("cuda", "cuda", torch.device("cuda"), lambda: native, _cuda_missing, False)
# What the hook calls (sparsecomm.ops.dispatch) on CPU tensors: for tests of the choice itself.
DISPATCH = Implementation("dispatch", "dispatch", torch.device("cpu"), lambda: sparsecomm.ops.dispatch,
                          lambda op: None, True)
_FAMILIES = {"reference": (REFERENCE,), "cpu": (CPU,), "triton": (TRITON_INTERPRETER, TRITON_CUDA), "cuda": (CUDA,)}


def _param(op: str, impl: Implementation, case: tuple = (), case_id: str = ""):
    reason = impl.missing(op)
    marks = [pytest.mark.skipif(reason is not None, reason=str(reason))]
    return pytest.param(impl, *case, id=f"{impl.name}-{case_id}" if case_id else impl.name, marks=marks)


def implementations(op: str, *families: str) -> list:
    """pytest parameters: the implementations of ``op`` in ``families`` (see :data:`_FAMILIES`)."""
    return [_param(op, impl, ()) for family in families for impl in _FAMILIES[family]]


def implementation_cases(op: str, cases: dict[str, Iterable[tuple]]) -> list:
    """pytest parameters ``(implementation, *case)``: each family's implementations with that
    family's own cases (``family -> cases``), the case values in the id."""
    return [_param(op, impl, tuple(case), "-".join(_value_id(value) for value in case))
            for family, family_cases in cases.items() for case in family_cases for impl in _FAMILIES[family]]


def _value_id(value) -> str:
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    if isinstance(value, tuple):
        return "x".join(_value_id(v) for v in value)
    return str(value)


def dtype_id(value) -> str:
    """A parametrize id for dtypes and other values: float32, not torch.float32."""
    return _value_id(value)


# --------------------------------------------------------------------------- comparisons


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor (a copy when it is not contiguous)."""
    return tensor.contiguous().view(torch.uint8)


def assert_same(actual, expected, what="", nan_ok=True) -> None:
    """Bitwise equality on the CPU; floating NaNs match any NaN (their bits are not compared),
    unless ``nan_ok`` is False: then any NaN fails."""
    actual, expected = actual.detach().cpu().reshape(-1), expected.detach().cpu().reshape(-1)
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} vs {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
    if not actual.is_floating_point():
        assert torch.equal(actual, expected), f"{what}: differ at {torch.nonzero(actual != expected)[:10].flatten()}"
        return
    nan_a, nan_e = torch.isnan(actual), torch.isnan(expected)
    if not nan_ok:
        assert not bool(nan_a.any()) and not bool(nan_e.any()), \
            f"{what}: NaN at {torch.nonzero(nan_a | nan_e)[:10].flatten()} (not allowed here)"
    assert torch.equal(nan_a, nan_e), f"{what}: NaN positions differ at {torch.nonzero(nan_a != nan_e)[:10].flatten()}"
    a, e = bits(actual[~nan_a]), bits(expected[~nan_e])
    if not torch.equal(a, e):
        size = actual.element_size()
        bad = torch.nonzero((a != e).view(-1, size).any(1)).flatten()
        raise AssertionError(f"{what}: {bad.numel()} values differ, first at {bad[:5].tolist()}: "
                             f"{actual[~nan_a][bad[:5]].tolist()} vs {expected[~nan_e][bad[:5]].tolist()}")


# --------------------------------------------------------------------------- compiling for a GPU without one


def assert_triton_kernels_compile_for_sm90(specs: Callable) -> None:
    """Every kernel variant of ``specs(module)`` -> [(kernel, signature types, constexprs,
    num_warps)] goes through Triton's whole CUDA pipeline (TTIR, TTGIR, LLVM, PTX, ptxas cubin)
    for sm_90, so a GPU-only compile error shows up on CPU-only machines too; the PTX divides
    exactly and keeps subnormals."""
    pytest.importorskip("triton", reason="triton is not installed")
    import triton
    from triton.compiler import ASTSource

    try:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except Exception as error:  # pragma: no cover - a Triton without the NVIDIA backend
        pytest.skip(f"Triton's NVIDIA backend is unavailable: {error}")
    target = GPUTarget("cuda", 90, 32)
    for kernel, types, constexprs, num_warps in specs(_triton_module(False)):
        signature = {name: types.get(name, "constexpr") for name in kernel.arg_names}
        assert set(signature) == set(types) | set(constexprs), (kernel.__name__, signature)
        compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=target,
                                  options={"num_warps": num_warps, "enable_fp_fusion": False})
        ptx = compiled.asm["ptx"]
        assert "div.full" not in ptx and "div.approx" not in ptx, f"{kernel.__name__}: inexact division"
        assert ".ftz" not in ptx, f"{kernel.__name__}: flushes subnormals"


def assert_no_host_synchronisation(run: Callable) -> None:
    """``run()`` twice: once to warm up (compilation and first launches may synchronise), then
    under torch's sync debug mode, which raises on any synchronising CUDA call made through c10."""
    run()
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()


def capture_in_a_cuda_graph(step: Callable):
    """(a CUDA graph of ``step()``, what the captured call returned), after a warm-up call on a
    side stream. Capture fails on any host synchronisation or host read-back."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = step()
    return graph, result


# --------------------------------------------------------------------------- every CPU level
#
# A process chooses its CPU level once (when the native library loads), so each level runs in
# a process of its own with SPARSECOMM_CPU_CAPABILITY set: forked from the tests' fork server
# (tests/rank_processes.py: torch imported, the library not loaded; tests/cpu_level_child.py sets
# the variable before anything loads it, then imports the op's test module and runs its
# cpu_level_cases()). The outputs must match the reference's as the op tests compare them, and
# the levels must agree byte for byte, payload order included.

CPU_LEVELS = native.supported_cpu_levels() if NATIVE_LOADED else ()
NEEDS_NATIVE = pytest.mark.skipif(not NATIVE_LOADED, reason=f"native extension not built: {NATIVE_MISSING}")
CPU_LEVEL_TIMEOUT = 120
# A level test runs when the extension is built; without it, one skipped parameter says why.
CPU_LEVEL_PARAMS = [pytest.param(level, id=f"cpu-{level}") for level in CPU_LEVELS] or [
    pytest.param(None, id="cpu-levels", marks=pytest.mark.skip(reason=f"native extension not built: {NATIVE_MISSING}"))]


@dataclass(frozen=True)
class LevelCase:
    """One call of an op at every CPU level, compared with the reference."""

    run: Callable  # implementation module (native or reference) -> list of output tensors
    unordered: bool = False  # a payload in unspecified order: compared with the reference sorted by index
    check: Callable | None = None  # outputs -> None: asserts more than equality with the reference


# Inputs the parent computes once (reference payloads), handed to every level's process in a file.
_PRECOMPUTED: dict[str, torch.Tensor] = {}


def precomputed(key: str, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``compute()``, once per key: the parent computes it, a level's process finds it."""
    if key not in _PRECOMPUTED:
        _PRECOMPUTED[key] = compute()
    return _PRECOMPUTED[key]


def load_precomputed(path: str) -> None:
    _PRECOMPUTED.update(torch.load(path))


class CpuLevelRuns:
    """The cases of one op's test module (its ``cpu_level_cases()``) run at every CPU level this
    CPU supports (a forked process each), and by the reference here."""

    def __init__(self, cases: Callable[[], dict[str, LevelCase]], folder: Path):
        self.cases = cases()  # encodes the precomputed inputs once, for every level
        precomputed_inputs = folder / "precomputed.pt"
        torch.save(_PRECOMPUTED, precomputed_inputs)
        self.results = {level: self._run(cases.__module__, level, folder / f"{level}.pt", precomputed_inputs)
                        for level in CPU_LEVELS}
        self.expected = {name: case.run(reference) for name, case in self.cases.items()}

    @staticmethod
    def _run(module: str, level: str, path: Path, precomputed_inputs: Path) -> dict:
        import cpu_level_child
        from rank_processes import _context

        env = dict(os.environ)
        env["SPARSECOMM_CPU_CAPABILITY"] = level
        process = _context().Process(target=cpu_level_child.run,
                                     args=(env, module, str(path), str(precomputed_inputs)))
        process.start()
        process.join(CPU_LEVEL_TIMEOUT)
        if process.is_alive():
            process.kill()
            process.join()
            pytest.fail(f"level {level}: still running after {CPU_LEVEL_TIMEOUT} s, killed")
        error = Path(f"{path}.error")
        assert process.exitcode == 0, f"level {level}: exit code {process.exitcode}\n" + (
            error.read_text() if error.exists() else "")
        return torch.load(path)

    def check_against_reference(self, level: str) -> None:
        """The level's process ran at ``level``, and every case matches the reference (and its checks)."""
        assert self.results[level]["capability"] == level
        outputs = self.results[level]["results"]
        for name, case in self.cases.items():
            _assert_matches_reference(name, self.expected[name], outputs[name], case.unordered)
            if case.check is not None:
                case.check(outputs[name])

    def check_levels_agree(self) -> None:
        """Every level gives the same bytes, payload order included."""
        first, *others = CPU_LEVELS
        for level in others:
            for name, outputs in self.results[first]["results"].items():
                for position, (a, b) in enumerate(zip(outputs, self.results[level]["results"][name])):
                    assert torch.equal(bits(a.reshape(-1)), bits(b.reshape(-1))), \
                        f"{name}, output {position}: {first} and {level} differ"


class CpuLevelTests:
    """The tests of every CPU level, for an op's test file to subclass as ``class
    TestEveryCpuLevel(CpuLevelTests)`` with ``cases = cpu_level_cases``: its function of that
    name, which the level's process (cpu_level_child.py) calls too."""

    cases: Callable[[], dict[str, LevelCase]]

    @pytest.fixture(scope="class")
    @classmethod
    def runs(cls, tmp_path_factory) -> CpuLevelRuns:
        return CpuLevelRuns(cls.cases, tmp_path_factory.mktemp("levels"))

    @pytest.mark.parametrize("level", CPU_LEVEL_PARAMS)
    def test_matches_the_reference(self, runs, level):
        runs.check_against_reference(level)

    @NEEDS_NATIVE
    def test_every_level_gives_the_same_bytes(self, runs):
        runs.check_levels_agree()


def run_cases(cases: dict[str, LevelCase]) -> dict[str, list[torch.Tensor]]:
    """Every case by the native kernels of this process (in a level's process)."""
    return {name: [t.clone() for t in case.run(native)] for name, case in cases.items()}


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
        assert torch.equal(bits(w.reshape(-1)), bits(g.reshape(-1))), (name, position)


# --------------------------------------------------------------------------- in the hook


def _train(rank: int, world_size: int, kernels: str, hook_options: dict):
    import sparsecomm
    from ddp_models import fit_doubling, mlp

    os.environ["SPARSECOMM_KERNELS"] = kernels  # read at every dispatch
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(mlp(width=64, depth=3), bucket_cap_mb=0.01)
    # budget="bucket": several buckets, each its own payload (the model budget would not fuse).
    state = sparsecomm.register_topk_hook(ddp, density=0.02, verify_conservation=True, budget="bucket",
                                          **hook_options)
    return fit_doubling(ddp, rank, 6, 64), state.stats()["last_step"]


def assert_the_hook_trains_with_the_kernels_as_with_the_reference(hook_options: dict) -> list[tuple[dict, dict]]:
    """Six steps of an MLP under DDP on 2 ranks with ``register_topk_hook(**hook_options)``, the
    kernels chosen as usual and the reference forced: not one bit of the parameters, nor of the
    bytes sent, differs (the hook's own conservation audit checks every call). Returns each
    rank's last-step stats of both runs."""
    from rank_processes import run_on_ranks

    with_kernels = run_on_ranks(_train, "auto", hook_options, world_size=2, timeout=180)
    reference_only = run_on_ranks(_train, "reference", hook_options, world_size=2, timeout=180)
    stats = []
    for (params_a, last_a), (params_b, last_b) in zip(with_kernels, reference_only):
        assert all(torch.equal(a, b) for a, b in zip(params_a, params_b))
        assert last_a["bytes_sent"] == last_b["bytes_sent"]
        stats.append((last_a, last_b))
    return stats
