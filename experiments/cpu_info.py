"""The CPU a benchmark ran on, to print beside every CPU figure: model and vector ISA.

The native kernels choose their SIMD path by the instruction set (AVX-512 or AVX2), so a
CPU figure means little without it.
"""
import os
import platform
from pathlib import Path


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


def describe_cpu() -> str:
    """E.g. "AMD EPYC 7B13, AVX2, 2 cores"."""
    return f"{cpu_model()}, {vector_isa()}, {os.cpu_count()} cores"
