"""The CPU a benchmark ran on, to print beside every CPU figure: model, vector ISA, kernel level.

The native kernels run at one instruction-set level per process (default, avx2 or avx512:
the widest the CPU supports unless SPARSECOMM_CPU_CAPABILITY names a lower one; see
csrc/README.md, "CPU levels"), so a CPU figure means little without both.
"""
import os
import platform
from pathlib import Path

from sparsecomm.ops import native


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def vector_isa(flags: set[str] | None = None) -> str:
    """The widest x86 vector extension this CPU has ("AVX-512", "AVX2", ...), or the architecture."""
    flags = cpu_flags() if flags is None else flags
    for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX"), ("sse4_2", "SSE4.2")):
        if flag in flags:
            return name
    return platform.machine()


def kernel_level() -> str:
    """The native CPU kernels' level in this process and the compiled ones, e.g.
    "avx512 (compiled: default, avx2, avx512)"."""
    loaded, _ = native.load()
    if not loaded:
        return "none (sparsecomm._C not built: pure-torch reference)"
    try:
        level = native.cpu_capability()
    except RuntimeError as error:  # SPARSECOMM_CPU_CAPABILITY names a level this CPU lacks
        level = f"refused ({error})"
    return f"{level} (compiled: {', '.join(native.compiled_cpu_levels())})"


def describe_cpu() -> str:
    """E.g. "AMD EPYC 7B13, AVX2, 2 cores, kernels: avx2 (compiled: default, avx2, avx512)"."""
    return f"{cpu_model()}, {vector_isa()}, {os.cpu_count()} cores, kernels: {kernel_level()}"
