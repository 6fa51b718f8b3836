"""Every CUDA source (``csrc/cuda/*.cu``) compiles with nvcc against the running torch's headers.

No GPU and no CUDA build of torch are needed, only ``nvcc`` on PATH: a CPU torch wheel ships
the ATen/c10 CUDA headers. It lacks one generated header, ``c10/cuda/impl/cuda_cmake_macros.h``
(its only content, ``C10_CUDA_BUILD_SHARED_LIBS``, matters for Windows dllexport); when it is
missing, ``-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE`` (c10's own switch) skips the include. The
sources avoid ``ATen/cuda/CUDAContext.h`` on purpose: it includes cuBLAS/cuSPARSE headers,
which a bare nvcc toolkit does not have.

Flags mirror what torch's BuildExtension gives a CUDAExtension: ``COMMON_NVCC_FLAGS``
(``-D__CUDA_NO_HALF_OPERATORS__`` ... ``--expt-relaxed-constexpr``), ``-fPIC``,
``-DTORCH_EXTENSION_NAME=_C`` and the running torch's ``_GLIBCXX_USE_CXX11_ABI``; the target
is ``sm_90`` (H100/H200). The language standard is C++17 (torch 2.13's own BuildExtension
uses C++20, under which the sources compile as well; torch's headers only warn under C++17).
The files compile in parallel, objects go to ``tmp_path``; on a loaded 2-core machine this
takes about 1.5-2 minutes.
"""
import os
import shutil
import subprocess
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CUDA_SOURCES = sorted((ROOT / "csrc" / "cuda").glob("*.cu"))
NVCC = shutil.which("nvcc")
STD = "c++17"
ARCH = "sm_90"


def _nvcc_command(source: Path, obj: Path) -> list[str]:
    from torch.utils import cpp_extension

    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    command = [NVCC, "-c", str(source), "-o", str(obj), f"-std={STD}", f"-arch={ARCH}",
               "-DTORCH_EXTENSION_NAME=_C", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
               "-Xcompiler", "-fPIC"]
    command += [flag for flag in cpp_extension.COMMON_NVCC_FLAGS if flag not in command]
    if "--expt-relaxed-constexpr" not in command:
        command.append("--expt-relaxed-constexpr")
    if not any(Path(path, "c10", "cuda", "impl", "cuda_cmake_macros.h").exists() for path in includes):
        command.append("-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE")  # CPU wheel: the generated header is missing
    command += [f"-I{path}" for path in includes]
    return command


def test_cuda_sources_exist():
    names = {source.name for source in CUDA_SOURCES}
    assert {"ef_topk_pack.cu", "ef_threshold_pack.cu", "topk_threshold.cu", "unpack_add.cu"} <= names, names


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
@pytest.mark.timeout(900)
def test_cuda_sources_compile(tmp_path):
    def compile_one(source: Path):
        started = time.monotonic()
        result = subprocess.run(_nvcc_command(source, tmp_path / f"{source.stem}.o"), capture_output=True, text=True,
                                cwd=ROOT)
        return source, result, time.monotonic() - started

    workers = max(1, min(len(CUDA_SOURCES), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(compile_one, CUDA_SOURCES))
    failures = [f"{source.relative_to(ROOT)} (exit {result.returncode}, {seconds:.0f}s):\n"
                f"{' '.join(result.args)}\n{result.stderr[-6000:]}{result.stdout[-2000:]}"
                for source, result, seconds in results if result.returncode != 0]
    assert not failures, "nvcc failed:\n\n" + "\n\n".join(failures)
    for source, _, _ in results:
        assert (tmp_path / f"{source.stem}.o").stat().st_size > 0
